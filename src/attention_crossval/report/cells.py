"""One table cell of the report: a number or a message as the Markdown and HTML tables, the
summary, the backward table and the report diff all print it."""

from __future__ import annotations


def fmt(value, digits: int = 3) -> str:
    """Compact number: 3 significant digits, ints as is, "-" for missing."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}"


def first_line(message: str | None, limit: int = 120) -> str:
    """A message as one table cell: its last non-empty line (a traceback's exception) cut to
    ``limit`` characters, with no ``|``."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    text = (lines[-1] if lines else "").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"
