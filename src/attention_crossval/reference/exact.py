"""Tier 1: certified multi-precision attention on all rows or a sample of rows.

Every input is a dyadic rational (an fp16/bf16/fp32 value), so the scores ``q . k`` are computed
exactly as integers. Only three steps are inexact, and each runs at ``prec_bits`` (default 128):

1. ``p_j = exp(c (s_j - m))`` with ``c = softmax_scale`` and ``m`` the exact row maximum, evaluated
   with mpmath's fixed-point exponential (``libelefun.exp_fixed``) into integers
   ``P_j ~ p_j 2^F``, ``F = prec_bits``. The maximum's weight is exactly ``2^F``.
2. ``O = (sum_j P_j v_j) / (sum_j P_j)``: numerator and row sum are exact integers; one mpmath
   division rounds to ``prec_bits``. ``o`` is the nearest double and ``o_lo`` the double nearest
   the remainder, so ``o + o_lo`` carries ~106 bits and can be rounded correctly to 16-bit dtypes.
3. ``LSE = c m + ln(sum_j P_j 2^-F)`` (natural log), one mpmath log and one addition.

FP8 inputs with descales (docs/fp8.md): the case means attention of ``q q_descale``,
``k k_descale``, ``v v_descale``. Each product of an FP8 value (at most 4 significant bits) and a
float32 descale (24) is exact in float64, so the tier reads the dequantized values
(:func:`_dequantized`) and everything below holds for them unchanged.

Exact integer products run as float64 GEMMs on limbs: a matrix of integers is split into signed
limbs narrow enough that every partial sum of a limb product stays below 2^53, so BLAS returns
exact integers whatever its summation order; limb products are recombined in Python ints.

Certified bound (per row, every column). Let ``n`` be the number of visible keys, ``u = 2^-F``,
``P~_j = P_j u`` and ``L~ = sum P~_j >= 1`` (the maximum contributes exactly 1). Each weight obeys
``|P~_j - p_j| <= delta = (EXP_FIXED_ERROR_BOUND + 2) u``: the exp argument is truncated to ``F``
fractional bits (``|exp(x~) - exp(a)| <= |x~ - a| <= u`` since both are <= 0), ``exp_fixed`` is
within ``EXP_FIXED_ERROR_BOUND`` units of ``u`` (an *assumption* about mpmath, not proved here:
checked by sampling in ``properties/test_exact.py``), and a weight below ``2^-(F+2)`` is set to 0
without evaluating exp. Because ``sum p_j (v_j - O) = 0``,

    O~ - O = sum_j (P~_j - p_j) (v_j - O) / L~,   so   |O~ - O| <= n delta R / L~,

with ``R`` the largest range ``max_j v_jc - min_j v_jc`` over columns (``O_c`` lies inside the
range). To that add the division's rounding ``2^(1-prec_bits) |O|`` and the double-double's
``2^-104 |O| + 2^-1074``. For the LSE, ``|ln L~ - ln L| <= n delta`` (both sums are >= 1), plus
``2^(8-prec_bits) |ln L~|`` for mpmath's log (a generous allowance), the addition's
``2^(1-prec_bits) |LSE|``, and half an ulp of the returned double. Bounds are evaluated in
float64 and inflated by ``1 + 2^-30`` to cover their own rounding.

Masked keys get ``p = 0`` exactly and their K/V entries are never read (padding may hold NaN).
An empty row has ``O = 0``, ``LSE = -inf`` and bound 0.

Softcap and sink (``case.softcap``, ``case.sink``; docs/forward-surface.md). The logits
``l_j = cap tanh(c s_j / cap)`` (or ``c s_j`` without a cap) and the sink logit ``sigma`` are
taken to fixed point, ``L_j = floor(l_j 2^F)``, each within ``e`` units of ``u``: ``e = 1``
for the exact dyadic ``c s_j`` and ``sigma``; with a cap ``c s_j / cap``, ``tanh`` and the
product run in mpmath at ``W = F + 16 + log2(cap)`` bits, so ``e = 1 + cap (TANH_ERROR_BOUND +
1) 2^(F-W)`` (tanh is 1-Lipschitz, and mpmath's ``mpf_tanh`` is *assumed* within
``TANH_ERROR_BOUND`` units of ``2^-W``, checked by sampling like ``exp_fixed``). The shift is
``M = max_j L_j`` over the keys, within ``e u`` of the true maximum logit, so every exp argument
``M - L_j`` is within ``2 e u`` of the true one: ``delta = (EXP_FIXED_ERROR_BOUND + 1 + 2e) u``.
The sink is a key whose value is 0: it adds its weight to ``L~`` and 0 to every numerator.
Below the shift its weight is a fixed-point ``exp`` like the others (the O bound above holds
with ``n + 1`` terms and ``R`` taken over the values and 0); above it, it is
``floor(exp(sigma - M) 2^F)`` from mpmath's ``exp`` at ``F + 8`` bits, within relative
``rho = (2e + 3) u``, so a dominating sink never drives every key weight below ``2^-F`` (O
stays accurate however small). Then ``(P~_sigma - p_sigma)(0 - O) / L~`` adds at most
``2 rho |O|`` to the O bound and ``2 rho`` to the LSE bound (both added whenever there is a
sink). The LSE is ``M u + ln L~``, one more ``e u`` for the shift. An empty row with a sink has
``O = 0``, ``LSE = sigma`` (exact) and bound 0.

A sink that outweighs every key beyond double resolution is not exponentiated: ``exp(sigma - M)``
has about ``1.44 (sigma - M)`` bits, which for a float32 sink of 1e9 takes minutes and for 3e38
does not fit in memory. With ``d = sigma - max_j l_j`` and ``t = sum_j exp(l_j - sigma) <= n
e^-d``, ``LSE = sigma + ln(1 + t)`` and ``|O_c| <= t max_j |v_jc| / (1 + t)``. Every input is
below ``2^128`` in magnitude, so once ``d >= (1203 + log2 n) ln 2`` (:func:`sink_outweighs_keys`,
on the lower bound ``(sigma 2^F - M - e) u`` of ``d``), ``|O_c| < 2^-1075`` and ``0 <= LSE -
sigma < 2^-1203``: the nearest doubles are ``O = 0`` and ``LSE = sigma``, returned as they are
(the full evaluation would round to the same doubles) with bound ``2^-1074`` (docs/numerics.md,
"A dominant sink"). Below that margin ``exp(sigma - M) 2^F`` has at most ``1245 + F`` bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mpmath
import numpy as np
from mpmath.libmp import (
    from_float,
    from_man_exp,
    mpf_add,
    mpf_div,
    mpf_exp,
    mpf_log,
    mpf_mul,
    mpf_sub,
    mpf_tanh,
    round_nearest,
    to_fixed,
    to_float,
)
from mpmath.libmp.libelefun import exp_fixed, ln2_fixed

from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.masks import visible

#: Assumed bound on the error of ``exp_fixed(x, F)`` in units of ``2^-F`` for ``x <= 0``
#: (mpmath's Taylor series plus squarings loses a few tens of units at most; the test samples it).
EXP_FIXED_ERROR_BOUND = 64
#: Assumed bound on the error of ``mpf_tanh(x, W)`` in units of ``2^-W`` (mpmath computes it
#: from ``exp`` at extra precision; the test samples it against a much wider evaluation).
TANH_ERROR_BOUND = 64

#: ``log2`` of the largest input magnitude plus the double range's bottom, ``128 + 1075``: a sink
#: that many ``log2 n`` bits above every logit leaves ``|O| < 2^-1075`` (module docstring).
_SINK_ONLY_BITS = 128 + 1075

#: Largest ``prec_bits``: a row sum (up to ``Sk 2^prec_bits``, Sk <= 2^40 by the element budget's
#: ceiling reference.case.MAX_ELEMENTS_CEILING) must stay below 2^1024 to become a float64.
MAX_PREC_BITS = 960

_EXACT_FLOAT64_BITS = 53  # integers below 2^53 are exact in float64
_P_LIMB_BITS = 16  # weights P are split into uint16 limbs (a byte view of their little-endian form)
_ROW_CHUNK = 64  # rows per GEMM batch: bounds memory at chunk * Sk * (prec_bits / 16) doubles
_BOUND_SLACK = 1.0 + 2.0**-30  # covers float64 rounding in evaluating the bounds themselves
_CHUNK_ELEMENTS = 1 << 16  # elementwise passes over a matrix go this many elements at a time
_MANTISSA_FIELD = np.uint64((1 << 52) - 1)


@dataclass(frozen=True, eq=False)
class ExactResult:
    """Certified tier-1 result; NaN in ``o``/``lse`` where a row was not evaluated.

    ``o + o_lo`` approximates the exact output within ``o_err_bound`` (per row, every column);
    ``lse`` (natural log, -inf for empty rows) is within ``lse_err_bound``.
    """

    o: np.ndarray
    o_lo: np.ndarray
    lse: np.ndarray
    o_err_bound: np.ndarray
    lse_err_bound: np.ndarray
    rows: np.ndarray
    prec_bits: int

    def as_result(self) -> AttentionResult:
        """The (o, lse) pair as any tier returns it."""
        return AttentionResult(o=self.o, lse=self.lse)


def exact_attention(
    case: AttentionCase, rows: np.ndarray | None = None, *, prec_bits: int = 128
) -> ExactResult:
    """Certified attention for the rows selected by ``rows`` (bool ``[B, Hq, Sq]``, None = all).

    See the module docstring for the algorithm and the error bound.
    """
    check_prec_bits(prec_bits)
    rows = _check_rows(case, rows)
    B, Sq, Hq, Dv = case.B, case.Sq, case.Hq, case.Dv
    out = _Outputs(
        o=np.full((B, Sq, Hq, Dv), np.nan),
        o_lo=np.full((B, Sq, Hq, Dv), np.nan),
        lse=np.full((B, Hq, Sq), np.nan),
        o_err_bound=np.full((B, Hq, Sq), np.nan),
        lse_err_bound=np.full((B, Hq, Sq), np.nan),
    )
    for b in range(B):
        for kv_head in range(case.Hkv):
            heads = [h for h in range(Hq) if case.kv_head(h) == kv_head]
            _evaluate_group(case, b, kv_head, heads, rows, prec_bits, out)
    return ExactResult(**vars(out), rows=rows, prec_bits=prec_bits)


def check_prec_bits(prec_bits: object) -> None:
    """ValueError unless ``prec_bits`` is an int in [64, :data:`MAX_PREC_BITS`]."""
    if isinstance(prec_bits, bool) or not isinstance(prec_bits, int):
        raise ValueError(f"prec_bits={prec_bits!r} must be an int in [64, {MAX_PREC_BITS}]")
    if not 64 <= prec_bits <= MAX_PREC_BITS:
        raise ValueError(f"prec_bits={prec_bits!r} must be an int in [64, {MAX_PREC_BITS}]")


def sample_rows(case: AttentionCase, n: int, seed: int = 0) -> np.ndarray:
    """Bool ``[B, Hq, Sq]`` with exactly ``min(n, B*Hq*Sq)`` rows set.

    The first and the last row of the flattened ``[B, Hq, Sq]`` grid are always included (edge
    rows are where causal and padding bugs show); the rest are drawn uniformly without
    replacement with ``numpy.random.default_rng(seed)``. Padded and empty rows may be drawn.
    """
    return sample_grid((case.B, case.Hq, case.Sq), n, seed, "rows")


def sample_grid(shape: tuple[int, ...], n: int, seed: int = 0, what: str = "rows") -> np.ndarray:
    """Bool ``shape`` with exactly ``min(n, size)`` entries set: the first and the last of the
    flattened grid, the rest uniform without replacement (``default_rng(seed)``)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1 (number of {what} to sample)")
    total = math.prod(shape)
    chosen = np.zeros(total, dtype=bool)
    if total == 0:  # nothing to sample (a zero length): an empty selection
        return chosen.reshape(shape)
    chosen[[0, total - 1][: min(n, 2)]] = True
    rest = np.flatnonzero(~chosen)
    extra = min(int(n), total) - int(chosen.sum())
    chosen[np.random.default_rng(seed).choice(rest, size=extra, replace=False)] = True
    return chosen.reshape(shape)


def naive_exact_attention(
    case: AttentionCase, rows: np.ndarray | None = None, *, dps: int = 100
) -> AttentionResult:
    """Independent, obviously correct mpmath loop (private context at ``dps`` digits), with the
    softcap, the sink and the descales as ``AttentionCase`` defines them.

    For cross-checks on small shapes only (~0.06 rows/s at Sk=8192, d=128). Scores use
    ``fdot``, which drops terms ~2 prec below the running sum: at dps >= 100 (~332 bits) that
    is exact for fp16/bf16/fp32 products (they span < 560 bits). NaN where a row was not
    evaluated; empty rows give O = 0, LSE = -inf.
    """
    rows = _check_rows(case, rows)
    ctx = mpmath.MPContext()
    ctx.dps = dps
    o = np.full((case.B, case.Sq, case.Hq, case.Dv), np.nan)
    lse = np.full((case.B, case.Hq, case.Sq), np.nan)
    scale = ctx.mpf(case.softmax_scale)
    for b, h, i in zip(*np.nonzero(rows), strict=True):
        keys = np.flatnonzero(visible(case, b, h, rows=np.array([i]))[0])
        sink = None if case.sink is None else ctx.mpf(float(case.sink[h]))
        if keys.size == 0:
            o[b, i, h], lse[b, h, i] = 0.0, -np.inf if sink is None else float(sink)
            continue
        kvh = case.kv_head(h)
        qd, kd, vd = (ctx.mpf(case.descale(name, b, kvh)) for name in "qkv")
        q = [ctx.mpf(float(x)) * qd for x in case.q[b, i, h]]
        k = [[ctx.mpf(float(x)) * kd for x in case.k[b, j, kvh]] for j in keys]
        s = [scale * ctx.fdot(q, row) for row in k]
        if case.softcap is not None:  # the cap acts on the scaled scores
            cap = ctx.mpf(case.softcap)
            s = [cap * ctx.tanh(x / cap) for x in s]
        m = max(s if sink is None else [*s, sink])
        p = [ctx.exp(x - m) for x in s]
        total = ctx.fsum(p if sink is None else [*p, ctx.exp(sink - m)])  # the sink: no value
        for c in range(case.Dv):
            num = ctx.fdot(p, [ctx.mpf(float(case.v[b, j, kvh, c])) * vd for j in keys])
            o[b, i, h, c] = float(num / total)
        lse[b, h, i] = float(m + ctx.log(total))
    return AttentionResult(o=o, lse=lse)


@dataclass
class _Outputs:
    o: np.ndarray
    o_lo: np.ndarray
    lse: np.ndarray
    o_err_bound: np.ndarray
    lse_err_bound: np.ndarray


def _check_rows(case: AttentionCase, rows: np.ndarray | None) -> np.ndarray:
    shape = (case.B, case.Hq, case.Sq)
    if rows is None:
        return np.ones(shape, dtype=bool)
    rows = np.asarray(rows)
    if rows.dtype != np.bool_ or rows.shape != shape:
        raise ValueError(
            f"rows must be a bool array of shape [B, Hq, Sq]={shape}, "
            f"got dtype={rows.dtype} shape={rows.shape}"
        )
    return rows.copy()


@dataclass(frozen=True)
class _IntMatrix:
    """An integer matrix ``X 2^exponent`` held as signed float64 limbs of ``width`` bits."""

    limbs: np.ndarray  # [count, rows, cols], X = sum_i limbs[i] 2^(width i)
    width: int
    exponent: int


def _exponent_range(x: np.ndarray) -> tuple[int, int]:
    """``(lo, hi)``: every value of ``x`` is an integer multiple of ``2^lo`` below ``2^hi``.

    ``lo`` is the place of the lowest set bit over all values: clearing the lowest set bit of a
    double's bit pattern (``bits & (bits - 1)``) and subtracting leaves exactly that bit's value
    when the mantissa field is nonzero (a difference within a factor 2, so exact); a power of
    two is its own lowest bit. Integer and compare passes in cache-sized chunks: on a 2^24-element
    K, 0.03 s where frexp/log2 over whole arrays took 0.3 s (1.6 s on fresh pages), 2-core host.
    """
    flat = x.reshape(-1)
    lowest_bit, top = np.inf, 0.0
    for start in range(0, flat.size, _CHUNK_ELEMENTS):
        part = np.abs(flat[start : start + _CHUNK_ELEMENTS].astype(np.float64))
        bits = part.view(np.uint64)
        lowest = part - (bits & (bits - np.uint64(1))).view(np.float64)
        np.copyto(lowest, part, where=(bits & _MANTISSA_FIELD) == 0)  # powers of two (and 0)
        np.copyto(lowest, np.inf, where=part == 0)
        if part.size:
            lowest_bit, top = min(lowest_bit, lowest.min()), max(top, part.max())
    if top == 0:
        return 0, 0
    return math.frexp(lowest_bit)[1] - 1, math.frexp(top)[1]


def _to_limbs(x: np.ndarray, width: int, count: int, lo: int | None = None) -> _IntMatrix:
    """Split the dyadic matrix ``x`` exactly into ``count`` signed ``width``-bit float64 limbs
    (``lo``: its :func:`_exponent_range` low end, when the caller has it already)."""
    if lo is None:
        lo, _ = _exponent_range(x)
    limbs = np.empty((count, *x.shape))
    for rows in _row_chunks(x):  # the temporaries stay in cache
        part = np.asarray(x[rows], dtype=np.float64)
        # ldexp by a power of two, floor, and the remainder below 2^width are all exact
        magnitude, sign = np.ldexp(np.abs(part), -lo), np.sign(part)
        for i in range(count):
            upper = np.floor(np.ldexp(magnitude, -width))
            limbs[i, rows] = (magnitude - np.ldexp(upper, width)) * sign
            magnitude = upper
    return _IntMatrix(limbs, width, lo)


def _bit_width(x: np.ndarray) -> int:
    return _span_width(*_exponent_range(x))


def _span_width(lo: int, hi: int) -> int:
    return max(hi - lo, 1)


def _limb_budget(terms: int) -> int:
    """Largest ``wa + wb`` such that a sum of ``terms`` products of a ``wa``-bit and a ``wb``-bit
    limb stays below 2^53, so every partial sum is exact in float64 in any order."""
    budget = _EXACT_FLOAT64_BITS - max(terms - 1, 1).bit_length()
    if budget <= _P_LIMB_BITS:
        raise ValueError(f"{terms} terms per dot product is too many for exact float64 limbs")
    return budget


def _plan_limbs(width_a: int, width_b: int, terms: int) -> tuple[int, int, int, int]:
    """Limb widths and counts ``(wa, na, wb, nb)`` minimizing the GEMM count ``na * nb``."""
    budget = _limb_budget(terms)
    plans = []
    for na in range(1, width_a + 1):
        wa = -(-width_a // na)
        if budget - wa >= 1:
            nb = -(-width_b // (budget - wa))
            plans.append((na * nb, wa, na, -(-width_b // nb), nb))
        if wa == 1:
            break
    _, wa, na, wb, nb = min(plans)
    return wa, na, wb, nb


def _combine(products: np.ndarray, width_a: int, width_b: int) -> np.ndarray:
    """Python-int array ``sum_ab products[a, :, b] 2^(width_a a + width_b b)``; products are
    exact integer-valued float64 of shape ``[na, rows, nb, cols]``."""
    total = np.zeros(products.shape[1:2] + products.shape[3:], dtype=object)
    for a in range(products.shape[0]):
        for b in range(products.shape[2]):
            part = products[a, :, b].astype(np.int64).astype(object)
            total += part << (width_a * a + width_b * b)
    return total


def dyadic_matmul(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """Exact ``a @ b.T`` of matrices holding dyadic values (e.g. fp16/bf16/fp32 inputs).

    Returns ``(ints, exponent)``: an object array of Python ints with ``a @ b.T = ints *
    2^exponent`` exactly. Runs as float64 GEMMs on limbs, each partial sum below 2^53, over
    chunks of ``b``'s rows so that its limbs never exist in full (a 128k-key K would take
    several GiB of fresh pages).
    """
    (lo_a, hi_a), (lo_b, hi_b) = _exponent_range(a), _exponent_range(b)
    wa, na, wb, nb = _plan_limbs(_span_width(lo_a, hi_a), _span_width(lo_b, hi_b), a.shape[1])
    a_limbs = _to_limbs(a, wa, na, lo_a).limbs.reshape(na * a.shape[0], a.shape[1])
    ints = np.empty((a.shape[0], b.shape[0]), dtype=object)
    for rows in _row_chunks(b):
        b_limbs = _to_limbs(b[rows], wb, nb, lo_b).limbs
        keys = b_limbs.shape[1]
        products = (a_limbs @ b_limbs.reshape(nb * keys, b.shape[1]).T).reshape(
            na, a.shape[0], nb, keys
        )
        ints[:, rows] = _combine(products, wa, wb)
    return ints, lo_a + lo_b


def _row_chunks(x: np.ndarray, elements: int = _CHUNK_ELEMENTS) -> list[slice]:
    """Slices of ``x``'s first axis of about ``elements`` elements each (at least one row)."""
    step = max(1, elements // max(math.prod(x.shape[1:]), 1))
    return [slice(start, start + step) for start in range(0, len(x), step)]


def _evaluate_group(
    case: AttentionCase,
    b: int,
    kv_head: int,
    heads: list[int],
    rows: np.ndarray,
    prec_bits: int,
    out: _Outputs,
) -> None:
    """All selected rows of batch ``b`` whose query heads read ``kv_head`` (K/V converted once)."""
    selected = []  # (h, i, visible keys of the row)
    for h in heads:
        index = np.flatnonzero(rows[b, h])
        if index.size == 0:
            continue
        seen = visible(case, b, h, rows=index)
        for i, row_seen in zip(index, seen, strict=True):
            if row_seen.any():
                selected.append((h, int(i), row_seen))
            else:  # O = 0; LSE = -inf, or the sink logit (exact) when there is one
                empty_lse = -np.inf if case.sink is None else float(case.sink[h])
                out.o[b, i, h], out.o_lo[b, i, h], out.lse[b, h, i] = 0.0, 0.0, empty_lse
                out.o_err_bound[b, h, i] = out.lse_err_bound[b, h, i] = 0.0
    if not selected:
        return
    cols = np.flatnonzero(np.any([seen for _, _, seen in selected], axis=0))
    # only keys some selected row sees; float64 chunk by chunk
    k = _dequantized(case, "k", b, kv_head, case.k[b, cols, kv_head])
    v = _dequantized(case, "v", b, kv_head, case.v[b, cols, kv_head])
    v_lo, v_hi = _exponent_range(v)
    v_width = _span_width(v_lo, v_hi)
    nv = -(-v_width // (_limb_budget(len(cols)) - _P_LIMB_BITS))
    wv = -(-v_width // nv)
    for start in range(0, len(selected), _ROW_CHUNK):
        chunk = selected[start : start + _ROW_CHUNK]
        n = len(chunk)
        q = np.stack([case.q[b, i, h] for h, i, _ in chunk]).astype(np.float64)
        q = _dequantized(case, "q", b, kv_head, q)
        scores, score_exponent = dyadic_matmul(q, k)  # exact: q k^T = scores 2^score_exponent
        masks = [seen[cols] for _, _, seen in chunk]
        if case.softcap is None and case.sink is None:
            weights = _Weights(case.softmax_scale, score_exponent, prec_bits)
            p_rows = [weights.row(scores[r], masks[r]) for r in range(n)]
        else:
            weights = _SurfaceWeights(case, score_exponent, prec_bits)
            surface_rows = [
                weights.surface_row(scores[r], masks[r], h) for r, (h, _, _) in enumerate(chunk)
            ]
            kept = _write_sink_only_rows(case, b, chunk, surface_rows, out)
            if not kept:
                continue
            chunk, masks, p_rows = ([x[r] for r in kept] for x in (chunk, masks, surface_rows))
            n = len(kept)
        p_limbs = weights.limbs(p_rows, len(cols))  # [nl, n, cols]
        nl = p_limbs.shape[0]
        p_limbs = p_limbs.reshape(nl * n, len(cols))
        pv = np.zeros((nl * n, nv, case.Dv))
        for keys in _row_chunks(v):  # V's limbs a chunk of keys at a time
            v_limbs = _to_limbs(v[keys], wv, nv, v_lo).limbs
            for limb in range(nv):  # partial sums of the budgeted terms: exact in any order
                pv[:, limb] += p_limbs[:, keys] @ v_limbs[limb]
        numerators = _combine(pv.reshape(nl, n, nv, case.Dv), _P_LIMB_BITS, wv)
        for r, (h, i, _) in enumerate(chunk):  # numerators: exact sum_j P_j v_j 2^(F - v_lo)
            values = _visible_values(v, masks[r])
            _finish_row(out, b, h, i, numerators[r], p_rows[r], values, v_lo, weights)


def _dequantized(case: AttentionCase, name: str, b: int, kv_head: int, x: np.ndarray) -> np.ndarray:
    """``x`` (values of ``case``'s ``name`` for ``b``, ``kv_head``) times its descale, exact
    in float64 (module docstring); ``x`` itself when ``name`` has no descale."""
    if getattr(case, f"{name}_descale") is None:
        return x
    return x.astype(np.float64) * case.descale(name, b, kv_head)


def _write_sink_only_rows(
    case: AttentionCase, b: int, chunk: list, surface_rows: list, out: _Outputs
) -> list[int]:
    """Write the rows the sink outweighs beyond double resolution (``surface_rows[r]`` None):
    ``O = 0``, ``LSE = sigma``, bound ``2^-1074`` (module docstring); return the other rows'
    indices, which the fixed-point evaluation finishes."""
    for (h, i, _), p_row in zip(chunk, surface_rows, strict=True):
        if p_row is None:
            out.o[b, i, h], out.o_lo[b, i, h] = 0.0, 0.0
            out.lse[b, h, i] = float(case.sink[h])
            out.o_err_bound[b, h, i] = out.lse_err_bound[b, h, i] = 2.0**-1074
    return [r for r, p_row in enumerate(surface_rows) if p_row is not None]


def _visible_values(v: np.ndarray, seen: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """``(n, min, max)``: how many keys ``seen`` marks, and their values' column extremes."""
    low, high = np.full(v.shape[1], np.inf), np.full(v.shape[1], -np.inf)
    for keys in _row_chunks(v):
        part = v[keys][seen[keys]].astype(np.float64)
        if len(part):
            low, high = np.minimum(low, part.min(axis=0)), np.maximum(high, part.max(axis=0))
    return int(seen.sum()), low, high


class _Weights:
    """Fixed-point softmax weights ``P_j = exp(c (s_j - m)) 2^F`` for one score exponent."""

    arg_error_units = 1  # |exp argument error| <= this many u (the truncation to F bits)
    shift_error = 0.0  # |error of the LSE shift c m|: exact
    sink_error = 0.0  # 2 rho, the relative error of a sink weight above the shift: no sink

    def __init__(self, softmax_scale: float, score_exponent: int, prec_bits: int) -> None:
        self.fraction_bits = prec_bits
        self.scale_man, scale_exp = _dyadic(softmax_scale)
        self.arg_shift = scale_exp + score_exponent + prec_bits  # a 2^F = -d 2^arg_shift
        self.ln2 = ln2_fixed(prec_bits)
        self.cutoff = (prec_bits + 2) * (self.ln2 + 1)  # -x > cutoff => p < 2^-(F+2): skip
        self.score_exponent = score_exponent
        self.scale_exp = scale_exp

    def row(self, scores: np.ndarray, seen: np.ndarray) -> tuple[list[int], int, None]:
        """(P for every column, 0 where masked; the exact row max as an integer score; no sink
        weight)."""
        row_scores = scores[seen]
        row_max = row_scores.max()
        d = (row_max - row_scores) * self.scale_man
        x = d << self.arg_shift if self.arg_shift >= 0 else d >> -self.arg_shift
        p = [self.weight(int(xi)) for xi in x]
        full = [0] * len(seen)
        for j, pj in zip(np.flatnonzero(seen), p, strict=True):
            full[j] = int(pj)
        return full, row_max, None

    def weight(self, x: int) -> int:
        """``exp(-x 2^-F) 2^F`` for a fixed-point ``x >= 0`` (0 below ``2^-(F+2)``)."""
        F = self.fraction_bits
        return 1 << F if not x else 0 if x > self.cutoff else exp_fixed(-x, F, self.ln2)

    def limbs(self, p_rows: list[tuple[list[int], int]], cols: int) -> np.ndarray:
        """``[nl, rows, cols]`` float64 uint16 limbs of the weights (exact)."""
        weights = [pj for p, *_ in p_rows for pj in p]
        return int_limbs(weights, (len(p_rows), cols), self.fraction_bits + 1)

    def lse_shift(self, row_max: int) -> tuple:
        """``c m`` as an exact mpf."""
        return from_man_exp(self.scale_man * row_max, self.scale_exp + self.score_exponent)


def int_limbs(
    values: list[int], shape: tuple[int, ...], bits: int, *, signed: bool = False
) -> np.ndarray:
    """``[nl, *shape]`` float64 16-bit limbs of Python ints below ``2^bits`` in magnitude
    (exact): ``value = sum_l limbs[l] 2^(16 l)``, the top limb signed (two's complement) when
    ``signed``, so every partial product stays within ``_P_LIMB_BITS`` bits."""
    nbytes = 2 * -(-(bits + signed) // _P_LIMB_BITS)
    blob = b"".join(x.to_bytes(nbytes, "little", signed=signed) for x in values)
    limbs = np.frombuffer(blob, dtype="<u2").reshape(*shape, nbytes // 2)
    limbs = np.moveaxis(limbs, -1, 0).astype(np.float64)
    if signed and limbs.size:  # the top limb carries the sign: reread it as int16
        limbs[-1] = np.where(limbs[-1] >= 2**15, limbs[-1] - 2**16, limbs[-1])
    return limbs


class _SurfaceWeights(_Weights):
    """Weights with a softcap and/or a sink: fixed-point logits ``L_j`` and shift ``M = max L``
    (module docstring, "Softcap and sink")."""

    def __init__(self, case: AttentionCase, score_exponent: int, prec_bits: int) -> None:
        super().__init__(case.softmax_scale, score_exponent, prec_bits)
        self.sink = case.sink
        self.softcap = None if case.softcap is None else from_float(case.softcap)
        cap = case.softcap or 0.0
        self.work_bits = prec_bits + 16 + max(0, math.ceil(math.log2(cap))) if cap else prec_bits
        logit_error = 1 + cap * (TANH_ERROR_BOUND + 1) * 2.0 ** (prec_bits - self.work_bits)
        self.arg_error_units = 2 * logit_error
        self.shift_error = logit_error * 2.0**-prec_bits
        self.sink_error = 0.0 if case.sink is None else 2 * (2 * logit_error + 3) * 2.0**-prec_bits

    def logits(self, scores: np.ndarray) -> list[int]:
        """``floor(l_j 2^F)`` for integer scores: ``l_j = c s_j``, capped when there is a cap."""
        exponent = self.scale_exp + self.score_exponent
        if self.softcap is None:
            shift = exponent + self.fraction_bits
            return [
                (self.scale_man * int(s)) << shift
                if shift >= 0
                else (self.scale_man * int(s)) >> -shift
                for s in scores
            ]
        W, cap = self.work_bits, self.softcap
        return [
            to_fixed(
                mpf_mul(
                    mpf_tanh(mpf_div(from_man_exp(self.scale_man * int(s), exponent), cap, W), W),
                    cap,
                ),
                self.fraction_bits,
            )
            for s in scores
        ]

    def surface_row(
        self, scores: np.ndarray, seen: np.ndarray, h: int
    ) -> tuple[list[int], int, int | None] | None:
        """(P for every column, 0 where masked; the shift ``M`` in fixed point; the sink's
        weight, None without a sink) for a row of query head ``h``; None when the sink
        outweighs every key beyond double resolution (:func:`sink_outweighs_keys`)."""
        logits = self.logits(scores[seen])
        shift = max(logits)
        full = [0] * len(seen)
        for j, logit in zip(np.flatnonzero(seen), logits, strict=True):
            full[j] = int(self.weight(shift - logit))
        if self.sink is None:
            return full, shift, None
        F = self.fraction_bits
        numerator, denominator = float(self.sink[h]).as_integer_ratio()
        sink = (numerator << F) // denominator  # floor(sigma 2^F)
        if sink <= shift:
            return full, shift, int(self.weight(shift - sink))
        margin = (sink - shift - math.ceil(self.arg_error_units / 2)) >> F  # <= sigma - max l_j
        if sink_outweighs_keys(margin, len(logits)):
            return None
        return full, shift, to_fixed(mpf_exp(from_man_exp(sink - shift, -F), F + 8), F)

    def lse_shift(self, shift: int) -> tuple:
        """``M u`` as an exact mpf."""
        return from_man_exp(shift, -self.fraction_bits)


def sink_outweighs_keys(margin: int, keys: int) -> bool:
    """True when a sink at least ``margin`` (natural-log units) above all of ``keys`` visible
    logits leaves ``|O| < 2^-1075`` and ``LSE - sigma < 2^-1203`` for inputs below ``2^128``:
    ``margin >= (1203 + log2 keys) ln 2``, with one bit to spare for the float evaluation."""
    return margin > (_SINK_ONLY_BITS + 1 + math.log2(keys)) * math.log(2.0)


def _dyadic(x: float) -> tuple[int, int]:
    """``(man, exp)`` with ``x = man 2^exp`` exactly."""
    numerator, denominator = x.as_integer_ratio()
    return numerator, 1 - denominator.bit_length()


def _finish_row(
    out: _Outputs,
    b: int,
    h: int,
    i: int,
    numerators: np.ndarray,
    p_row: tuple[list[int], int, int | None],
    values: tuple[int, np.ndarray, np.ndarray],
    v_exponent: int,
    weights: _Weights,
) -> None:
    """Divide, round to double-double, and certify one row (bounds in the module docstring);
    ``values``: the visible keys' count and their values' column extremes."""
    p, row_max, sink_weight = p_row
    prec, F = weights.fraction_bits, weights.fraction_bits
    row_sum = sum(p) + (sink_weight or 0)
    l_mpf = from_man_exp(row_sum, -F)
    worst = 0.0
    for c, num in enumerate(numerators):
        y = mpf_div(from_man_exp(int(num), v_exponent - F), l_mpf, prec, round_nearest)
        hi = to_float(y, rnd=round_nearest)
        lo = to_float(mpf_sub(y, from_float(hi), prec + 64, round_nearest), rnd=round_nearest)
        out.o[b, i, h, c], out.o_lo[b, i, h, c] = hi, lo
        worst = max(worst, abs(hi))
    n, v_min, v_max = values
    if sink_weight is not None:  # the sink: one more key, whose value is 0
        n, v_min, v_max = n + 1, np.minimum(v_min, 0.0), np.maximum(v_max, 0.0)
    delta = (EXP_FIXED_ERROR_BOUND + 1 + weights.arg_error_units) * 2.0**-F
    spread = float((v_max - v_min).max())
    l_float = to_float(l_mpf)  # >= 1 (inf beyond the double range)
    o_bound = n * delta * spread / l_float + worst * (2.0 ** (1 - prec) + 2.0**-104) + 2.0**-1074
    o_bound += weights.sink_error * worst
    out.o_err_bound[b, h, i] = o_bound * _BOUND_SLACK
    out.lse[b, h, i], out.lse_err_bound[b, h, i] = certified_lse(
        weights, row_max, row_sum, n * delta
    )


def certified_lse(
    weights: _Weights, row_max: int, row_sum: int, row_sum_err_bound: float
) -> tuple[float, float]:
    """``(lse, bound)``: the double nearest ``c m + ln(row_sum 2^-F)`` (natural log) and its
    certified error, given ``|row_sum 2^-F - l| <= row_sum_err_bound`` with both sums >= 1
    (so the log moves by at most that much; module docstring)."""
    prec = weights.fraction_bits
    log_l = mpf_log(from_man_exp(row_sum, -prec), prec, round_nearest)
    lse = mpf_add(weights.lse_shift(row_max), log_l, prec, round_nearest)
    lse_float = to_float(lse, rnd=round_nearest)
    lse_bound = (
        row_sum_err_bound
        + weights.shift_error
        + weights.sink_error
        + abs(to_float(log_l)) * 2.0 ** (8 - prec)
        + abs(lse_float) * (2.0 ** (1 - prec) + 2.0**-53)
        + 2.0**-1074
    )
    return lse_float, lse_bound * _BOUND_SLACK
