"""Gradient references at GPU sizes: float64 on every element, exact on samples, the bounds.

One :class:`BackwardReferences` per backward case holds every reference tier, computed lazily
and once, so the backward harness (:mod:`kernel.harness.backward`) and the report
(:mod:`report.backward`) compare kernels the same way:

* ``float64``: dq, dk, dv in float64 on every element: a dense torch computation on the GPU,
  chunked over query rows so memory stays ``O(chunk * Sk)`` (:func:`torch_float64_gradients`),
  for a CUDA kernel's large cases when CUDA is there; else the streaming backward in float64,
  whose memory grows with its block sizes only;
* ``exact``: the exact tier (:mod:`reference.exact_backward`) on ``samples`` query rows (dq)
  and ``samples`` key columns (dk, dv) per batch and head;
* ``streaming``: the emulation of a declared backward chain with the kernel's tile sizes;
* the derived per-element bounds of a chain (:mod:`reference.bounds_backward`), with the
  count of vacuous elements (a bound no smaller than the terms the element sums).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.phases import in_phase
from attention_crossval.kernel.harness.references import TORCH_WORK, timed_memo, work
from attention_crossval.reference.bounds_backward import backward_error_bound
from attention_crossval.reference.case import AttentionResult
from attention_crossval.reference.compare import ErrorReport, compare
from attention_crossval.reference.exact import sample_rows
from attention_crossval.reference.exact_backward import exact_backward, sample_keys
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import visible
from attention_crossval.reference.precision import BackwardPrecision
from attention_crossval.reference.streaming_backward import streaming_backward

GRADIENTS = ("dq", "dk", "dv")
CHUNK_ELEMENTS = 1 << 24  # float64 elements of one [Hq, rows, Sk] score chunk (128 MiB)


def gradient_dtype(spec: KernelSpec, dtype: str) -> str:
    """The dtype whose spacing measures a kernel's gradient ulps: the declared backward chain's
    ``output_dtype``, else its accumulator's (the values such a chain returns)."""
    precision = spec.backward_precision_for(dtype)
    return precision.output_dtype or precision.accum_dtype


def as_result(gradient: np.ndarray) -> AttentionResult:
    """A gradient ``[B, S, H, X]`` in the shape :func:`reference.compare.compare` reads (its
    ``o``); rows selections are then ``[B, H, S]``."""
    return AttentionResult(o=np.asarray(gradient, dtype=np.float64), lse=None)


@dataclass
class BackwardReferences:
    """Every gradient reference of one backward case, computed lazily, shared by the kernels.

    ``samples``: query rows (dq) and key columns (dk, dv) per batch and head for the exact
    tier (0: no exact tier); ``device``: where the kernel runs ("cuda" lets the float64
    reference use torch). ``timings`` accumulates seconds per tier.
    """

    case: BackwardCase
    samples: int = 4
    seed: int = 0
    prec_bits: int = 128
    device: str = "cpu"
    timings: dict[str, float] = field(default_factory=dict)
    _memo: dict = field(default_factory=dict, repr=False)

    def _timed(self, key: Any, label: str, compute: Callable[[], Any]) -> Any:
        return timed_memo(self._memo, self.timings, key, label, compute)

    def float64(self) -> Gradients:
        """dq, dk, dv in float64 on every element."""
        return self._timed(
            "float64", "float64_s", lambda: float64_gradients(self.case, self.device)
        )

    def exact(self) -> Any:
        """The exact tier's ``ExactGradients`` on the sampled rows and keys, or None."""
        if self.samples < 1:
            return None

        def compute() -> Any:
            rows = sample_rows(self.case.forward, self.samples, self.seed)
            keys = sample_keys(self.case, self.samples, self.seed)
            return exact_backward(self.case, rows=rows, keys=keys, prec_bits=self.prec_bits)

        return self._timed("exact", "exact_s", compute)

    def streaming(self, precision: BackwardPrecision, tile_m: int, tile_n: int) -> Gradients:
        """The emulated gradients of ``precision`` with the kernel's tiles."""
        return self._timed(
            ("streaming", precision, tile_m, tile_n),
            "streaming_s",
            lambda: streaming_backward(self.case, precision, block_m=tile_m, block_n=tile_n),
        )

    def bounds(self, precision: BackwardPrecision, tile_n: int) -> Any:
        """The derived per-element ``GradientBounds`` of ``precision`` after a forward with K
        tiles of ``tile_n``, from the float64 gradients."""
        reference = self.float64()
        return self._timed(
            ("bound", precision, tile_n),
            "bound_s",
            lambda: backward_error_bound(self.case, precision, reference, block_n=tile_n),
        )

    @in_phase("compare")
    def compare(
        self, tested: Gradients, tier: str, spec: KernelSpec, *, scale: float = 1.0
    ) -> dict[str, ErrorReport] | None:
        """Per gradient, ``reference.compare.compare`` of ``tested`` against ``tier``
        ("exact": its samples, "float64": every element, "streaming": the emulation of the
        declared chain) with ``scale`` times the derived bounds, ulps in
        :func:`gradient_dtype`; None without an exact tier."""
        precision = spec.backward_precision_for(self.case.forward.dtype)
        rows = dict.fromkeys(GRADIENTS)
        if tier == "exact":
            exact = self.exact()
            if exact is None:
                return None
            references = {
                g: _Exact(getattr(exact, g), getattr(exact, f"{g}_lo")) for g in GRADIENTS
            }
            # compared on the evaluated rows and keys only, not on arrays of NaN
            rows = {"dq": exact.rows, "dk": exact.keys, "dv": exact.keys}
        elif tier in ("float64", "streaming"):
            gradients = (
                self.float64()
                if tier == "float64"
                else self.streaming(precision, spec.tile_m, spec.tile_n)
            )
            references = {g: as_result(getattr(gradients, g)) for g in GRADIENTS}
        else:
            raise ValueError(f"tier={tier!r} must be 'exact', 'float64' or 'streaming'")
        bounds = self.bounds(precision, spec.tile_n)
        dtype = gradient_dtype(spec, self.case.forward.dtype)
        return {
            g: compare(
                as_result(getattr(tested, g)),
                references[g],
                bound=getattr(bounds, g) * scale,
                output_dtype=dtype,
                rows=rows[g],
                undefined=getattr(bounds, f"{g}_undefined"),
            )
            for g in GRADIENTS
        }


@dataclass(frozen=True)
class _Exact:
    """An exact gradient in the shape ``compare`` reads: ``o + o_lo`` (NaN: not evaluated)."""

    o: np.ndarray
    o_lo: np.ndarray
    lse: None = None


def float64_gradients(case: BackwardCase, device: str = "cpu") -> Gradients:
    """float64 gradients on every element: dense torch on the GPU for a CUDA kernel's large
    cases (above :data:`kernel.harness.references.TORCH_WORK` multiply-adds, when CUDA is there),
    else
    the streaming backward in float64 (each correct to a few float64 ulps; the exact tier
    certifies the samples)."""
    if device == "cuda" and work(case.forward) > TORCH_WORK:
        from attention_crossval.kernel.harness.gpu_workers import cuda_available

        if cuda_available()[0]:
            return torch_float64_gradients(case)
    return streaming_backward(case, BackwardPrecision.float64())


def torch_float64_gradients(case: BackwardCase, device: str = "cuda") -> Gradients:
    """Dense float64 gradients with torch, one batch and one chunk of query rows at a time:
    ``S = scale Q K^T`` (masked), ``P = exp(S - LSE)``, ``O = P V``, ``D = rowsum(dO * O)``,
    ``dS = P (dO V^T - D)``, ``dq = scale dS K``, ``dk += scale dS^T Q``, ``dv += P^T dO``,
    dk/dv of the query heads summed per kv head. Padding is zeroed first (never read)."""
    import torch

    fwd = case.forward
    g, scale = fwd.group_size, fwd.softmax_scale

    def load(array: np.ndarray, valid: np.ndarray) -> Any:
        values = np.where(valid, np.asarray(array, dtype=np.float64), 0.0)
        return torch.from_numpy(values).to(device)

    dq = np.zeros((fwd.B, fwd.Sq, fwd.Hq, fwd.D))
    dk = np.zeros((fwd.B, fwd.Sk, fwd.Hkv, fwd.D))
    dv = np.zeros((fwd.B, fwd.Sk, fwd.Hkv, fwd.Dv))
    chunk = max(1, CHUNK_ELEMENTS // max(1, fwd.Hq * fwd.Sk))
    for b in range(fwd.B):
        rows_ok = (np.arange(fwd.Sq) < fwd.q_length(b))[:, None, None]
        keys_ok = (np.arange(fwd.Sk) < fwd.k_length(b))[:, None, None]
        q, do = load(fwd.q[b], rows_ok), load(case.do[b], rows_ok)
        k = load(fwd.k[b], keys_ok).repeat_interleave(g, dim=1)  # [Sk, Hq, D]
        v = load(fwd.v[b], keys_ok).repeat_interleave(g, dim=1)
        dk_b = torch.zeros_like(k)
        dv_b = torch.zeros_like(v)
        for i0 in range(0, fwd.Sq, chunk):
            rows = slice(i0, min(i0 + chunk, fwd.Sq))
            seen = np.stack([visible(fwd, b, h, rows) for h in range(fwd.Hq)])
            seen = torch.from_numpy(seen).to(device)  # [Hq, rows, Sk]
            s = torch.einsum("ihd,jhd->hij", q[rows], k) * scale
            s = s.masked_fill(~seen, float("-inf"))
            lse = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf on empty rows
            p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0))
            o = torch.einsum("hij,jhd->ihd", p, v)
            d = (do[rows] * o).sum(dim=-1)  # [rows, Hq]
            if case.dlse is not None:
                d = d - load(case.dlse[b, :, rows].T, rows_ok[rows, :, 0])
            ds = p * (torch.einsum("ihd,jhd->hij", do[rows], v) - d.T[..., None])
            dq[b, rows] = (torch.einsum("hij,jhd->ihd", ds, k) * scale).cpu().numpy()
            dk_b += torch.einsum("hij,ihd->jhd", ds, q[rows]) * scale
            dv_b += torch.einsum("hij,ihd->jhd", p, do[rows])
        dk[b] = dk_b.view(fwd.Sk, fwd.Hkv, g, fwd.D).sum(dim=2).cpu().numpy()
        dv[b] = dv_b.view(fwd.Sk, fwd.Hkv, g, fwd.Dv).sum(dim=2).cpu().numpy()
    return Gradients(dq=dq, dk=dk, dv=dv)
