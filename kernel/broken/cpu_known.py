"""CPU kernels that diverge on purpose and declare it as a known finding, to test the mechanism
(kernel/known_findings.py) without a GPU. Each mirrors a peer's real divergence:

* ``hidden_rows``: like sdpa-cudnn, a row that an explicit mask hides entirely gets the mean of
  V instead of O = 0 (``empty-rows``);
* ``reads_padding``: like flash-attn-cute with ``seqused_k``, it multiplies the padded V rows
  by 0 (``padding-read``: NaN there reaches every row of the batch);
* ``fixed``: declares ``reads_padding``'s finding but no longer reads padding (an upstream fix,
  which the strict-xfail test must report);
* ``reads_padding_and_wrong``: reads padding and also scales O by 1 + 2^-4 on causal cases, a
  bug no known finding covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attention_crossval.kernel.broken.cpu_faults import _spec, _streaming
from attention_crossval.kernel.known_findings import KnownFinding
from attention_crossval.kernel.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.masks import empty_rows

_LINK = "https://example.com/upstream-issue"  # a placeholder: these findings are made up
HIDDEN_ROWS = KnownFinding(
    check="empty-rows",
    mask_kinds=frozenset({"explicit"}),
    reason="a row the explicit mask hides entirely gets the mean of V (deliberate, for tests)",
    link=_LINK,
)
READS_PADDING = KnownFinding(
    check="padding-read",
    mask_kinds=frozenset({"varlen"}),
    reason="it multiplies the padded V rows by 0, so NaN there reaches the batch (deliberate)",
    link=_LINK,
)


@dataclass
class DivergentAdapter:
    """The streaming tier plus the ``divergence`` its spec declares (module docstring)."""

    divergence: str
    spec: KernelSpec
    checks: frozenset[str] = frozenset({"padding-read", "determinism", "nonfinite"})

    def __call__(self, case: AttentionCase) -> AttentionResult:
        result = _streaming(case)
        o = result.o
        if self.divergence == "hidden_rows" and case.mask.explicit is not None:
            hidden = empty_rows(case).transpose(0, 2, 1)  # [B, Sq, Hq]
            mean_v = case.v.astype(np.float64).mean(axis=1)  # [B, Hkv, Dv]
            heads = [case.kv_head(h) for h in range(case.Hq)]
            o = np.where(hidden[..., None], mean_v[:, None, heads], o)
        if self.divergence.startswith("reads_padding"):
            for b in range(case.B):
                o[b] += 0.0 * case.v[b, case.k_length(b) :].astype(np.float64).sum()
        if self.divergence == "reads_padding_and_wrong" and case.mask.causal:
            o = o * (1 + 2.0**-4)
        return AttentionResult(o=o, lse=result.lse)


def hidden_rows() -> DivergentAdapter:
    return DivergentAdapter("hidden_rows", _spec("cpu-hidden-rows", known_findings=(HIDDEN_ROWS,)))


def reads_padding() -> DivergentAdapter:
    spec = _spec("cpu-reads-padding", known_findings=(READS_PADDING,))
    return DivergentAdapter("reads_padding", spec)


def fixed() -> DivergentAdapter:
    return DivergentAdapter("fixed", _spec("cpu-fixed", known_findings=(READS_PADDING,)))


def reads_padding_and_wrong() -> DivergentAdapter:
    spec = _spec("cpu-reads-padding-and-wrong", known_findings=(READS_PADDING,))
    return DivergentAdapter("reads_padding_and_wrong", spec)
