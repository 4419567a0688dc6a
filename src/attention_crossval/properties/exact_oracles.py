"""The exact tiers' oracles, shared by their property tests: small cases with values over whole
exponent ranges, and independent mpmath loops compared at double precision."""

from __future__ import annotations

import mpmath
import numpy as np
from hypothesis import strategies as st

from attention_crossval.reference.case import (
    INPUT_DTYPES,
    WIDE_DTYPES,
    AttentionCase,
    CausalAlignment,
    Mask,
)
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.masks import visible


def dtype_values(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: str, kind: str
) -> np.ndarray:
    """Arrays of one input dtype: ``normal`` N(0, 1.5^2) or ``wide`` (log-uniform magnitudes over
    most of the dtype's exponent range, zeros and subnormals included)."""
    if kind == "normal":
        x = rng.standard_normal(shape) * 1.5
    else:
        limit = {"float16": 15, "bfloat16": 120, "float32": 120}[dtype]
        x = rng.choice([-1.0, 1.0], shape) * np.exp2(rng.uniform(-limit - 10, limit, shape))
        x[rng.random(shape) < 0.1] = 0.0
    return x.astype(np.float32).astype(INPUT_DTYPES[dtype])


@st.composite
def cases(draw, dtypes=WIDE_DTYPES, kinds=("normal", "wide"), max_len=8) -> AttentionCase:
    """Small cases from drawn parameters and a seed: shapes, GQA ratio, dtype, value kind, scale,
    causal alignment, window, varlen padding (NaN at padded K/V) and explicit masks."""
    B, Sq, Sk = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, max_len)),
        draw(st.integers(1, max_len)),
    )
    Hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    D, Dv = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    dtype, kind = draw(st.sampled_from(dtypes)), draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([None, 1.0, 0.0625, 3.0]))
    window = draw(st.sampled_from([None, 0, 2]))
    mask = Mask(
        causal=draw(st.booleans()),
        alignment=draw(st.sampled_from(list(CausalAlignment))),
        window_left=window,
        window_right=draw(st.sampled_from([None, 1])) if window is not None else None,
        q_lengths=draw(st.none() | st.lists(st.integers(0, Sq), min_size=B, max_size=B)),
        k_lengths=draw(st.none() | st.lists(st.integers(0, Sk), min_size=B, max_size=B)),
        explicit=np.random.default_rng(seed).random((B, 1, Sq, Sk)) < 0.8
        if draw(st.booleans())
        else None,
    )
    rng = np.random.default_rng(seed)
    q = dtype_values(rng, (B, Sq, Hkv * group, D), dtype, kind)
    k = dtype_values(rng, (B, Sk, Hkv, D), dtype, kind)
    v = dtype_values(rng, (B, Sk, Hkv, Dv), dtype, kind)
    for array, lengths in ((q, mask.q_lengths), (k, mask.k_lengths), (v, mask.k_lengths)):
        for b, n in enumerate(lengths or ()):
            array[b, n:] = np.nan  # padding must never be read
    return AttentionCase(q, k, v, softmax_scale=scale, mask=mask)


def agrees_with_double(hi: np.ndarray, lo: np.ndarray, bound: np.ndarray, other: np.ndarray):
    """True where ``other`` (the nearest double to the naive loop's value, itself within
    ``1e-90`` relative of the exact one) lies within its half ulp plus the certified bound of
    ``hi + lo``. As sharp as a double allows, and it tolerates unresolvable rounding ties."""
    gap = np.abs((hi - other) + lo)
    allowed = bound + 0.5 * np.spacing(np.abs(other)) + 1e-90 * np.abs(other)
    return gap <= allowed * (1 + 2.0**-50)


def naive_backward(case: BackwardCase, dps: int = 80) -> dict[str, np.ndarray]:
    """Independent, obviously correct mpmath loop (private context, ``dps`` digits): dq, dk,
    dv (dk/dv summed over GQA groups) and ``d`` = D - dlse, nearest doubles."""
    f = case.forward
    ctx = mpmath.MPContext()
    ctx.dps = dps
    mp = np.frompyfunc(lambda x: ctx.mpf(float(x)), 1, 1)
    scale = ctx.mpf(f.softmax_scale)
    dq = np.full((f.B, f.Sq, f.Hq, f.D), ctx.mpf(0), dtype=object)
    dk = np.full((f.B, f.Sk, f.Hkv, f.D), ctx.mpf(0), dtype=object)
    dv = np.full((f.B, f.Sk, f.Hkv, f.Dv), ctx.mpf(0), dtype=object)
    d = np.zeros((f.B, f.Hq, f.Sq))
    for b in range(f.B):
        for h in range(f.Hq):
            kv, seen = f.kv_head(h), visible(f, b, h)
            for i in np.flatnonzero(seen.any(axis=1)):
                keys = np.flatnonzero(seen[i])
                q, do = mp(f.q[b, i, h]), mp(case.do[b, i, h])
                k, v = mp(f.k[b, keys, kv]), mp(f.v[b, keys, kv])
                s = [scale * ctx.fdot(q, row) for row in k]
                top = max(s)
                p = [ctx.exp(x - top) for x in s]
                total = ctx.fsum(p)
                p = [x / total for x in p]
                g = [ctx.fdot(do, row) for row in v]
                D = ctx.fdot(p, g) - (0 if case.dlse is None else ctx.mpf(case.dlse[b, h, i]))
                d[b, h, i] = float(D)
                ds = np.array([pj * (gj - D) for pj, gj in zip(p, g, strict=True)], dtype=object)
                dq[b, i, h] = scale * (ds @ k)
                dk[b, keys, kv] += scale * np.outer(ds, q)
                dv[b, keys, kv] += np.outer(np.array(p, dtype=object), do)
    as_float = np.frompyfunc(float, 1, 1)
    return {
        "dq": as_float(dq).astype(float),
        "dk": as_float(dk).astype(float),
        "dv": as_float(dv).astype(float),
        "d": d,
    }
