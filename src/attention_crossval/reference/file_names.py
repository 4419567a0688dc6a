"""File names built from user text (kernel names, checks), safe inside the folder they go to.

A kernel's ``spec.name`` is free text, and the harness saves a failing case as
``<kernel>-<check>-<digest>.npz`` under ``--report-dir`` / ``finding_dir``. Taken verbatim, a
name ``../../x`` wrote outside that folder, ``a/b`` raised FileNotFoundError and a 300-character
name ENAMETOOLONG. Every such name goes through :func:`safe_file_name`.
"""

from __future__ import annotations

import hashlib
import re

# Characters kept as they are; anything else (separators, unicode, spaces, control) becomes "_".
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]")
#: Most characters a part of a name keeps before its hash suffix; parts of a case file's name
#: (two of them, plus a 16-digit digest and the suffix) stay well below the 255-byte limit.
MAX_PART = 64
_HASH_DIGITS = 8


def safe_part(text: str) -> str:
    """``text`` as one piece of a file name: only ``[A-Za-z0-9._+=-]``, no leading dot (so never
    ``.``, ``..`` or hidden), at most :data:`MAX_PART` characters before the suffix. Text that
    had to change (empty included) gets ``~`` and 8 hex digits of its sha256, so distinct
    texts stay distinct (``a/b`` and ``a_b`` give different names); text already safe is kept
    as it is."""
    if not isinstance(text, str):
        raise ValueError(f"file name part {text!r} must be a str")
    cleaned = _UNSAFE.sub("_", text).lstrip(".")[:MAX_PART]
    if cleaned == text and cleaned:
        return cleaned
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_DIGITS]
    return f"{cleaned or '_'}~{digest}"


def safe_file_name(*parts: str, suffix: str = "") -> str:
    """``parts`` made safe (:func:`safe_part`) and joined by ``-``, then ``suffix`` (a fixed
    extension such as ``.npz``, from the code, not the user)."""
    return "-".join(safe_part(part) for part in parts) + suffix
