"""CPU kernels that diverge on purpose and declare it as a known finding, to test the mechanism
(kernel/contract/known_findings.py) without a GPU. Each mirrors a peer's real divergence:

* ``hidden_rows``: like sdpa-cudnn, a row that an explicit mask hides entirely gets the mean of
  V instead of O = 0 (``empty-rows``), and the gradient of that uniform attention in the
  backward (``zero-grad``: nonzero dq on the row, and dk/dv of every key gain its share);
* ``hidden_rows_and_wrong``: ``hidden_rows``, with dv also scaled by 1 + 2^-4, a bug no known
  finding covers;
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

from attention_crossval.kernel.contract.known_findings import KnownFinding
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import empty_rows
from attention_crossval.reference.precision import BackwardPrecision
from attention_crossval.reference.streaming_backward import streaming_backward
from attention_crossval.testing.broken.cpu_faults import _spec, _streaming

_LINK = "https://example.com/upstream-issue"  # a placeholder: these findings are made up
HIDDEN_ROWS = KnownFinding(
    check="empty-rows",
    mask_kinds=frozenset({"explicit"}),
    reason="a row the explicit mask hides entirely gets the mean of V (deliberate, for tests)",
    link=_LINK,
)
HIDDEN_ROW_GRADIENTS = KnownFinding(
    check="zero-grad",
    mask_kinds=frozenset({"explicit"}),
    reason="a row the explicit mask hides entirely gets the gradient of uniform attention "
    "(deliberate, for tests)",
    link=_LINK,
    backward=True,
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
    backward_checks: frozenset[str] = frozenset({"padding-read", "determinism", "nonfinite"})

    def __call__(self, case: AttentionCase) -> AttentionResult:
        result = _streaming(case)
        o = result.o
        if self.divergence.startswith("hidden_rows") and case.mask.explicit is not None:
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

    def backward(self, case: BackwardCase) -> Gradients:
        precision = BackwardPrecision.flash_attention(case.forward.dtype)
        grads = streaming_backward(case, precision, block_m=16, block_n=16)
        dq, dk, dv = np.array(grads.dq), np.array(grads.dk), np.array(grads.dv)
        if self.divergence.startswith("hidden_rows") and case.forward.mask.explicit is not None:
            _add_uniform_attention_gradient(case, dq, dk, dv)
        if self.divergence == "hidden_rows_and_wrong":
            dv = dv * (1 + 2.0**-4)
        return Gradients(dq=dq, dk=dk, dv=dv)


def _add_uniform_attention_gradient(
    case: BackwardCase, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray
) -> None:
    """The gradient of ``O_i = mean_j v_j`` (P_ij = 1 / Sk) on every hidden row, in place."""
    f = case.forward
    hidden = empty_rows(f)  # [B, Hq, Sq]
    for b, h in zip(*np.nonzero(hidden.any(axis=2)), strict=True):
        rows = np.nonzero(hidden[b, h])[0]
        kv = f.kv_head(h)
        q, k, v = (x.astype(np.float64) for x in (f.q[b, rows, h], f.k[b, :, kv], f.v[b, :, kv]))
        do = case.do[b, rows, h].astype(np.float64)
        p = 1.0 / f.Sk
        d = do @ v.mean(axis=0)  # D = dO . O
        ds = p * (do @ v.T - d[:, None])  # dS = P (dP - D)
        dq[b, rows, h] += f.softmax_scale * ds @ k
        dk[b, :, kv] += f.softmax_scale * ds.T @ q
        dv[b, :, kv] += p * do.sum(axis=0)


def hidden_rows() -> DivergentAdapter:
    return DivergentAdapter("hidden_rows", _hidden_rows_spec("cpu-hidden-rows"))


def hidden_rows_and_wrong() -> DivergentAdapter:
    return DivergentAdapter("hidden_rows_and_wrong", _hidden_rows_spec("cpu-hidden-rows-and-wrong"))


def _hidden_rows_spec(name: str) -> KernelSpec:
    known = (HIDDEN_ROWS, HIDDEN_ROW_GRADIENTS)
    return _spec(name, known_findings=known, backward=True, backward_deterministic=True)


def reads_padding() -> DivergentAdapter:
    spec = _spec("cpu-reads-padding", known_findings=(READS_PADDING,))
    return DivergentAdapter("reads_padding", spec)


def fixed() -> DivergentAdapter:
    return DivergentAdapter("fixed", _spec("cpu-fixed", known_findings=(READS_PADDING,)))


def reads_padding_and_wrong() -> DivergentAdapter:
    spec = _spec("cpu-reads-padding-and-wrong", known_findings=(READS_PADDING,))
    return DivergentAdapter("reads_padding_and_wrong", spec)
