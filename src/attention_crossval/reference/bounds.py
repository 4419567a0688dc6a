"""Derived per-element forward-error bound of a FlashAttention-style pass
(docs/numerics.md#error-bound).

A fixed ``atol``/``rtol`` is either too loose or wrong for large scores, a V offset or
subnormal P (docs/numerics.md#tightness). Instead every output element gets the rigorous
bound of its precision chain (a :class:`~reference.precision.StreamingPrecision`), evaluated in
float64 from the case and a float64 (or exact) reference. Units: ``o`` bounds are absolute, in
the units of V; ``lse`` bounds are absolute, in natural-log units.

Notation per query row (``c = scale_log2 = log2(e) * softmax_scale``; ``s_j`` the unscaled score
of visible key j; ``m = max_j s_j``; ``t_j = c (s_j - m) <= 0``; ``p_j = 2^t_j``;
``l = sum_j p_j``; ``o_c = sum_j p_j v_jc / l``; ``n_b = ceil(Sk / block_n)``;
``gamma_n(u) = n u / (1 - n u)`` (Higham 2002, 3.1)). Unit roundoffs, taken from the precision
chain: ``u_s`` of the score dtype, ``u_a`` of the MMA accumulation (``mma_unit_roundoff`` when
that stage is float32: tensor cores truncate, Fasi et al. 2021), ``u_acc`` of the O / row_sum
accumulators, ``u_P``, ``sigma_P`` the unit roundoff and subnormal spacing of P's 16-bit format,
``eps = exp2_error_ulp * 2 u_s`` the relative error of exp2, ``tau`` the rescale threshold::

    dt_j  = c gamma_D(u_a) sum_k |q_k k_jk| + u_s (|t_j| + tau + 2 (|c m| + tau) + c |s_j|)
    eta_j = expm1(ln2 dt_j + eps + r_j (eps + u_acc + 3 ln2 u_s (|c m| + tau)))
    f     = tiny(score dtype)               (exp2 with flush-to-zero, per visible key)
    w_j   = p_j eta_j + f                   (|p~_j - p_j| <= w_j, p~_j the kernel's weight)
    dP_j  = u_P (p_j + w_j) + sigma_P / 2   (P rounded to 16 bits before P V)
    rel   = sum_j w_j / l,  g = gamma_{Sk + 2 n_b}(u_acc)
    lam   = max(1 - rel, sum_j (p_j / (1 + eta_j) - f) / l),  D = 1 / (lam (1 - g))
    x_c   = D [ (sum_j w_j |v_jc - o_c| + sum_j dP_j |v_jc|
                 + gamma_{Sk + 2 n_b}(u_a) sum_j (p_j + w_j + dP_j) |v_jc|) / l
               + (1 + rel) g |o_c| ]
    |o^_c - o_c| <= (1 + u_acc) x_c + u_acc |o_c|

``r_j`` counts the rescales by ``alpha`` that can follow key j's block: the visible blocks after it
(``kv_order="forward"``), before it (``"reverse"``), or all other visible blocks (``"any"``, valid
for every visiting order, the default). When row_sum adds the *rounded* P, ``dP_j`` multiplies
``|v_jc - o_c|`` instead of ``|v_jc|`` (and counts in ``rel``). A 16-bit (or any narrower) output
multiplies the bound by ``1 + u_o`` and adds ``u_o |o_c| + sigma_o / 2``. ``eta_j`` is the
exponential of the summed relative perturbations, which equals the linear sum of the
perturbations to first order and stays rigorous when a perturbation is not small. ``D`` is
exact, not a first-order factor: the kernel divides by a row sum ``L~ >= l lam (1 - g)``, where
every weight is ``p_j e^theta`` (``|theta| <= ln(1 + eta_j)``) or flushed, so ``lam`` stays
positive where ``rel`` reaches 1; when ``lam <= 0`` (or ``g >= 1``) the divisor is not bounded
away from 0 and the row's bound is inf. An empty row gets bound 0: the
kernel must return exactly 0. For ``StreamingPrecision.float64()`` every unit roundoff is 2^-53, so
the bound is about ``Sk 2^-53 sum_j p_j |v_jc| / l``.

LSE (natural log; a kernel computes ``m scale + ln l`` or ``(m c + log2 l) ln 2``)::

    r = rel (+ sum_j dP_j / l if row_sum adds rounded P) + g (1 + that)
    d = max(ln(1 + r), -ln(lam (1 - g)))      (lam less those dP_j with the rounded-P sum)
    |lse^ - lse| <= d + eps max(1, ln l + d) + 3 u_s (|m scale| + tau ln2 + |lse|)

(``|ln L~ - ln l| <= d`` when ``lam (1 - g) l <= L~ <= (1 + r) l``; inf when ``lam <= 0``.)

Departures from a first-order derivation, all towards rigour: the flush-to-zero term ``f`` weights
``|v - o|`` (it perturbs the row sum too) rather than ``|v|``; ``eta`` is an ``expm1``; the
threshold ``tau`` and the output's subnormal spacing are included; ``r_j`` may count every visible
block (``"any"``); a first-order factor such as 1.01 is replaced by the exact ``D`` and
``d``, and ``dP_j`` and the P V term use the perturbed ``p_j + w_j``. The chain assumes Q
K^T is formed from the unscaled inputs (the scale is folded into exp2, as FlashAttention does), not
from a pre-scaled, re-rounded Q.

FP8 MMA with a narrow accumulator (``precision.mma_accumulator_bits``, docs/fp8.md): the
``gamma_D(u_a)`` of ``dt_j`` and the ``gamma_{Sk + 2 n_b}(u_a)`` of the P V term become
``_mma_error`` of the same reduction (every cut of the accumulator counted at ``2^(1 -
bits)`` of the largest magnitude in play).

Softcap (``case.softcap = cap``; the kernel forms ``l_j = cap tanh(scale s_j / cap)`` and
exponentiates with ``c = log2(e)``): the formulas above run on the logits ``l_j`` in place of
``s_j`` with ``c = log2(e)``, and each key's natural-log logit error adds to ``ln2 dt_j``::

    e_j = (1 + eps_t)(1 + u_s)^3 scale gamma_D(u_a) sum_k |q_k k_jk|
          + gamma_2(u_s) |scale s_j| + (eps_t + u_s + eps_t u_s) |l_j|

(the MMA error passes the scale, the division and the 1-Lipschitz tanh; ``scale s_j`` and
``/cap`` round twice; tanh is within ``eps_t = tanh_error_ulp 2 u_s`` relative and the product
with cap rounds once). The ``gamma_D(u_a)`` term then stands in ``e_j`` instead of ``dt_j``.

Sink (``case.sink[h] = sigma``, natural-log units): one more key with logit ``sigma`` and value
0. Its weight ``p_sigma = 2^(c (sigma_u - m))`` (``sigma_u = sigma log2(e) / c``, and ``m``
the maximum over the keys and ``sigma_u``) joins ``l``; its own error ``w_sigma = p_sigma
eta_sigma + f`` uses ``ln2 dt_sigma = ln2 u_s (|t_sigma| + tau + 2 (|c m| + tau) + 3 |c
sigma_u|)`` (forming ``sigma_u`` and its exp2 argument) and ``r = all visible blocks`` (a
kernel may start from it or add it last), and it joins ``rel`` and ``sum_j w_j |v_jc - o_c|``
as ``w_sigma |o_c|``; it takes no P rounding and no P V term; ``n`` counts it.

Split-KV (``num_splits = S > 1``, :mod:`reference.splitkv`): each split's partial result is
consistent with the per-key model above (its numerator and row sum see the same perturbed
weights), so only the combine adds error. It multiplies every key of split ``s`` by
``exp(LSE_s - LSE) / l_s``-style factors formed in the accumulator dtype: the division giving
``O_s``, ``LSE_s = (m_s c + log2 l_s) ln2``, ``exp(LSE_s - m)``, the normalization and the final
product. With ``|c m_s| <= |c m| + |c s_j|``, ``ln l_s <= ln n_k`` (``n_k`` = Sk),
``|LSE_s - LSE| <= ln2 |t_j| + ln n_k`` and ``|LSE| <= ln2 |c m| + ln n_k``, key j's exponent
gains (natural log)::

    4 u_acc + 2 eps + 3 u_acc (ln2 (|c m| + |c s_j|) + ln n_k)
                    + u_acc (ln2 |t_j| + ln n_k) + 2 u_acc (ln2 |c m| + ln n_k)

``S`` joins the ``gamma`` count (the sum over splits), and the LSE bound adds
``eps + 2 u_acc |lse|`` for the combine's log and addition. A sink (in one split) gains the
same with ``sigma_u`` for ``s_j``.

Evaluation: float64, chunked over query rows (O(rows * Sk) memory, never Sq * Sk * D). The
``sum_j w_j |v_jc - o_c|`` sums are exact over each row's 64 heaviest keys and use
``|v - mu| + |mu - o|`` (``mu`` = V's column mean) for the rest: an upper bound, within 7 % of
the full sum on the 4.3 families. Rounding in evaluating the bound (float64, relative error far
below 2^-30 for Sk < 2^20) is covered by a final factor ``1 + 2^-30``; the one float32 GEMM
(``sum_k |q_k k_jk|`` of exact 16/32-bit magnitudes) folds its ``gamma_D(2^-24)`` into the
constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from attention_crossval.reference.case import FP8_DTYPES, AttentionCase, AttentionResult
from attention_crossval.reference.masks import visible
from attention_crossval.reference.mma import MMA_STEP
from attention_crossval.reference.precision import LN_2, LOG2_E, StreamingPrecision, fp8_max

KV_ORDERS = ("forward", "reverse", "any")
EVALUATION_SLACK = 1 + 2.0**-30  # float64 rounding in evaluating the bound itself
# Query rows per chunk: rows * Sk float64 score arrays of 2 MiB, and rows * K * Dv <= 8x that.
# Query rows per chunk: rows * Sk float64 arrays of 8 MiB (~15 live), so a long case takes
# 16 rows per pass over its K/V, not 4 (the per-pass conversions dominated at Sk = 64k).
_ROW_CHUNK_ELEMENTS = 1 << 20
_HEAVY_KEYS = 64  # keys per row whose |v - o| is summed exactly (see _weighted_abs_dev)
_HEAVY_ROWS = 8  # rows per gather of their heavy keys' V (8 x 64 x Dv doubles stay in cache)


def format_info(dtype: str) -> ml_dtypes.finfo:
    """``finfo`` of a float format by name (float16, bfloat16, float32, float64, FP8)."""
    named = {"bfloat16": ml_dtypes.bfloat16, **{f: getattr(ml_dtypes, f) for f in FP8_DTYPES}}
    return ml_dtypes.finfo(np.dtype(named.get(dtype, dtype)))


def unit_roundoff(dtype: str) -> float:
    """``u = 2^-(mantissa bits + 1)``: the relative error of rounding to nearest in ``dtype``."""
    return 2.0 ** -(format_info(dtype).nmant + 1)


def gamma(n: float | np.ndarray, u: float) -> float | np.ndarray:
    """Higham's ``gamma_n(u) = n u / (1 - n u)``, inf when ``n u >= 1``."""
    nu = np.asarray(n, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        return np.where(nu < 1, nu / np.maximum(1 - nu, 0), np.inf)


@dataclass(frozen=True)
class _Chain:
    """Unit roundoffs of each stage of ``precision`` (see the module docstring)."""

    u_s: float
    u_qk: float
    eps: float
    ftz: float
    u_acc: float
    u_pv: float
    u_p: float
    half_sub_p: float
    u_o: float
    half_sub_o: float
    tau: float
    rounded_p_sum: bool
    eps_tanh: float
    num_splits: int
    offset: float  # max_offset_log2: P scaled by 2^offset before its (FP8) rounding
    saturates: bool  # an FP8 P can clamp: max_offset + threshold > log2(fp8 max)
    offset_clamps: bool  # it clamps even with a fresh max: 2^max_offset > fp8 max
    u_mma: float  # one cut of the FP8 MMA's narrow accumulator, relative; 0: fp32 accumulation
    promotion: int | None  # products per partial sum added in fp32; None: the chain never ends

    @classmethod
    def of(
        cls,
        precision: StreamingPrecision,
        exp2_error_ulp: float,
        mma_u: float,
        tanh_error_ulp: float = 2.0,
        num_splits: int = 1,
    ) -> _Chain:
        def mma(dtype: str) -> float:
            return mma_u if dtype == "float32" else unit_roundoff(dtype)

        u_s = unit_roundoff(precision.score_dtype)
        p = precision.p_dtype
        out = precision.output_dtype
        narrower_out = out is not None and out != precision.accum_dtype
        return cls(
            u_s=u_s,
            u_qk=mma(precision.score_dtype),
            eps=exp2_error_ulp * 2 * u_s,
            ftz=float(format_info(precision.score_dtype).tiny),
            u_acc=unit_roundoff(precision.accum_dtype),
            u_pv=mma(precision.accum_dtype),
            u_p=0.0 if p is None else unit_roundoff(p),
            # P's subnormal spacing, in units of the unscaled P
            half_sub_p=0.0
            if p is None
            else float(format_info(p).smallest_subnormal) / 2 * 2.0**-precision.max_offset_log2,
            u_o=unit_roundoff(out) if narrower_out else 0.0,
            half_sub_o=float(format_info(out).smallest_subnormal) / 2 if narrower_out else 0.0,
            tau=float(precision.rescale_threshold_log2),
            rounded_p_sum=precision.row_sum_from_rounded_p,
            eps_tanh=tanh_error_ulp * 2 * u_s,
            num_splits=num_splits,
            offset=precision.max_offset_log2,
            saturates=precision.can_saturate,
            offset_clamps=p in FP8_DTYPES and 2.0**precision.max_offset_log2 > fp8_max(p),
            u_mma=_mma_unit(precision),
            promotion=precision.mma_promotion_interval,
        )


def _mma_unit(precision: StreamingPrecision) -> float:
    """Relative error of one cut to ``mma_accumulator_bits`` significant bits: ``2^(1 - bits)``
    truncating, ``2^-bits`` to nearest (0 without a narrow accumulator)."""
    bits = precision.mma_accumulator_bits
    if bits is None:
        return 0.0
    return 2.0 ** (1 - bits) if precision.mma_accumulator_rounding == "truncate" else 2.0**-bits


def _mma_error(
    chain: _Chain, products: int, steps: int, fp32_ops: int, u_fp32: float, group: int
) -> float:
    """Relative error, in units of ``sum_i |a_i b_i|``, of an MMA reduction of ``products``
    terms in ``steps`` MMA steps whose fp32 accumulator rounds ``fp32_ops`` times (unit
    ``u_fp32``); ``group`` caps a promoted partial sum (a K block). docs/fp8.md#mma-accumulation:

    * fp32 accumulation: ``gamma_{fp32_ops}(u_fp32)``;
    * never promoted: every product, every incoming accumulator and every step's sum is cut
      once, each by at most ``u_mma`` times the largest magnitude in play:
      ``gamma_{fp32_ops + 2 steps}(max(u_mma, u_fp32))``;
    * promoted every ``k`` products (``n = min(k, group)``): ``(1 + gamma_{n + 2
      ceil(n / MMA_STEP)}(u_mma)) (1 + gamma_{fp32_ops}(u_fp32)) - 1``.
    """
    if chain.u_mma == 0:
        return float(gamma(fp32_ops, u_fp32))
    if chain.promotion is None:
        return float(gamma(fp32_ops + 2 * steps, max(chain.u_mma, u_fp32)))
    n = min(chain.promotion, group, products)
    inner = gamma(n + 2 * -(-n // MMA_STEP), chain.u_mma)
    return float((1 + inner) * (1 + gamma(fp32_ops, u_fp32)) - 1)


@dataclass
class _RowChunk:
    """Float64 softmax statistics of ``rows`` of (b, h), plus the bound's per-key weights."""

    b: int
    h: int
    rows: slice
    seen: np.ndarray  # [r, Sk] visible keys
    p: np.ndarray  # [r, Sk] p_j = 2^t_j, 0 where masked
    l: np.ndarray  # [r] row sum, 0 for empty rows
    scaled_max: np.ndarray  # [r] softmax_scale * m (0 for empty rows)
    w_common: np.ndarray  # [r, Sk] weights of |v - o|: p eta + f (+ dP with rounded-P row sum)
    w_p: np.ndarray  # [r, Sk] dP_j, the P-rounding weights of |v| (0 with rounded-P row sum)
    w_sink: np.ndarray  # [r] the sink's weight error w_sigma (0 without a sink)
    floor: np.ndarray  # [r] lower bound of the kernel's row sum before its accumulation error
    clamps: np.ndarray  # [r] an FP8 P of the row can clamp: the O bound is undefined (inf)


def error_bound(
    case: AttentionCase,
    reference: AttentionResult,
    precision: StreamingPrecision,
    *,
    block_n: int,
    exp2_error_ulp: float = 2.0,
    mma_unit_roundoff: float = 2**-23,
    kv_order: str = "any",
    tanh_error_ulp: float = 2.0,
    num_splits: int = 1,
) -> np.ndarray:
    """Rigorous bound ``[B, Sq, Hq, Dv]`` on ``|o_kernel - o_exact|`` (module docstring).

    ``reference.o`` supplies ``o_c`` (rows where it is NaN, e.g. unsampled rows of an
    ``ExactResult``, use a float64 recomputation); ``p_j``, ``m`` and ``l`` are recomputed in
    float64 from ``case``, ``block_n`` rows' worth of memory at a time.
    """
    o_bound, lse_bound = _forward_bounds(
        case, reference, precision, block_n=block_n, exp2_error_ulp=exp2_error_ulp,
        mma_unit_roundoff=mma_unit_roundoff, kv_order=kv_order, tanh_error_ulp=tanh_error_ulp,
        num_splits=num_splits, lse=False,
    )  # fmt: skip
    return o_bound


def lse_error_bound(
    case: AttentionCase,
    reference: AttentionResult,
    precision: StreamingPrecision,
    *,
    block_n: int,
    exp2_error_ulp: float = 2.0,
    mma_unit_roundoff: float = 2**-23,
    kv_order: str = "any",
    tanh_error_ulp: float = 2.0,
    num_splits: int = 1,
) -> np.ndarray:
    """Rigorous bound ``[B, Hq, Sq]`` on ``|lse_kernel - lse_exact|`` (natural log; module
    docstring). Empty rows get 0: the kernel must return exactly ``-inf``. ``reference.lse``
    (None or NaN rows: a float64 recomputation) only supplies the magnitude ``|lse|``.
    """
    o_bound, lse_bound = _forward_bounds(
        case, reference, precision, block_n=block_n, exp2_error_ulp=exp2_error_ulp,
        mma_unit_roundoff=mma_unit_roundoff, kv_order=kv_order, tanh_error_ulp=tanh_error_ulp,
        num_splits=num_splits, o=False,
    )  # fmt: skip
    return lse_bound


def forward_error_bounds(
    case: AttentionCase, reference: AttentionResult, precision: StreamingPrecision, **options
) -> tuple[np.ndarray, np.ndarray]:
    """``(error_bound(...), lse_error_bound(...))`` with the same ``options``, from one pass
    over the row chunks: their float64 weights, most of either bound's time, once."""
    return _forward_bounds(case, reference, precision, **options)


def _forward_bounds(
    case: AttentionCase,
    reference: AttentionResult,
    precision: StreamingPrecision,
    *,
    block_n: int,
    exp2_error_ulp: float = 2.0,
    mma_unit_roundoff: float = 2**-23,
    kv_order: str = "any",
    tanh_error_ulp: float = 2.0,
    num_splits: int = 1,
    o: bool = True,
    lse: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The O bound (when ``o``, else an empty array) and the LSE bound (when ``lse``) of every
    row chunk."""
    chain = _check(
        case,
        precision,
        block_n,
        exp2_error_ulp,
        mma_unit_roundoff,
        kv_order,
        tanh_error_ulp,
        num_splits,
    )
    ref_o = None
    if o:
        ref_o = np.asarray(reference.o, dtype=np.float64)
        if ref_o.shape != (case.B, case.Sq, case.Hq, case.Dv):
            raise ValueError(
                f"reference.o shape {ref_o.shape} must be [B, Sq, Hq, Dv]="
                f"{(case.B, case.Sq, case.Hq, case.Dv)}"
            )
    n = case.Sk + 2 * _num_blocks(case, block_n) + (case.sink is not None) + chain.num_splits
    steps = -(-case.Sk // MMA_STEP) + _num_blocks(case, block_n)  # P V's MMA steps, at most
    pv_error = _mma_error(chain, case.Sk, steps, n, chain.u_pv, block_n)
    o_bound = np.zeros((case.B, case.Sq, case.Hq, case.Dv) if o else 0)
    lse_bound = np.zeros((case.B, case.Hq, case.Sq) if lse else 0)
    values = {}  # kv head -> _Values of the current batch: converted once, not per row chunk
    # An extreme case (a scale of 1e18) overflows the evaluation: inf - inf is NaN, mapped to
    # inf (no bound) rather than raised.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for chunk in _row_chunks(case, chain, block_n, kv_order):
            if o:
                key = (chunk.b, case.kv_head(chunk.h))
                if key not in values:
                    v = case.v[chunk.b, :, key[1], :]
                    if case.v_descale is not None:  # dequantized: exact in float64
                        v = v.astype(np.float64) * case.descale("v", *key)
                    values = {key: _Values.of(v)}
                out = _o_chunk_bound(case, chain, chunk, n, pv_error, ref_o, values[key])
                o_bound[chunk.b, chunk.rows, chunk.h, :] = out
            if lse:
                out = _lse_chunk_bound(case, chain, chunk, n, reference.lse)
                lse_bound[chunk.b, chunk.h, chunk.rows] = out
    return o_bound, lse_bound


def _o_chunk_bound(
    case: AttentionCase,
    chain: _Chain,
    chunk: _RowChunk,
    n: int,
    pv_error: float,
    ref_o: np.ndarray,
    value,
) -> np.ndarray:
    """The O bound of one row chunk (``value``: its kv head's :class:`_Values`; ``pv_error``:
    the relative error of the P V reduction, :func:`_mma_error`)."""
    v = value.v
    l_safe = np.where(chunk.l > 0, chunk.l, 1)[:, None]
    o = ref_o[chunk.b, chunk.rows, chunk.h, :]
    if np.isnan(o).any():
        o = np.where(np.isnan(o), chunk.p @ v / l_safe, o)
    p_mma = chunk.p + chunk.w_common + chunk.w_p  # >= |P~_j| entering P V
    rest = (chunk.w_p + pv_error * p_mma) @ value.abs_v
    numerator = _weighted_abs_dev(chunk.w_common, value, o) + rest
    numerator += chunk.w_sink[:, None] * np.abs(o)  # the sink: a key whose value is 0
    rel = (chunk.w_common.sum(axis=1) + chunk.w_sink)[:, None] / l_safe
    g = gamma(n, chain.u_acc)
    low = _row_sum_floor(chunk, rel[:, 0])[:, None]  # L~ >= l low (1 - g)
    x = (numerator / l_safe + (1 + rel) * g * np.abs(o)) / (low * (1 - g))
    x = np.where((low > 0) & (g < 1), x, np.inf)  # L~ may be ~0: no finite bound
    out = (1 + chain.u_acc) * x + chain.u_acc * np.abs(o)
    if case.v_descale is not None:  # O times v_descale: one more accumulator rounding
        out = (1 + chain.u_acc) * out + chain.u_acc * np.abs(o)
    out = np.where(chunk.clamps[:, None], np.inf, out)  # undefined: P may clamp
    out = out * (1 + chain.u_o) + chain.u_o * np.abs(o) + chain.half_sub_o
    out = np.where(np.isnan(out), np.inf, out * EVALUATION_SLACK)
    return _on_rows(chunk.l, out)


def _lse_chunk_bound(
    case: AttentionCase, chain: _Chain, chunk: _RowChunk, n: int, ref_lse: np.ndarray | None
) -> np.ndarray:
    """The LSE bound of one row chunk."""
    nonempty = chunk.l > 0
    ln_l = np.log(np.where(nonempty, chunk.l, 1))
    lse = chunk.scaled_max + ln_l
    if ref_lse is not None:
        given = np.asarray(ref_lse, dtype=np.float64)[chunk.b, chunk.h, chunk.rows]
        lse = np.where(np.isfinite(given), given, lse)
    # Only weights that enter row_sum move the LSE: w_common (it holds dP when row_sum adds
    # the rounded P); P's rounding before P V alone does not.
    relative = (chunk.w_common.sum(axis=1) + chunk.w_sink) / np.where(nonempty, chunk.l, 1)
    g = gamma(n, chain.u_acc)
    r = relative + g * (1 + relative)  # L~ <= (1 + r) l
    low = _row_sum_floor(chunk, relative) * (1 - g)  # L~ >= low l
    with np.errstate(divide="ignore"):  # low = 0: no finite bound
        below = np.where((low > 0) & (g < 1), -np.log(np.maximum(low, 0)), np.inf)
    d = np.maximum(np.log1p(r), below)  # >= |ln L~ - ln l|
    out = d + chain.eps * np.maximum(1, ln_l + d)
    out += 3 * chain.u_s * (np.abs(chunk.scaled_max) + chain.tau * LN_2 + np.abs(lse))
    if chain.num_splits > 1:  # the combine's log and addition
        out += chain.eps + 2 * chain.u_acc * np.abs(lse)
    out += _fp8_lse_error(case, chain, chunk.scaled_max, lse)
    if chain.rounded_p_sum:  # a clamped P enters the row sum too
        out = np.where(chunk.clamps, np.inf, out)
    out = np.where(np.isnan(out), np.inf, out * EVALUATION_SLACK)
    return _on_rows(chunk.l, out)


def _row_sum_floor(chunk: _RowChunk, rel: np.ndarray) -> np.ndarray:
    """``L~ / l`` is at least this before the accumulation error: the larger of ``1 - rel``
    (every weight lowered by its whole ``w``) and the multiplicative floor ``sum_j (p_j / (1 +
    eta_j) - f) / l`` (each weight's perturbation is a factor ``e^theta``, ``|theta| <= arg_j
    <= ln(1 + eta_j)``, or a flush to zero), which stays positive where ``rel`` reaches 1."""
    l_safe = np.where(chunk.l > 0, chunk.l, 1)
    return np.maximum(1 - rel, chunk.floor / l_safe)


def _fp8_lse_error(case: AttentionCase, chain: _Chain, scaled_max, lse) -> np.ndarray | float:
    """The LSE error an FP8 chain adds (module docstring, FP8): the descales' two roundings in
    ``c`` on ``m c``, and the offset carried by the row sum and taken out at the end."""
    out = 0.0
    if case.descaled:
        out = out + _scale_error(chain) * (np.abs(scaled_max) + chain.tau * LN_2)
    if chain.offset:
        offset = abs(chain.offset)
        out = out + chain.eps * offset * LN_2
        out = out + chain.u_s * (4 * offset * LN_2 + 2 * np.abs(lse))
    return out


def _scale_error(chain: _Chain) -> float:
    """Relative error ``c`` gains from the descales: ``fl(c fl(q_descale k_descale))``
    rounds twice more than ``fl(log2(e) scale)``."""
    return float(gamma(3, chain.u_s) - chain.u_s)


def saturating_rows(case: AttentionCase, precision: StreamingPrecision, *, block_n: int):
    """Bool ``[B, Hq, Sq]``: rows where ``precision``'s FP8 P can clamp (module docstring,
    FP8), so the O bound is undefined there (inf); all False for a chain that cannot."""
    chain = _check(case, precision, block_n, 2.0, 2**-23, "any", 2.0, 1)
    out = np.zeros((case.B, case.Hq, case.Sq), dtype=bool)
    if not (chain.saturates or chain.offset_clamps):
        return out
    for b in range(case.B):
        for h in range(case.Hq):
            out[b, h] = _clamping(visible(case, b, h, slice(None)), chain, block_n)
    return out


def _clamping(seen: np.ndarray, chain: _Chain, block_n: int) -> np.ndarray:
    """Rows of ``seen`` whose P can clamp: any visible row when ``2^offset`` alone exceeds the
    FP8 maximum, else rows with two visible blocks or more under a saturating chain (a row's
    first block sets its max exactly; a later one may leave it up to the threshold stale)."""
    if chain.offset_clamps:
        return seen.any(axis=1)
    if not chain.saturates:
        return np.zeros(len(seen), dtype=bool)
    return _rescales(seen, block_n, "any")[:, 0] >= 1


def _on_rows(row_sum: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` on rows that see a key (``row_sum > 0``), 0 on empty rows (the kernel must return
    exactly O = 0 / LSE = -inf there), inf where the evaluation itself overflowed (NaN)."""
    shape = (-1,) + (1,) * (out.ndim - 1)
    live, unknown = (row_sum > 0).reshape(shape), np.isnan(row_sum).reshape(shape)
    return np.where(live, out, np.where(unknown, np.inf, 0))


def visible_v_range(case: AttentionCase) -> np.ndarray:
    """``[B, Hq, Sq]``: the row's V range, ``max_c (max_j v_jc - min_j v_jc)`` over the keys j
    the row sees (0 for an empty row), of the dequantized V (times ``v_descale``) that O is
    made of. ``o_c`` lies in column c's range, so an O bound of at least this cannot tell a
    right answer from a wrong weighting: it is *vacuous*."""
    out = np.zeros((case.B, case.Hq, case.Sq))
    rows_per_chunk = max(1, _ROW_CHUNK_ELEMENTS // max(case.Sk * case.Dv, 1))
    for b in range(case.B):
        for h in range(case.Hq):
            kv_head = case.kv_head(h)  # times 1.0 (exact) without a descale
            v = case.v[b, :, kv_head, :].astype(np.float64) * case.descale("v", b, kv_head)
            for r0 in range(0, case.Sq, rows_per_chunk):
                rows = slice(r0, min(r0 + rows_per_chunk, case.Sq))
                seen = visible(case, b, h, rows)[:, :, None]
                with np.errstate(invalid="ignore"):  # padding may hold NaN: never selected
                    top = np.where(seen, v, -np.inf).max(axis=1, initial=-np.inf)
                    low = np.where(seen, v, np.inf).min(axis=1, initial=np.inf)
                spread = np.where(seen.any(axis=1), top - low, 0)
                out[b, h, rows] = spread.max(axis=1, initial=0)
    return out


def _check(
    case: AttentionCase,
    precision: StreamingPrecision,
    block_n: int,
    exp2_error_ulp: float,
    mma_unit_roundoff: float,
    kv_order: str,
    tanh_error_ulp: float,
    num_splits: int,
) -> _Chain:
    if not isinstance(case, AttentionCase):
        raise ValueError(f"case must be an AttentionCase, got {type(case).__name__}")
    if not isinstance(precision, StreamingPrecision):
        raise ValueError(f"precision must be a StreamingPrecision, got {type(precision).__name__}")
    if isinstance(block_n, bool) or not isinstance(block_n, (int, np.integer)) or block_n < 1:
        raise ValueError(f"block_n={block_n!r} must be an int >= 1 (the kernel's K/V tile)")
    if not (isinstance(exp2_error_ulp, (int, float)) and 0 <= exp2_error_ulp < 2**20):
        raise ValueError(f"exp2_error_ulp={exp2_error_ulp!r} must be a float in [0, 2^20)")
    if not (isinstance(mma_unit_roundoff, (int, float)) and 0 < mma_unit_roundoff < 2**-8):
        raise ValueError(f"mma_unit_roundoff={mma_unit_roundoff!r} must be in (0, 2^-8)")
    if kv_order not in KV_ORDERS:
        raise ValueError(f"kv_order={kv_order!r} must be one of {KV_ORDERS}")
    if not (isinstance(tanh_error_ulp, (int, float)) and 0 <= tanh_error_ulp < 2**20):
        raise ValueError(f"tanh_error_ulp={tanh_error_ulp!r} must be a float in [0, 2^20)")
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1")
    return _Chain.of(
        precision,
        float(exp2_error_ulp),
        float(mma_unit_roundoff),
        float(tanh_error_ulp),
        int(num_splits),
    )


def _num_blocks(case: AttentionCase, block_n: int) -> int:
    return -(-case.Sk // block_n)


def _row_chunks(case: AttentionCase, chain: _Chain, block_n: int, kv_order: str):
    """Yield :class:`_RowChunk` for every (b, h) and block of query rows."""
    heavy_elements = min(case.Sk, _HEAVY_KEYS) * case.Dv  # per row in _weighted_abs_dev
    rows_per_chunk = max(1, _ROW_CHUNK_ELEMENTS // max(case.Sk, heavy_elements // 8, 1))
    for b in range(case.B):
        keys = None  # (kv head, K as finite float64, |K| in float32), shared by its query heads
        for h in range(case.Hq):
            if keys is None or keys[0] != case.kv_head(h):
                k = _finite(case.k[b, :, case.kv_head(h), :])  # padding may hold NaN: never seen
                abs_k = k.astype(np.float32)  # exact: K holds 16/32-bit values
                keys = (case.kv_head(h), k, np.abs(abs_k, out=abs_k))
            _, k, abs_k = keys
            for r0 in range(0, case.Sq, rows_per_chunk):
                rows = slice(r0, min(r0 + rows_per_chunk, case.Sq))
                seen = visible(case, b, h, rows)
                q = case.q[b, rows, h, :].astype(np.float64)
                q = np.where(seen.any(axis=1)[:, None], q, 0)  # padded query rows too
                keys_of = (
                    k,
                    abs_k,
                    case.descale("q", b, h // case.group_size)
                    * case.descale("k", b, h // case.group_size),
                )
                yield _weights(case, b, h, rows, seen, q, keys_of, chain, block_n, kv_order)


def _weights(
    case: AttentionCase, b, h, rows, seen, q, keys, chain: _Chain, block_n: int, kv_order: str
) -> _RowChunk:
    """Float64 p, l, m of a row chunk and the per-key weights of the bound; ``keys``: K and
    ``|K|`` in float32 (raw values) and ``q_descale k_descale`` (1 without descales: the scores
    are then exactly those of the unscaled inputs)."""
    scale, cap = case.softmax_scale, case.softcap
    k, abs_k, descale = keys
    scores = q @ k.T
    if case.descaled:  # the dequantized scores (FP8)
        scores *= descale
    # s: what the kernel exponentiates with c; the logits themselves under a softcap
    s = scores if cap is None else cap * np.tanh(scale * scores / cap)
    c = LOG2_E * scale if cap is None else LOG2_E
    t = np.where(seen, s, -np.inf)
    m = t.max(axis=1, initial=-np.inf)
    sink_u = None if case.sink is None else float(case.sink[h]) * LOG2_E / c  # sigma_u
    if sink_u is not None:
        m = np.maximum(m, sink_u)
    nonempty = m > -np.inf
    m = np.where(nonempty, m, 0)[:, None]
    t -= m
    t *= c  # t_j = c (s_j - m) <= 0; -inf where masked
    p = np.exp2(t)  # 0 where masked
    cm = np.abs(c * m) + chain.tau  # |c m| with a stale (thresholded) max
    # ln2 dt_j: sum |q_k k_jk| by a float32 GEMM of exact 16/32-bit magnitudes, whose relative
    # error gamma_D(2^-24) is folded into the constant.
    D = q.shape[1]
    qk = np.abs(q).astype(np.float32) @ abs_k.T
    qk_error = _mma_error(chain, D, -(-D // MMA_STEP), D, chain.u_qk, D)
    qk_factor = LN_2 * LOG2_E * scale * qk_error * (1 + gamma(D, 2.0**-24))
    qk_factor *= descale  # sum_k |q_k k_jk| of the dequantized values
    if cap is not None:  # e_j's MMA term passes the scale, /cap, tanh and *cap
        qk_factor *= (1 + chain.eps_tanh) * (1 + chain.u_s) ** 3
    arg = np.multiply(qk, qk_factor, dtype=np.float64)
    if cap is not None:  # e_j's rounding terms (module docstring, softcap)
        eps_t, u_s = chain.eps_tanh, chain.u_s
        arg += gamma(2, u_s) * np.abs(scale * scores) + (eps_t + u_s + eps_t * u_s) * np.abs(s)
    arg += (LN_2 * chain.u_s * c) * (np.abs(s) + (m - s))  # u_s (c|s_j| + |t_j|)
    arg += LN_2 * chain.u_s * (chain.tau + 2 * cm) + chain.eps  # the row's constant part
    if case.descaled:  # c's two more roundings act on c (s_j - m_stale), |.| <= |t_j| + tau
        arg += (LN_2 * _scale_error(chain) * c) * (m - s) + LN_2 * _scale_error(chain) * chain.tau
    if chain.offset:  # fl(offset - fl(m c)): one more rounding of the exp2 argument's constant
        arg += LN_2 * chain.u_s * (abs(chain.offset) + cm)
    per_rescale = chain.eps + chain.u_acc + 3 * LN_2 * chain.u_s * cm
    rescales = _rescales(seen, block_n, kv_order)
    arg += rescales * per_rescale
    arg += _combine_error(chain, c, m, s, np.where(seen, t, 0), s.shape[1])
    p_sink, w_sink = _sink_weight(sink_u, m[:, 0], c, cm[:, 0], seen, block_n, chain, per_rescale)
    eta = arg * (1 + arg)  # >= expm1(arg) for 0 <= arg <= 1.79; exact expm1 beyond
    large = arg > 1
    with np.errstate(over="ignore", invalid="ignore"):
        eta[large] = np.expm1(arg[large])
        w_common = np.where(seen, p * eta + chain.ftz, 0)  # p eta + f
        # p~ = p e^theta, |theta| <= arg (exp2, rescales, combine: factors), or 0 (flushed),
        # and 1 + eta >= e^arg: p~ >= p / (1 + eta) - f
        low = np.where(seen, p / (1 + eta) - chain.ftz, 0)
    w_common[np.isnan(w_common)] = np.inf  # p underflowed while eta overflowed
    w_p = np.where(seen, chain.u_p * (p + w_common) + chain.half_sub_p, 0)  # P~ <= p + w
    if chain.rounded_p_sum:  # row_sum adds the rounded P: its error cancels like a weight error
        low = low - w_p
        w_common, w_p = w_common + w_p, np.zeros_like(w_p)
    return _RowChunk(
        b=b,
        h=h,
        rows=rows,
        seen=seen,
        p=p,
        l=p.sum(axis=1) + p_sink,
        scaled_max=(m[:, 0] * c * LN_2),
        w_common=w_common,
        w_p=w_p,
        w_sink=w_sink,
        floor=np.nan_to_num(low).sum(axis=1) + p_sink - w_sink,
        clamps=_clamping(seen, chain, block_n),
    )


def _sink_weight(
    sink_u: float | None,
    m: np.ndarray,
    c: float,
    cm: np.ndarray,
    seen: np.ndarray,
    block_n: int,
    chain: _Chain,
    per_rescale: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``(p_sigma, w_sigma)`` per row (module docstring, sink); zeros without a sink."""
    if sink_u is None:
        return np.zeros(len(m)), np.zeros(len(m))
    t = c * (sink_u - m)  # <= 0
    arg = LN_2 * chain.u_s * (np.abs(t) + chain.tau + 2 * cm + 3 * abs(c * sink_u)) + chain.eps
    blocks = _rescales(seen, block_n, "any")[:, 0] + seen.any(axis=1)  # every visible block
    arg += blocks * per_rescale[:, 0]
    arg += _combine_error(chain, c, m, sink_u, t, seen.shape[1])
    p = np.exp2(t)
    return p, p * np.expm1(arg) + chain.ftz


def _combine_error(chain: _Chain, c: float, m, s, t, keys: int):
    """The split-KV combine's exponent error per key (module docstring, split-KV); 0 for one
    split. ``m``, ``s``, ``t``: row max, score and ``c (s - m)`` (arrays or scalars)."""
    if chain.num_splits == 1:
        return 0.0
    u, ln_n, lm = chain.u_acc, np.log(max(keys, 1)), LN_2 * np.abs(c * m)
    ls, lt = LN_2 * np.abs(c * s), LN_2 * np.abs(t)
    return 4 * u + 2 * chain.eps + 3 * u * (lm + ls + ln_n) + u * (lt + ln_n) + 2 * u * (lm + ln_n)


def _rescales(seen: np.ndarray, block_n: int, kv_order: str) -> np.ndarray:
    """Rescales by alpha that can follow each key's block (module docstring): ``[r, Sk]``, or
    ``[r, 1]`` for ``kv_order="any"``, where it is the row's visible blocks minus one."""
    r, Sk = seen.shape
    n_b = -(-Sk // block_n)
    padded = np.zeros((r, n_b * block_n), dtype=bool)
    padded[:, :Sk] = seen
    blocks = padded.reshape(r, n_b, block_n).any(axis=2).astype(np.int64)
    total = blocks.sum(axis=1, keepdims=True)
    if kv_order == "any":
        return np.maximum(total - 1, 0)
    if kv_order == "forward":
        after = total - np.cumsum(blocks, axis=1)
    else:
        after = np.cumsum(blocks, axis=1) - blocks
    return np.repeat(after, block_n, axis=1)[:, :Sk]


def _finite(x: np.ndarray) -> np.ndarray:
    """float64 copy with non-finite entries (padding, keys no row sees) set to 0: a visible
    key is finite, and a masked one only ever meets a weight of 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.array(x, dtype=np.float64)  # always a copy: zeroed in place below
    x[~np.isfinite(x)] = 0.0
    return x


@dataclass(frozen=True)
class _Values:
    """One kv head's V and what :func:`_weighted_abs_dev` derives from it, computed once."""

    v: np.ndarray  # [Sk, Dv], non-finite entries zeroed
    abs_v: np.ndarray
    mu: np.ndarray  # column means
    abs_dev: np.ndarray  # |v - mu|

    @classmethod
    def of(cls, v: np.ndarray) -> _Values:
        v = _finite(v)
        mu = v.mean(axis=0) if len(v) else np.zeros(v.shape[1])
        abs_dev = v - mu
        return cls(v, np.abs(v), mu, np.abs(abs_dev, out=abs_dev))


def _weighted_abs_dev(w: np.ndarray, values: _Values, o: np.ndarray) -> np.ndarray:
    """``[r, Dv]`` upper bound on ``sum_j w_ij |v_jc - o_ic|`` (w >= 0) in O(r K Dv) + matmuls.

    The ``K = _HEAVY_KEYS`` largest weights of a row are summed exactly; the rest use
    ``|v_jc - o_ic| <= |v_jc - mu_c| + |mu_c - o_ic|`` (``mu`` = V's column mean), two matmuls.
    The split is loose only where a light key's v is near o; heavy keys, where o sits (peaky
    rows), are exact, and with flat weights o ~ mu makes the split tight.
    """
    r, Sk = w.shape
    v, mu = values.v, values.mu
    if Sk > _HEAVY_KEYS:
        heavy = np.argpartition(w, Sk - _HEAVY_KEYS, axis=1)[:, Sk - _HEAVY_KEYS :]
        w_heavy = np.take_along_axis(w, heavy, axis=1)
        light = w.copy()
        np.put_along_axis(light, heavy, 0.0, axis=1)
    else:
        heavy, w_heavy, light = np.broadcast_to(np.arange(Sk), w.shape), w, np.zeros_like(w)
    out = np.empty_like(o)
    with np.errstate(invalid="ignore", over="ignore"):  # inf weights (eta overflowed) stay inf
        for i0 in range(0, r, _HEAVY_ROWS):  # small blocks keep the r x K x Dv gather in cache
            i = slice(i0, i0 + _HEAVY_ROWS)
            abs_dev = np.abs(v[heavy[i]] - o[i, None, :])
            out[i] = np.matmul(w_heavy[i, None, :], abs_dev)[:, 0, :]
        out += light @ values.abs_dev + np.abs(o - mu) * light.sum(axis=1, keepdims=True)
    return np.where(np.isnan(out), np.inf, out)
