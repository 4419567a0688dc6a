"""Derived per-element error bound of a FlashAttention-style backward pass (dq, dk, dv).

As for the forward (:mod:`reference.bounds`), the tolerance is not a fixed ``atol``/``rtol``:
every gradient element gets the bound of the declared :class:`BackwardPrecision` chain,
evaluated in float64 from the case (``docs/backward.md`` derives it). Per visible pair
``(i, j)`` of a query row and a key, with ``c = log2(e) softmax_scale``, ``P`` the exact
probability, ``g = dO_i . v_j``, ``D' = dO_i . O_i - dlse_i``, ``r = |g - D'|``, ``beta_O`` and
``beta_L`` the forward chain's O and LSE bounds, ``u`` the unit roundoff of the backward's
elementwise/accumulator dtype, ``u_m`` its MMA's (``mma_unit_roundoff`` for float32: tensor
cores truncate), ``eps`` exp2's relative error, ``f`` the flush-to-zero threshold::

    a    = u c |m| + 2u |LSE2| + log2(e) beta_L (1 + 2u)     (common to the row; m its max s)
    b    = (1 + u) [c gamma_D(u_m) (1 + u) sum|q k| + u c |s - m|] + u a + u |t|
                                                (t = c s - LSE2, the exp2 argument)
    P^ - P = alpha_i P + pi                     (P recomputed from the saved LSE)
    omega = expm1(ln2 a) >= |alpha_i|,   w_pi = P (1 + omega) expm1(ln2 b + 2 eps) + f >= |pi|
    w    = omega P + w_pi                       >= |P^ - P|
    wP   = w + u_P (P + w) + sigma_P / 2        >= |P rounded for dV - P|
    e_g  = gamma_Dv(u_m) sum|dO v|              >= |dP^ - g|
    e_D  = (1 + u) [sum|dO| beta_O + gamma_Dv(u) sum|dO| (|O| + beta_O)] + u |D'|
    e_dS = w r + (P + w)(e_g + e_D) + gamma_2(u) (P + w)(r + e_g + e_D)    >= |dS^ - dS|
           (w is wP where dS is formed from the rounded P, ``ds_from_rounded_p``)
    x    = e_dS + u_dS (P r + e_dS) + sigma_dS / 2                         (dS rounded for MMAs)

then, with ``N`` the products each element sums (``Sk`` for dq, ``group * Sq`` for dk/dv; any
summation order or blocking is a summation tree of them, so ``gamma_N`` covers atomic adds)::

    dq: A = omega |sum_j dS k_j| + e_D (|sum_j P k_j| + sum_j w |k_j|) + sum_j x' |k_j|
            + gamma_N(u_m) sum_j (P r + x) |k_j|,  M = sum_j P r |k_j|
        (x' is x without omega P r and (P + w) e_D: alpha_i dS and the D error delta_i P have
        a factor common to the row, so dq sums them over the row first, in float64 with the
        2^-30 allowance on the magnitudes they cancel; the rest has no such factor)
        |dq^ - dq| <= scale [A (1 + u)^2 + M (2u + u^2)]     (the scale multiply in the accumulator)
    dk: sum_i x |q_i| + gamma_N(u_m) sum_i (P r + x) |q_i| in place of A (and every query head
        of the group): dS's columns do not sum to zero, so no term cancels
    dv: sum_i wP |dO_i| + gamma_N(u_m) sum_i (P + wP) |dO_i|

and each adds ``2 N f``, times ``max(1, scale)`` for dq and dk: gamma_N covers the rounding of
normal results only, and each of the N products and N - 1 additions may underflow (flushed
to zero in a flush-to-zero accumulator, as GPU kernels run) and lose up to ``f``. It is 2^-112
at 16k products, and decides only where a gradient is itself near ``f`` (a tiny dO).

with ``ds_scaled`` (dS multiplied by the scale before its 16-bit rounding) the same holds with
``sigma_dS / 2`` divided by the scale (the rounding's absolute step, in unscaled units; the
multiply's own rounding is the scale term's ``(1 + u)^2``). With ``ds_flushes_subnormals``
(a rounded dS below the 16-bit format's smallest normal ``tiny_dS`` becomes 0) ``sigma_dS / 2``
is ``tiny_dS``: a normal result still errs by at most ``u_dS`` relative, and a flushed one
by its own magnitude, which is below ``tiny_dS`` (rounding is monotone and ``tiny_dS`` is
representable, so it came from a value below it); under ``ds_scaled`` that is divided by
the scale as well. Where ``|dS| + e_dS`` (times the
scale under ``ds_scaled``) reaches the 16-bit maximum, the rounded dS may be inf and every
element it reaches is unbounded. With ``dkv_rounded_per_head`` (GQA group of G heads), dk
and dv first gain each head's own rounding and the group sum, ``+ u_o (M + E) + G sigma_o /
2`` and ``gamma_(G-1)(u)`` times the rounded heads' magnitude (E the bound so far, M the
magnitude); then a narrower output dtype multiplies by ``1 + u_o`` and adds ``u_o |reference| +
sigma_o / 2``; where ``|reference|`` or ``M`` plus the bound reaches the accumulator's or the
output's largest finite value, the result may overflow and the bound is inf. ``M`` (``scale
sum P r |k|`` etc.) bounds ``|gradient|``: a bound at least ``M`` cannot tell the gradient from
0, so such elements are counted *vacuous* (:meth:`GradientBounds.vacuous`). Elements no visible
pair reaches get bound 0 (the kernel must
return exactly 0). Evaluated in float64, row chunks at a time, times ``1 + 2^-30``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from attention_crossval.reference.bounds import (
    EVALUATION_SLACK,
    _check,
    format_info,
    forward_error_bounds,
    gamma,
    unit_roundoff,
)
from attention_crossval.reference.case import AttentionResult
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import visible
from attention_crossval.reference.precision import LN_2, LOG2_E, BackwardPrecision

GRADIENTS = ("dq", "dk", "dv")
_ROW_CHUNK_ELEMENTS = 1 << 18  # rows x keys per chunk: ~20 float64 arrays of it live
_FLOAT64_ALLOWANCE = EVALUATION_SLACK - 1  # float64 error of a signed sum, per unit of |terms|


@dataclass(frozen=True, eq=False)
class GradientBounds:
    """Per-element bounds on ``|gradient_kernel - gradient_exact|`` for dq, dk, dv (layout of
    :class:`~reference.gradients.Gradients`), and ``*_scale``: the magnitude M of the terms each
    element sums (which bounds the gradient itself), without pairs whose ``g - D'`` is a
    structural zero (below float64's resolution of it); ``*_undefined``: elements that a 16-bit
    dS which may overflow reaches, where any value, NaN included, is the chain's (bound inf)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dq_scale: np.ndarray
    dk_scale: np.ndarray
    dv_scale: np.ndarray
    dq_undefined: np.ndarray
    dk_undefined: np.ndarray
    dv_undefined: np.ndarray

    def vacuous(self) -> dict[str, int]:
        """Per gradient, elements whose bound is inf or at least their scale (> 0): there the
        bound admits 0 and either sign, so a pass proves little."""
        out = {}
        for name in GRADIENTS:
            bound, scale = getattr(self, name), getattr(self, f"{name}_scale")
            out[name] = int((np.isinf(bound) | ((scale > 0) & (bound >= scale))).sum())
        return out


@dataclass(frozen=True)
class _BackwardChain:
    """Unit roundoffs of each backward stage (module docstring)."""

    u: float
    u_m: float
    eps: float
    ftz: float
    u_p: float
    half_sub_p: float
    u_ds: float
    abs_ds: float  # dS rounding's absolute error: half a subnormal step, or tiny if flushed
    u_o: float
    half_sub_o: float
    overflow: float  # the smallest magnitude the accumulator or the output may turn into inf
    ds_overflow: float  # the magnitude at which dS rounded for the MMAs may turn into inf
    ds_scale: float  # what dS is multiplied by before that rounding (1, or softmax_scale)
    ds_from_rounded_p: bool

    @classmethod
    def of(cls, precision: BackwardPrecision, exp2_error_ulp: float, mma_u: float):
        acc = precision.accum_dtype
        u = unit_roundoff(acc)

        def rounding(dtype: str | None) -> tuple[float, float]:
            if dtype is None or dtype == acc:
                return 0.0, 0.0
            return unit_roundoff(dtype), float(format_info(dtype).smallest_subnormal) / 2

        u_p, half_sub_p = rounding(precision.p_dtype)
        u_ds, abs_ds = rounding(precision.ds_dtype)
        if precision.ds_flushes_subnormals:  # a result below the smallest normal becomes 0
            abs_ds = float(format_info(precision.ds_dtype).tiny)
        u_o, half_sub_o = rounding(precision.output_dtype)
        return cls(
            u=u,
            u_m=mma_u if acc == "float32" else u,
            eps=exp2_error_ulp * 2 * u,
            ftz=float(format_info(acc).tiny),
            u_p=u_p,
            half_sub_p=half_sub_p,
            u_ds=u_ds,
            abs_ds=abs_ds,
            u_o=u_o,
            half_sub_o=half_sub_o,
            overflow=min(float(format_info(t).max) for t in (acc, precision.output_dtype or acc)),
            ds_overflow=float(format_info(precision.ds_dtype or acc).max),
            ds_scale=1.0,
            ds_from_rounded_p=precision.ds_from_rounded_p,
        )


def backward_error_bound(
    case: BackwardCase,
    precision: BackwardPrecision,
    reference: Gradients,
    *,
    block_n: int = 1,
    exp2_error_ulp: float = 2.0,
    mma_unit_roundoff: float = 2**-23,
) -> GradientBounds:
    """Rigorous per-element bounds on a kernel's dq, dk, dv under ``precision`` (module
    docstring). ``reference`` (e.g. float64 gradients; NaN where unknown) supplies the
    magnitudes for the output rounding; P, O, LSE and D are recomputed in float64. ``block_n``
    is the forward's K/V tile, which the O and LSE bounds of ``precision.forward`` depend on:
    the default 1 is valid for every tiling; the kernel's tile tightens it a little.
    """
    if not isinstance(case, BackwardCase):
        raise ValueError(f"case must be a BackwardCase, got {type(case).__name__}")
    if not isinstance(precision, BackwardPrecision):
        raise ValueError(f"precision must be a BackwardPrecision, got {type(precision).__name__}")
    fwd = case.forward
    if fwd.softcap is not None or fwd.sink is not None:
        raise NotImplementedError("the backward of softcap or sink cases is not modelled yet")
    _check(fwd, precision.forward, block_n, exp2_error_ulp, mma_unit_roundoff, "any", 2.0, 1)
    _check_reference(case, reference)
    chain = _BackwardChain.of(precision, float(exp2_error_ulp), float(mma_unit_roundoff))
    if precision.ds_scaled:  # dS * scale is rounded: its absolute error is 1/scale larger
        scale = fwd.softmax_scale
        chain = replace(chain, abs_ds=chain.abs_ds / scale, ds_scale=scale)
    unknown = AttentionResult(o=np.full((fwd.B, fwd.Sq, fwd.Hq, fwd.Dv), np.nan), lse=None)
    options = dict(
        block_n=block_n, exp2_error_ulp=exp2_error_ulp, mma_unit_roundoff=mma_unit_roundoff
    )
    beta_o, beta_l = forward_error_bounds(fwd, unknown, precision.forward, **options)
    sums = _PairSums(case)
    chunk = max(1, _ROW_CHUNK_ELEMENTS // max(fwd.Sk, 1))
    # An unbounded forward (inf) times a zero term gives NaN, mapped to inf at the end.
    with np.errstate(over="ignore", invalid="ignore"):
        for b in range(fwd.B):
            for h in range(fwd.Hq):
                for r0 in range(0, fwd.Sq, chunk):
                    rows = slice(r0, min(r0 + chunk, fwd.Sq))
                    _add_chunk(case, chain, b, h, rows, beta_o, beta_l, sums)
    u, scale = chain.u, fwd.softmax_scale
    n_dq, n_dkv = fwd.Sk, fwd.group_size * fwd.Sq

    def finish(total: np.ndarray, magnitude: np.ndarray, ref: np.ndarray) -> np.ndarray:
        total = np.where(np.isnan(total), np.inf, total)  # inf * 0: an unbounded P error
        ref = np.where(np.isfinite(ref), np.abs(ref), magnitude)
        with np.errstate(invalid="ignore"):  # inf * 0 where the output is not rounded
            out = total * (1 + chain.u_o) + chain.u_o * ref + chain.half_sub_o
        # A partial sum or the result may overflow the accumulator or the output: no bound.
        out = np.where(np.maximum(ref, magnitude) + total < chain.overflow, out, np.inf)
        out = np.where(np.isnan(out), np.inf, out * EVALUATION_SLACK)
        return np.where((total > 0) | (magnitude > 0), out, 0)

    def scaled(first: np.ndarray, second: np.ndarray, magnitude: np.ndarray, n: int):
        accumulated = first + gamma(n, chain.u_m) * second
        return scale * (accumulated * (1 + u) ** 2 + magnitude * (2 * u + u * u))

    def per_head(total: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
        # Each of the G heads' results rounded to the output (|x_h| <= M_h + E_h), then their
        # sum in the accumulator: G - 1 more additions.
        if not (precision.dkv_rounded_per_head and fwd.group_size > 1):
            return total
        g = fwd.group_size
        heads = magnitude + total + g * chain.half_sub_o  # >= the sum of the heads' |x_h|
        rounded = total + chain.u_o * (magnitude + total) + g * chain.half_sub_o
        return rounded + gamma(g - 1, u) * (1 + chain.u_o) * heads

    def with_underflow(total: np.ndarray, magnitude: np.ndarray, n: int, scaled_units: bool):
        # Each of the N products and N - 1 additions may underflow (below f), which the
        # relative gamma_N does not cover; dq and dk carry the scale, in or after the sums.
        # Elements no pair reaches sum no products and stay exact.
        loss = 2 * n * chain.ftz * (max(1.0, scale) if scaled_units else 1.0)
        return np.where((total > 0) | (magnitude > 0), total + loss, total)

    dq_mag, dk_mag = scale * sums.dq_mag, scale * sums.dk_mag
    dq_total = scaled(sums.dq_x, sums.dq_xs, sums.dq_mag, n_dq)
    dq_total = with_underflow(dq_total, dq_mag, n_dq, True)
    dk_total = scaled(sums.dk_x, sums.dk_xs, sums.dk_mag, n_dkv)
    dk_total = per_head(with_underflow(dk_total, dk_mag, n_dkv, True), dk_mag)
    dv_total = sums.dv_w + gamma(n_dkv, chain.u_m) * sums.dv_ws
    dv_total = per_head(with_underflow(dv_total, sums.dv_mag, n_dkv, False), sums.dv_mag)
    return GradientBounds(
        dq=finish(dq_total, dq_mag, reference.dq),
        dk=finish(dk_total, dk_mag, reference.dk),
        dv=finish(dv_total, sums.dv_mag, reference.dv),
        dq_scale=scale * sums.dq_resolved,
        dk_scale=scale * sums.dk_resolved,
        dv_scale=sums.dv_mag,
        dq_undefined=sums.dq_undefined,
        dk_undefined=sums.dk_undefined,
        dv_undefined=np.zeros(np.shape(sums.dv_mag), dtype=bool),  # P <= 1: no overflow
    )


class _PairSums:
    """The per-element sums over visible pairs (module docstring): ``*_x`` the rounding terms,
    ``*_xs`` what gamma_N multiplies, ``*_mag`` the magnitudes M (dq/dk before the scale),
    ``*_resolved`` M without the pairs whose ``r`` is below float64's resolution."""

    def __init__(self, case: BackwardCase) -> None:
        f = case.forward
        self.dq_x, self.dq_xs, self.dq_mag = (np.zeros((f.B, f.Sq, f.Hq, f.D)) for _ in range(3))
        self.dk_x, self.dk_xs, self.dk_mag = (np.zeros((f.B, f.Sk, f.Hkv, f.D)) for _ in range(3))
        self.dv_w, self.dv_ws, self.dv_mag = (np.zeros((f.B, f.Sk, f.Hkv, f.Dv)) for _ in range(3))
        self.dq_resolved = np.zeros((f.B, f.Sq, f.Hq, f.D))  # M over the resolved |dS| only
        self.dk_resolved = np.zeros((f.B, f.Sk, f.Hkv, f.D))
        self.dq_undefined = np.zeros((f.B, f.Sq, f.Hq, f.D), dtype=bool)  # a dS may overflow
        self.dk_undefined = np.zeros((f.B, f.Sk, f.Hkv, f.D), dtype=bool)


def _add_chunk(
    case: BackwardCase,
    chain: _BackwardChain,
    b: int,
    h: int,
    rows: slice,
    beta_o: np.ndarray,
    beta_l: np.ndarray,
    sums: _PairSums,
) -> None:
    """Float64 P, O, LSE, D of one row chunk of (b, h) and its pair terms, added into ``sums``."""
    f = case.forward
    u, kv_head = chain.u, f.kv_head(h)
    seen = visible(f, b, h, rows)
    live_rows, live_keys = seen.any(axis=1), seen.any(axis=0)
    if not live_rows.any():
        return
    # Only the span of the keys the chunk's rows see: a key outside it is in no visible pair
    # of the chunk, so it adds nothing (causal and window chunks see a fraction of Sk).
    first, last = np.flatnonzero(live_keys)[[0, -1]]
    keys = slice(int(first), int(last) + 1)
    seen, live_keys = seen[:, keys], live_keys[keys]
    q = np.where(live_rows[:, None], f.q[b, rows, h].astype(np.float64), 0)  # padding: never
    do = np.where(live_rows[:, None], case.do[b, rows, h].astype(np.float64), 0)  # read
    k = np.where(live_keys[:, None], f.k[b, keys, kv_head].astype(np.float64), 0)
    v = np.where(live_keys[:, None], f.v[b, keys, kv_head].astype(np.float64), 0)
    dlse = 0.0 if case.dlse is None else np.where(live_rows, case.dlse[b, h, rows], 0)
    c = LOG2_E * f.softmax_scale
    s = q @ k.T
    m = np.where(live_rows, np.where(seen, s, -np.inf).max(axis=1), 0)[:, None]
    s_m = s - m
    p = np.exp2(c * np.where(seen, s_m, -np.inf))  # 0 where masked
    l = np.where(live_rows, p.sum(axis=1), 1)[:, None]
    p /= l  # P, the exact probabilities (float64)
    lse2 = np.where(live_rows[:, None], c * m + np.log2(l), 0)  # LSE2 = LSE log2(e)
    o = p @ v
    d = (do * o).sum(axis=1, keepdims=True) - np.asarray(dlse).reshape(-1, 1)  # D'
    g_minus_d = do @ v.T - d  # g - D'
    r = np.abs(g_minus_d)
    abs_do = np.abs(do)
    abs_g = abs_do @ np.abs(v).T  # >= |g|
    beta_o_rows = np.where(live_rows[:, None], beta_o[b, rows, h], 0)
    beta_l_rows = np.where(live_rows, beta_l[b, h, rows], 0)[:, None]
    D, Dv = f.D, f.Dv
    # The exp2 argument's error, split into the part common to the row (the LSE's error, the
    # rounding of LSE2 and of c times the row max) and the pair's own (S by MMA, c times s - m,
    # the FMA): P^ = P 2^(a_i) 2^(b_ij) (1 + exp2's error), so P^ - P = alpha_i P + pi_ij.
    dt_row = u * c * np.abs(m) + 2 * u * np.abs(lse2) + LOG2_E * beta_l_rows * (1 + 2 * u)
    abs_q, abs_k = np.abs(q), np.abs(k)
    dt_pair = (1 + u) * c * (gamma(D, chain.u_m) * (1 + u) * (abs_q @ abs_k.T))
    dt_pair += (1 + u) * u * c * np.abs(s_m) + u * dt_row + u * np.abs(c * s - lse2)
    omega = np.expm1(LN_2 * dt_row)  # >= |alpha_i|, [rows, 1]
    pi = p * (1 + omega) * np.expm1(LN_2 * dt_pair + 2 * chain.eps) + chain.ftz  # >= |pi_ij|
    pi = np.where(seen, pi, 0)
    w = np.where(seen, omega * p + pi, 0)  # >= |P^ - P|
    p_rounding = np.where(seen, chain.u_p * (p + w) + chain.half_sub_p, 0)
    w_p = w + p_rounding  # >= |P rounded for dV - P|
    e_g = gamma(Dv, chain.u_m) * abs_g
    e_d0 = (abs_do * beta_o_rows).sum(axis=1, keepdims=True)
    e_d0 += gamma(Dv, u) * (abs_do * (np.abs(o) + beta_o_rows)).sum(axis=1, keepdims=True)
    e_d = (1 + u) * e_d0 + u * np.abs(d)
    # The error of the P that dS is formed from: the 16-bit rounding, if any, is the pair's.
    w_ds, pi_ds = (w_p, pi + p_rounding) if chain.ds_from_rounded_p else (w, pi)
    p_ds = p + w_ds
    both = gamma(2, u) * p_ds * (r + e_g + e_d)  # the product of the two errors, and its rounding
    e_ds = w_ds * r + p_ds * (e_g + e_d) + both
    ds = p * r  # |dS|
    ds_reached = ds + e_ds  # >= |dS^|
    ds_rounding = chain.u_ds * ds_reached + chain.abs_ds
    x = np.where(seen, e_ds + ds_rounding, 0)
    # dS^ - dS = alpha_i dS - delta_i P_ds^ + (the rest, at most x_pair): the first two have a
    # common factor per row, so dq sums them over the row before taking magnitudes.
    x_pair = pi_ds * r + p_ds * e_g + both
    x_pair = np.where(seen, x_pair + ds_rounding, 0)
    # dS rounded to 16 bits may overflow to +-inf: every element it reaches is undefined (an
    # inf - inf in the MMA may make it NaN).
    overflow = seen & (chain.ds_scale * ds_reached >= chain.ds_overflow)
    x = np.where(overflow, np.inf, x)
    x_pair = np.where(overflow, np.inf, x_pair)
    sums.dq_undefined[b, rows, h] |= overflow.any(axis=1)[:, None]
    sums.dk_undefined[b, keys, kv_head] |= overflow.any(axis=0)[:, None]
    # The vacuity scale counts only r the float64 recomputation resolves: structural zeros
    # (a row with one key has g = D' exactly) must not look like a vacuous bound.
    g_d = abs_g + np.abs(d)  # >= |g| + |D'|
    ds_resolved = np.where(r > 2.0**-40 * g_d, ds, 0)
    # |sum_j dS_ij k_j| and |sum_j P_ij k_j| over the whole row (keys are not chunked), in
    # float64 with the module's evaluation allowance on the magnitudes that may cancel.
    ds_k = np.abs((p * g_minus_d) @ k) + _FLOAT64_ALLOWANCE * ((p * g_d) @ abs_k)
    p_k = np.abs(p @ k) + _FLOAT64_ALLOWANCE * (p @ abs_k)
    sums.dq_x[b, rows, h] += omega * ds_k + e_d * (p_k + w_ds @ abs_k) + x_pair @ abs_k
    ds_x = ds + x
    sums.dq_xs[b, rows, h] += ds_x @ abs_k
    sums.dq_mag[b, rows, h] += ds @ abs_k
    sums.dq_resolved[b, rows, h] += ds_resolved @ abs_k
    sums.dk_x[b, keys, kv_head] += x.T @ abs_q
    sums.dk_xs[b, keys, kv_head] += ds_x.T @ abs_q
    sums.dk_mag[b, keys, kv_head] += ds.T @ abs_q
    sums.dk_resolved[b, keys, kv_head] += ds_resolved.T @ abs_q
    sums.dv_w[b, keys, kv_head] += w_p.T @ abs_do
    sums.dv_ws[b, keys, kv_head] += (p + w_p).T @ abs_do
    sums.dv_mag[b, keys, kv_head] += p.T @ abs_do


def _check_reference(case: BackwardCase, reference: Gradients) -> None:
    if not isinstance(reference, Gradients):
        raise ValueError(f"reference must be a Gradients, got {type(reference).__name__}")
    f = case.forward
    shapes = {
        "dq": (f.B, f.Sq, f.Hq, f.D),
        "dk": (f.B, f.Sk, f.Hkv, f.D),
        "dv": (f.B, f.Sk, f.Hkv, f.Dv),
    }
    for name, shape in shapes.items():
        got = np.shape(getattr(reference, name))
        if got != shape:
            raise ValueError(f"reference.{name} shape {got} must be {shape}")
