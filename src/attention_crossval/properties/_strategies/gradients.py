"""Upstream-gradient distributions: dO built so that the backward has a step it can get wrong.

Each distribution is one :class:`GradientDistribution` in :data:`GRADIENT_DISTRIBUTIONS`: a
builder that makes a float64 ``do [B, Sq, Hq, Dv]`` from a NumPy generator and the forward case,
the bug class it targets, and a *claim* checked on the finished (rounded) backward case, so a
distribution proves it produced what it says. Padded query rows of dO are NaN where the forward
case poisons its own q padding (``dist=nonfinite_padding``), else zero.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from attention_crossval.properties._strategies.scores import Evidence
from attention_crossval.reference.bounds import unit_roundoff
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.streaming import streaming_attention

# dO magnitude of the ``large`` family, relative to max(1, max |V|): dP = dO . v_j ~ 2^8..2^12.
_LARGE_LOG2 = (8.0, 12.0)
# ... and of the ``tiny`` family: dP ~ 2^-20..2^-14, so dS = P (dP - D) lies in fp16's subnormal
# range (below 2^-14) and a flush to zero or a 16-bit rounding of it there shows.
_TINY_LOG2 = (-20.0, -14.0)


@dataclass(frozen=True)
class GradientContext:
    """What a builder may use: a seeded generator, the forward case and its float64 O."""

    rng: np.random.Generator
    case: AttentionCase
    o: np.ndarray  # float64 [B, Sq, Hq, Dv], the streaming tier's float64 O


@dataclass(frozen=True)
class GradientDistribution:
    """A named dO family: ``build`` makes float64 dO; ``claim`` checks the backward case."""

    name: str
    targets: str
    build: Callable[[GradientContext], np.ndarray]
    claim: Callable[[BackwardCase], Evidence]


def _valid_rows(case: AttentionCase) -> np.ndarray:
    """Bool ``[B, Sq]``: query rows inside ``q_lengths``."""
    return (
        np.arange(case.Sq)[None, :] < np.array([case.q_length(b) for b in range(case.B)])[:, None]
    )


def _valid_v(case: AttentionCase, b: int, kv_head: int) -> np.ndarray:
    """float64 ``[k_length, Dv]``: the valid V rows of one batch and kv head."""
    return case.v[b, : case.k_length(b), kv_head, :].astype(np.float64)


def _v_scale(case: AttentionCase) -> np.ndarray:
    """``[B, Hq]``: ``max(1, max |v|)`` over the valid V rows each query head reads."""
    return np.array(
        [
            [max(1.0, float(np.abs(_valid_v(case, b, case.kv_head(h))).max(initial=0)))
             for h in range(case.Hq)]
            for b in range(case.B)
        ]
    )  # fmt: skip


def _gaussian(ctx: GradientContext) -> np.ndarray:
    c = ctx.case
    return ctx.rng.standard_normal((c.B, c.Sq, c.Hq, c.Dv))


def _no_claim(case: BackwardCase) -> Evidence:
    return Evidence(applicable=0)


def _scaled_magnitudes(ctx: GradientContext, log2_range: tuple[float, float]) -> np.ndarray:
    # Every element's magnitude in [m, 1.5 m) with m a power of two, m * max(1, |V|) drawn
    # per (batch, head) from 2^log2_range; random signs.
    c, rng = ctx.case, ctx.rng
    log2_m = np.round(rng.uniform(*log2_range) - np.log2(_v_scale(c)))  # [B, Hq]
    magnitude = 2.0 ** log2_m[:, None, :, None] * rng.uniform(1.0, 1.5, (c.B, c.Sq, c.Hq, c.Dv))
    return np.where(rng.random(magnitude.shape) < 0.5, -magnitude, magnitude)


def _large(ctx: GradientContext) -> np.ndarray:
    return _scaled_magnitudes(ctx, _LARGE_LOG2)


def _relative_do(case: BackwardCase) -> tuple[np.ndarray, np.ndarray]:
    """``(rows [B, Sq], |dO| * max(1, |V|) [B, Sq, Hq, Dv])`` of the rounded backward case."""
    fwd = case.forward
    return _valid_rows(fwd), np.abs(case.do.astype(np.float64)) * _v_scale(fwd)[:, None, :, None]


def _large_claim(case: BackwardCase) -> Evidence:
    rows, relative = _relative_do(case)
    small = rows[:, :, None, None] & (relative < 2.0 ** (_LARGE_LOG2[0] - 1))
    if small.any():
        where = tuple(int(i) for i in np.argwhere(small)[0])
        return Evidence(int(rows.sum()), f"large: |dO| * max(1, |V|) < 128 at do{list(where)}")
    return Evidence(int(rows.sum()) * case.forward.Hq)


def _tiny(ctx: GradientContext) -> np.ndarray:
    return _scaled_magnitudes(ctx, _TINY_LOG2)


def _tiny_claim(case: BackwardCase) -> Evidence:
    # Rounding to fp16 may flush the smallest to 0 (its subnormals end at 2^-24): allowed.
    # The drawn m * max(1, |V|) reaches 2^-13.5 (m is rounded to a power of two) and elements
    # lie in [m, 1.5 m), so up to 2^-12.9: an element above 2^-12.5 is not tiny.
    rows, relative = _relative_do(case)
    big = rows[:, :, None, None] & (relative > 2.0 ** (_TINY_LOG2[1] + 1.5))
    if big.any():
        where = tuple(int(i) for i in np.argwhere(big)[0])
        return Evidence(int(rows.sum()), f"tiny: |dO| * max(1, |V|) > 2^-12.5 at do{list(where)}")
    return Evidence(int(rows.sum()) * case.forward.Hq)


def _ones(ctx: GradientContext) -> np.ndarray:
    # Every element +1 or every element -1, one sign per (batch, head).
    c = ctx.case
    sign = ctx.rng.choice([-1.0, 1.0], size=(c.B, 1, c.Hq, 1))
    return np.broadcast_to(sign, (c.B, c.Sq, c.Hq, c.Dv)).copy()


def _ones_claim(case: BackwardCase) -> Evidence:
    rows = _valid_rows(case.forward)
    do = case.do.astype(np.float64)[rows]  # [valid rows, Hq, Dv]
    if (np.abs(do) != 1).any() or (do != do[..., :1]).any():
        return Evidence(int(rows.sum()), "ones: a dO row is not all +1 or all -1")
    return Evidence(int(do.shape[0]) * case.forward.Hq)


def _orthogonal(ctx: GradientContext) -> np.ndarray:
    # Every row of (b, h) is a multiple of the right singular vector of the valid V of its kv
    # head with the smallest singular value: orthogonal to every v_j when k_length < Dv.
    c, rng = ctx.case, ctx.rng
    do = rng.standard_normal((c.B, c.Sq, c.Hq, c.Dv))
    for b in range(c.B):
        for h in range(c.Hq):
            v = _valid_v(c, b, c.kv_head(h))
            if v.shape[0] == 0:
                continue
            # The least singular direction: every right singular vector takes full matrices
            # when there are fewer keys than Dv, and only then (a 16k-key V's U is 2 GB).
            direction = np.linalg.svd(v, full_matrices=v.shape[0] < c.Dv)[2][-1]
            do[b, :, h, :] = rng.choice([-4.0, -1.0, 1.0, 4.0], size=(c.Sq, 1)) * direction
    return do


def _orthogonal_claim(case: BackwardCase) -> Evidence:
    # Where k_length < Dv: |dO_i . v_j| <= 4 u |dO_i| |v_j| for every valid key (the rounding of
    # dO to the input dtype moves it by at most u |dO_i|), so dP ~ 0 ~ D and dS = P (dP - D)
    # is all cancellation. Elsewhere dO is the least-correlated direction (no claim).
    fwd = case.forward
    u = unit_roundoff(fwd.dtype)
    applicable = 0
    for b in range(fwd.B):
        q_len = fwd.q_length(b)
        for h in range(fwd.Hq):
            v = _valid_v(fwd, b, fwd.kv_head(h))
            if not 0 < v.shape[0] < fwd.Dv or q_len == 0:
                continue
            do = case.do[b, :q_len, h, :].astype(np.float64)
            dp = np.abs(do @ v.T)
            limit = 4 * u * np.linalg.norm(do, axis=1)[:, None] * np.linalg.norm(v, axis=1)[None]
            if (dp > limit).any():
                i, j = (int(x) for x in np.argwhere(dp > limit)[0])
                return Evidence(
                    applicable, f"orthogonal: |dO . v| = {dp[i, j]:.3g} > {limit[i, j]:.3g} at "
                    f"b={b} h={h} row={i} key={j}",
                )  # fmt: skip
            applicable += q_len
    return Evidence(applicable)


def _one_hot(ctx: GradientContext) -> np.ndarray:
    c, rng = ctx.case, ctx.rng
    hot = rng.integers(0, c.Dv, (c.B, c.Sq, c.Hq))
    do = np.zeros((c.B, c.Sq, c.Hq, c.Dv))
    np.put_along_axis(
        do, hot[..., None], rng.choice([-2.0, -1.0, 1.0, 2.0], hot.shape)[..., None], 3
    )
    return do


def _one_hot_claim(case: BackwardCase) -> Evidence:
    rows = _valid_rows(case.forward)
    nonzero = (case.do.astype(np.float64) != 0).sum(axis=-1)[rows]  # [valid rows, Hq]
    if (nonzero != 1).any():
        return Evidence(int(rows.sum()), f"one_hot: a dO row has {nonzero.max()} nonzeros")
    return Evidence(int(nonzero.size))


def _aligned(ctx: GradientContext) -> np.ndarray:
    # dO_i = a_i O_i / max|O_i|, so D_i = dO_i . O_i is as large as |dO_i| |O_i| allows and
    # dS = P (dP - D) is mostly the D term; rows with O = 0 (empty rows) stay gaussian.
    rng = ctx.rng
    peak = np.abs(ctx.o).max(axis=-1, keepdims=True)
    a = rng.choice([-4.0, -1.0, 0.5, 2.0], size=peak.shape)
    with np.errstate(all="ignore"):
        aligned = a * ctx.o / peak
    return np.where(peak > 0, aligned, _gaussian(ctx))


def _aligned_claim(case: BackwardCase) -> Evidence:
    # cos(dO_i, O_i) >= 1 - 2u where O_i != 0 (rounding dO moves it by at most u |dO_i|).
    fwd = case.forward
    o = streaming_attention(fwd).o
    do = case.do.astype(np.float64)
    rows = _valid_rows(fwd)[:, :, None] & (np.abs(o).max(axis=-1) > 0)
    do, o = do[rows], o[rows]
    cos = (do * o).sum(-1) / (np.linalg.norm(do, axis=-1) * np.linalg.norm(o, axis=-1))
    low = np.abs(cos) < 1 - 2 * unit_roundoff(fwd.dtype)
    if low.any():
        return Evidence(int(rows.sum()), f"aligned: |cos(dO, O)| = {np.abs(cos).min():.6g}")
    return Evidence(int(rows.sum()))


GRADIENT_DISTRIBUTIONS: dict[str, GradientDistribution] = {
    d.name: d
    for d in (
        GradientDistribution("gaussian", "baseline: any arithmetic slip", _gaussian, _no_claim),
        GradientDistribution(
            "large",
            "|dO| * max|V| ~ 2^8..2^12: a scale applied twice or not at all, fp16 range of dP/dS",
            _large,
            _large_claim,
        ),
        GradientDistribution(
            "tiny",
            "|dO| * max|V| ~ 2^-20..2^-14: dP and dS in fp16's subnormal range, a flush to zero "
            "or a scale applied after dS's 16-bit rounding",
            _tiny,
            _tiny_claim,
        ),
        GradientDistribution(
            "ones",
            "every dO element +-1: dP_ij is v_j's coordinate sum and dV's columns repeat, so a "
            "reduction over the wrong axis or a dO/V column slip adds up instead of averaging",
            _ones,
            _ones_claim,
        ),
        GradientDistribution(
            "orthogonal",
            "dO orthogonal to V: dP ~ D ~ 0 and dS is pure cancellation (absolute error)",
            _orthogonal,
            _orthogonal_claim,
        ),
        GradientDistribution(
            "one_hot",
            "one nonzero per dO row: a transposed or shifted dO/V column in dP and dV",
            _one_hot,
            _one_hot_claim,
        ),
        GradientDistribution(
            "aligned",
            "dO parallel to O: D is maximal, so a missing or stale D term dominates dS",
            _aligned,
            _aligned_claim,
        ),
    )
}


def build_do(dist: GradientDistribution, case: AttentionCase, seed: int) -> BackwardCase:
    """The backward case of ``case`` with dO from ``dist`` (seeded), rounded to the case's
    dtype; padded query rows of dO are NaN where the case's own q padding is non-finite
    (a kernel must read neither), else 0."""
    o = streaming_attention(case).o
    do = dist.build(GradientContext(np.random.default_rng(seed), case, o))
    poison = 0.0 if np.isfinite(case.q.astype(np.float32)).all() else np.nan
    do = np.where(_valid_rows(case)[:, :, None, None], do, poison)
    with np.errstate(all="ignore"):
        do = do.astype(case.q.dtype)
    return BackwardCase(case, do, label=f"{case.label} grad={dist.name}".strip())


def gradient_distributions(
    *, names: Collection[str] | None = None
) -> st.SearchStrategy[GradientDistribution]:
    """Entries of :data:`GRADIENT_DISTRIBUTIONS` (all, or ``names``); shrinks to ``gaussian``."""
    chosen = list(GRADIENT_DISTRIBUTIONS) if names is None else list(names)
    unknown = sorted(set(chosen) - set(GRADIENT_DISTRIBUTIONS))
    if unknown or not chosen:
        raise ValueError(
            f"names={chosen!r} must be a non-empty subset of {sorted(GRADIENT_DISTRIBUTIONS)}"
        )
    return st.sampled_from([d for n, d in GRADIENT_DISTRIBUTIONS.items() if n in chosen])


__all__ = [
    "GRADIENT_DISTRIBUTIONS",
    "GradientContext",
    "GradientDistribution",
    "build_do",
    "gradient_distributions",
]
