"""Test fixtures, not product: deliberately broken kernels and mutated reference tiers that
show each check and property catches the bug it names."""
