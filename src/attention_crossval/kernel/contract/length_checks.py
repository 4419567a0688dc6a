"""The check a kernel API makes before trusting a case's valid lengths.

A case built by :class:`~reference.case.AttentionCase` never has lengths that disagree with its
tensors, but a kernel's API is called with whatever its caller computed: sequence lengths past
the tensor, negative ones, or one per batch too many. A kernel that trusts them reads past its
tensors (xformers#1122); one that declares ``KernelSpec.validates_lengths`` runs
:func:`check_lengths` (or its own equivalent) first and refuses.
"""

from __future__ import annotations

from attention_crossval.reference.case import AttentionCase


def check_lengths(case: AttentionCase) -> None:
    """ValueError naming the field and the rule unless ``case.mask.q_lengths`` and
    ``k_lengths`` (where set) have one entry per batch, each an int in ``[0, padded length]``:
    the packed offsets an adapter derives from them then end at the packed rows."""
    for name, limit in (("q_lengths", case.Sq), ("k_lengths", case.Sk)):
        lengths = getattr(case.mask, name)
        if lengths is None:
            continue
        if len(lengths) != case.B:
            raise ValueError(f"mask.{name} must have B={case.B} entries, got {len(lengths)}")
        if not all(isinstance(n, int) and 0 <= n <= limit for n in lengths):
            raise ValueError(
                f"mask.{name}={list(lengths)} must be ints in [0, {limit}] (the tensors' "
                "padded length)"
            )
