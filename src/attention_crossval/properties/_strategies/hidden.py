"""Cases with keys that no query can see, hidden by the mask rather than only by padding.

The bug class: a kernel loads a K/V tile that the causal, window or explicit mask hides from
every query, weights it by 0 and computes ``0 * NaN = NaN`` (``kernel.harness.hidden_nan``). Only
padding was ever poisoned before, so a case must hide keys *through its mask*. A drawn case
that already does is kept (``hidden=mask``); otherwise, where the spec allows explicit masks,
an explicit mask hides a few drawn key columns (``hidden=explicit``); else it is rejected.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import assume, event
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.hidden_nan import masked_hidden_keys, poison_hidden
from attention_crossval.reference.case import AttentionCase


@st.composite
def _hidden_key_cases(
    draw: st.DrawFn, base: st.SearchStrategy[AttentionCase], explicit: bool, poison: bool
) -> AttentionCase:
    case = draw(base)
    how = "mask"
    if not masked_hidden_keys(case).any():
        longest = max(case.k_length(b) for b in range(case.B))
        assume(explicit and longest > 0)
        columns = draw(st.lists(st.integers(0, longest - 1), min_size=1, max_size=3))
        keep = np.ones((1, 1, 1, case.Sk), dtype=bool)
        keep[..., columns] = False
        explicit_mask = keep if case.mask.explicit is None else case.mask.explicit & keep
        case = dataclasses.replace(
            case, mask=dataclasses.replace(case.mask, explicit=explicit_mask)
        )
        how = "explicit"
    assume(masked_hidden_keys(case).any())  # e.g. a column hidden only for a padded batch
    event(f"hidden: {how}")
    case = dataclasses.replace(case, label=f"{case.label} hidden={how}".strip())
    return poison_hidden(case) if poison else case


def hidden_key_cases(
    base: st.SearchStrategy[AttentionCase], *, spec: KernelSpec, poison: bool = True
) -> st.SearchStrategy[AttentionCase]:
    """Cases of ``base`` in which the mask hides at least one key from every query, with NaN in
    K and V at every hidden key when ``poison`` (the inputs ``kernel.harness.hidden_nan`` gives a
    kernel). ``spec`` says whether explicit masks may be added to hide keys."""
    if not isinstance(spec, KernelSpec):
        raise ValueError(f"spec={spec!r} must be a KernelSpec")
    return _hidden_key_cases(base, "explicit" in spec.mask_kinds, poison)
