"""Opt-in harness check ``hidden-nan``: NaN in K/V rows that no query can see.

``padding-read`` poisons only padding. A kernel can also load a K/V tile whose keys the causal,
window or explicit mask hides from every query, give them weight 0 and still compute
``0 * NaN = NaN``. Real buffers hold anything there (a KV cache's stale or uninitialised
entries), so that is a bug. This check runs the kernel once more on a copy of the case with NaN
in every hidden key's K and V (:func:`reference.masks.hidden_keys`, padding included where
the ``padding-read`` check applies) and reports the non-empty rows that turn non-finite although
the clean run gave finite values.

Hook for :func:`kernel.harness.forward.run_case`, after ``_analyse`` (the check runs only where an
adapter lists ``"hidden-nan"`` in its ``checks``)::

    if "hidden-nan" in checks and result is not None:
        findings += hidden_nan_findings(
            case, result, lambda c: call(c, "zero").result, padding="padding-read" in checks
        )
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from attention_crossval.kernel.harness.verdict import Finding
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.masks import empty_rows, hidden_keys

CHECK = "hidden-nan"


def masked_hidden_keys(case: AttentionCase) -> np.ndarray:
    """Bool ``[B, Sk, Hkv]``: hidden keys (:func:`reference.masks.hidden_keys`) that are not
    padding, so only a mask hides them."""
    valid = (
        np.arange(case.Sk)[None, :] < np.array([case.k_length(b) for b in range(case.B)])[:, None]
    )
    return hidden_keys(case) & valid[:, :, None]


def _hidden(case: AttentionCase, padding: bool) -> np.ndarray:
    """The hidden keys ``[B, Sk, Hkv]``; without ``padding``, only those a mask hides."""
    return hidden_keys(case) if padding else masked_hidden_keys(case)


def poison_hidden(
    case: AttentionCase, value: float = np.nan, *, padding: bool = True
) -> AttentionCase:
    """A copy of ``case`` with ``value`` in K and V at every hidden key (without ``padding``,
    at the keys a mask hides only)."""
    hidden = _hidden(case, padding)[..., None]
    k = np.where(hidden, value, case.k.astype(np.float32)).astype(case.k.dtype)
    v = np.where(hidden, value, case.v.astype(np.float32)).astype(case.v.dtype)
    return dataclasses.replace(case, k=k, v=v)


def hidden_nan_findings(
    case: AttentionCase,
    clean: AttentionResult,
    run: Callable[[AttentionCase], AttentionResult],
    *,
    padding: bool = True,
) -> list[Finding]:
    """``[Finding("hidden-nan", ...)]`` when ``run`` on the poisoned case turns a non-empty
    row non-finite that ``clean`` (the kernel's result on ``case``) has finite; else ``[]``.
    A case without hidden keys runs nothing. ``padding=False`` leaves padding out of the
    poisoned keys: for a kernel whose padding reads are checked elsewhere or known (the
    ``padding-read`` rerun of a known finding), so that read is not reported again here."""
    hidden = _hidden(case, padding)
    if not hidden.any():
        return []
    poisoned = run(poison_hidden(case, padding=padding))
    rows = ~empty_rows(case).transpose(0, 2, 1)  # [B, Sq, Hq]: NaN empty rows are declared
    turned = rows & np.isfinite(clean.o).all(axis=-1) & ~np.isfinite(poisoned.o).all(axis=-1)
    if clean.lse is not None and poisoned.lse is not None:
        clean_lse, lse = clean.lse.transpose(0, 2, 1), poisoned.lse.transpose(0, 2, 1)
        turned |= rows & np.isfinite(clean_lse) & ~np.isfinite(lse)
    if not turned.any():
        return []
    b, i, h = (int(x) for x in np.argwhere(turned)[0])
    return [
        Finding(
            CHECK,
            f"{int(turned.sum())} rows turned non-finite with NaN in {int(hidden.sum())} K/V "
            f"rows that no query sees (masked keys read and weighted by 0), first at "
            f"(b, i, h) = ({b}, {i}, {h})",
        )
    ]
