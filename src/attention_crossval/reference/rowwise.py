"""Float attention on chosen query rows, chunked over rows and keys (docs/long-context.md).

Long cases cannot afford a ``[Sq, Sk]`` array, nor an O(Sq Sk) CPU pass. This module computes
softmax attention in one float dtype (float64 for the reference, float32 for the cheap scan)
row chunk by row chunk, with an online softmax over key chunks, so memory is
``O(row_chunk * key_chunk)`` whatever the sizes. Without an explicit mask each row's visible keys
are one interval (:func:`reference.masks.key_ranges`), so key chunks outside a row chunk's
intervals are skipped: a causal prefill costs half of the dense work.

The same code runs on NumPy (CPU, no torch needed: what CPU tests cover) or torch (on the
GPU for long cases, or torch's CPU for tests of the torch path). :func:`row_scores` ranks every
row of a kernel's output against this reference, so the rows where the kernel looks worst can be
checked rigorously afterwards (:mod:`reference.sampling`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_crossval.reference.case import BIT_VIEWED, AttentionCase, AttentionResult, as_bits
from attention_crossval.reference.masks import key_ranges, visible

BACKENDS = ("numpy", "torch")
DTYPES = ("float32", "float64")


class _NumPy:
    """The array operations the chunk loop needs, on NumPy."""

    def __init__(self, dtype: str, device: str) -> None:
        self.dtype = np.dtype(dtype)
        self.exp, self.log, self.tanh = np.exp, np.log, np.tanh
        self.maximum, self.where, self.abs = np.maximum, np.where, np.abs

    def array(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            x = np.asarray(x, dtype=self.dtype)
        return np.where(np.isfinite(x), x, 0)  # padding and hidden keys may hold NaN / inf

    def index(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def full(self, shape: tuple[int, ...], value: float) -> np.ndarray:
        return np.full(shape, value, self.dtype)

    def arange(self, start: int, stop: int) -> np.ndarray:
        return np.arange(start, stop)

    def amax(self, x: np.ndarray, axis: int) -> np.ndarray:
        return x.max(axis=axis)

    def host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)


class _Torch:
    """The same operations on torch tensors of ``device``."""

    def __init__(self, dtype: str, device: str) -> None:
        import torch

        self.torch, self.device = torch, device
        self.dtype = getattr(torch, dtype)
        self.exp, self.log, self.tanh = torch.exp, torch.log, torch.tanh
        self.maximum, self.where, self.abs = torch.maximum, torch.where, torch.abs

    def array(self, x: np.ndarray) -> Any:
        # The input's bits go to the device and are widened there: torch has no NumPy bfloat16,
        # and a host float32 copy of a long K costs seconds. A writable copy of the (read-only)
        # case array, as torch.from_numpy wants; only one K or V head at a time.
        bits = x.dtype.name in BIT_VIEWED  # torch has these dtypes, NumPy only via ml_dtypes
        tensor = self.torch.from_numpy(np.array(as_bits(x) if bits else x)).to(self.device)
        if bits:
            tensor = tensor.view(getattr(self.torch, x.dtype.name))
        return self.torch.nan_to_num(tensor.to(self.dtype), nan=0.0, posinf=0.0, neginf=0.0)

    def index(self, x: np.ndarray) -> Any:
        return self.torch.from_numpy(np.array(x)).to(self.device)

    def full(self, shape: tuple[int, ...], value: float) -> Any:
        return self.torch.full(shape, value, dtype=self.dtype, device=self.device)

    def arange(self, start: int, stop: int) -> Any:
        return self.torch.arange(start, stop, device=self.device)

    def amax(self, x: Any, axis: int) -> Any:
        return self.torch.amax(x, dim=axis)

    def host(self, x: Any) -> np.ndarray:
        return x.double().cpu().numpy()


@dataclass(frozen=True)
class _Chunk:
    """One (batch, query head, row chunk): ``rows`` index the positions array; ``o`` / ``lse``
    stay on the backend, in its float dtype."""

    b: int
    h: int
    rows: slice
    o: Any
    lse: Any


def _check(case: AttentionCase, dtype: str, backend: str, row_chunk: int, key_chunk: int) -> None:
    if not isinstance(case, AttentionCase):
        raise ValueError(f"case must be an AttentionCase, got {type(case).__name__}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {DTYPES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    for name, value in (("row_chunk", row_chunk), ("key_chunk", key_chunk)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


def _positions(case: AttentionCase, positions: Any) -> np.ndarray:
    if positions is None:
        return np.arange(case.Sq, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    if positions.ndim != 1 or (
        positions.size and (positions.min() < 0 or positions.max() >= case.Sq)
    ):
        raise ValueError(f"positions must be a 1-D array of query positions in [0, {case.Sq})")
    return positions


def _chunks(
    case: AttentionCase,
    positions: np.ndarray,
    xp: Any,
    row_chunk: int,
    key_chunk: int,
) -> Iterator[_Chunk]:
    """Online softmax (natural log) of every (b, h, row chunk) over the visible key chunks."""
    scale, cap = case.softmax_scale, case.softcap
    explicit = case.mask.explicit is not None
    for b in range(case.B):
        if explicit:
            lo = np.zeros(len(positions), np.int64)
            hi = np.full(len(positions), case.k_length(b), np.int64)
        else:
            lo, hi = key_ranges(case, b, positions)
        for kv_head in range(case.Hkv):
            k = xp.array(case.k[b, :, kv_head])  # [Sk, D], padding zeroed
            v = xp.array(case.v[b, :, kv_head])
            # FP8 descales (1.0 without): q's and k's scale the scores, v's the output, so no
            # array is rescaled (a long case's K and V are the largest arrays here)
            score_scale = scale * case.descale("q", b, kv_head) * case.descale("k", b, kv_head)
            v_descale = case.descale("v", b, kv_head)
            for h in (h for h in range(case.Hq) if case.kv_head(h) == kv_head):
                start_m = -np.inf if case.sink is None else float(case.sink[h])
                for r0 in range(0, len(positions), row_chunk):
                    rows = slice(r0, min(r0 + row_chunk, len(positions)))
                    q = xp.array(case.q[b, positions[rows], h])
                    r_lo, r_hi = lo[rows], hi[rows]
                    m = xp.full((q.shape[0],), start_m)
                    l = xp.full((q.shape[0],), 0.0 if case.sink is None else 1.0)
                    o = xp.full((q.shape[0], case.Dv), 0.0)
                    lo_x, hi_x = xp.index(r_lo)[:, None], xp.index(r_hi)[:, None]
                    first = int(r_lo.min(initial=case.Sk))
                    last = int(np.max(np.where(r_hi > r_lo, r_hi, 0), initial=0))
                    for c0 in range(first - first % key_chunk, last, key_chunk):
                        cols = slice(c0, min(c0 + key_chunk, last))
                        s = q @ k[cols].T
                        if cap is None:
                            s = s * score_scale
                        else:
                            s = cap * xp.tanh(s * (score_scale / cap))
                        if explicit:
                            seen = xp.index(visible(case, b, h, positions[rows], cols))
                        else:
                            j = xp.arange(cols.start, cols.stop)[None, :]
                            seen = (j >= lo_x) & (j < hi_x)
                        s = xp.where(seen, s, -np.inf)
                        m_new = xp.maximum(m, xp.amax(s, 1))
                        m_safe = xp.where(m_new == -np.inf, 0.0, m_new)
                        alpha = xp.exp(m - m_safe)  # 0 while the row has seen nothing
                        p = xp.exp(s - m_safe[:, None])
                        l = l * alpha + p.sum(1)
                        o = o * alpha[:, None] + p @ v[cols]
                        m = m_new
                    nonempty = l > 0
                    o = o / xp.where(nonempty, l, 1.0)[:, None] * v_descale
                    o = xp.where(nonempty[:, None], o, 0.0)
                    lse = xp.where(nonempty, m + xp.log(xp.where(nonempty, l, 1.0)), -np.inf)
                    yield _Chunk(b, h, rows, o, lse)


def rowwise_attention(
    case: AttentionCase,
    positions: Any = None,
    *,
    dtype: str = "float64",
    backend: str = "numpy",
    device: str = "cpu",
    row_chunk: int = 1024,
    key_chunk: int = 8192,
) -> AttentionResult:
    """Attention in ``dtype`` on query ``positions`` (shared by every batch and head; None =
    all rows): ``o [B, n, Hq, Dv]`` and ``lse [B, Hq, n]`` (natural log) as float64 NumPy, for
    ``n = len(positions)``. Empty rows give ``O = 0``, ``LSE = -inf`` (the sink with one)."""
    _check(case, dtype, backend, row_chunk, key_chunk)
    positions = _positions(case, positions)
    xp = (_Torch if backend == "torch" else _NumPy)(dtype, device)
    o = np.zeros((case.B, len(positions), case.Hq, case.Dv))
    lse = np.zeros((case.B, case.Hq, len(positions)))
    for chunk in _chunks(case, positions, xp, row_chunk, key_chunk):
        o[chunk.b, chunk.rows, chunk.h] = xp.host(chunk.o)
        lse[chunk.b, chunk.h, chunk.rows] = xp.host(chunk.lse)
    return AttentionResult(o=o, lse=lse)


def row_scores(
    case: AttentionCase,
    result: AttentionResult,
    *,
    dtype: str = "float32",
    backend: str = "numpy",
    device: str = "cpu",
    row_chunk: int = 4096,
    key_chunk: int = 8192,
) -> np.ndarray:
    """``[B, Hq, Sq]``: how wrong each row of ``result`` (a kernel's full output) looks against
    attention in ``dtype`` on every row: ``max_c |o - o_ref| / max_c |o_ref|`` plus the LSE's
    absolute error (inf where the kernel is non-finite). A ranking, not a verdict: the rows it
    puts first are then checked against the float64 and exact tiers with the derived bound."""
    _check(case, dtype, backend, row_chunk, key_chunk)
    positions = _positions(case, None)
    xp = (_Torch if backend == "torch" else _NumPy)(dtype, device)
    scores = np.zeros((case.B, case.Hq, case.Sq))
    tiny = float(np.finfo(np.float32).tiny)
    for chunk in _chunks(case, positions, xp, row_chunk, key_chunk):
        got = np.asarray(result.o[chunk.b, chunk.rows, chunk.h], dtype=np.float64)
        ref = xp.host(chunk.o)
        with np.errstate(invalid="ignore"):
            error = np.abs(got - ref).max(axis=1, initial=0.0)
            error /= np.maximum(np.abs(ref).max(axis=1, initial=0.0), tiny)
        error = np.where(np.isfinite(got).all(axis=1), error, np.inf)
        if result.lse is not None:
            lse_got = np.asarray(result.lse[chunk.b, chunk.h, chunk.rows], dtype=np.float64)
            lse_ref = xp.host(chunk.lse)
            with np.errstate(invalid="ignore"):
                lse_err = np.where(lse_got == lse_ref, 0.0, np.abs(lse_got - lse_ref))
            error = error + np.where(np.isnan(lse_err), np.inf, lse_err)
        scores[chunk.b, chunk.h, chunk.rows] = error
    return scores
