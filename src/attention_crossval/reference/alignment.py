"""Where the causal diagonal sits, in a module of its own: the case model and the visibility
predicate (reference/masks.py) both need it, and a mutant of masks.py (attention_crossval.testing)
must compare against the same enum the cases carry, not a re-executed copy."""

from __future__ import annotations

import enum


class CausalAlignment(enum.Enum):
    """Where the causal diagonal sits when Sq != Sk; windows are relative to the same diagonal."""

    BOTTOM_RIGHT = "bottom_right"  # FlashAttention: key j visible from query i iff j <= i + Sk - Sq
    TOP_LEFT = "top_left"  # torch SDPA is_causal: key j visible from query i iff j <= i
