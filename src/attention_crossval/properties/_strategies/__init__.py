"""Implementation modules of :mod:`properties.strategies` (import from there, not from here)."""
