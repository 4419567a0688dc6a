"""The one exception of the contract: a kernel refusing a case."""

from __future__ import annotations


class Declined(Exception):
    """Raised by an adapter whose kernel refuses a case its spec cannot rule out (e.g. an SDPA
    backend with "No available kernel"); the verdict is then skipped with this reason."""
