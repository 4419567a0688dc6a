"""Long-key cases for the backward: one or two queries over 1024 keys or more (eight K blocks or
more), where dq sums a product per key across many K blocks.

A dQ accumulated in 16 bits across the K blocks (rounded after each block's add) loses up to
half an ulp of the running sum per block. On gaussian data the running sum is of the order of
dq and its terms cancel, so that loss stays inside the bound (docs/backward.md). The
``swamped_dq`` pattern makes it systematic: a first and a last key with large, opposite V hold
the running sum large from the first block on (their terms cancel in dq; the bound grows with
their magnitude once, not once per block), and every other key adds a small term of one sign,
each block's sum near the 16-bit ulp of the running sum, so a 16-bit accumulator rounds every
block's add the same way and loses a share of each. The other draws use the plain score
distributions over as many keys.
"""

from __future__ import annotations

import numpy as np
from hypothesis import event
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.properties._strategies.scores import (
    DISTRIBUTIONS,
    BuildContext,
    Evidence,
    ScoreDistribution,
    normal,
)
from attention_crossval.properties._strategies.shapes import Shape, draw_value_dim, head_counts
from attention_crossval.properties._strategies.varlen import PLAIN
from attention_crossval.reference.case import AttentionCase, Mask, default_softmax_scale
from attention_crossval.reference.precision import cast_input

LONG_KEYS = 1024
MIN_KEY_BLOCKS = 8
# |V| of the keys between the anchors, and the anchors' weight: key 0's dq term over the sum
# of the other keys' terms is about this. Over 64 K blocks a block then adds 1/64 of the
# weight's inverse to the running sum: for bf16 (8 significant bits) weights 2..4 put that
# near the ulp, so each block's add rounds the same way; for fp16 (11 bits) 16..32 do.
_SMALL_V = 2.0**-4
_ANCHOR_WEIGHTS = {"bfloat16": (2.0, 4.0), "float16": (16.0, 32.0), "float32": (16.0, 32.0)}


def long_key_lengths(tile_n: int) -> list[int]:
    """Key counts at the K-tile edges from ``max(1024, 8 * tile_n)`` keys (rounded up to a
    whole tile): that many, one more, one short of the next tile and the next tile."""
    if isinstance(tile_n, bool) or not isinstance(tile_n, int) or tile_n < 1:
        raise ValueError(f"tile_n={tile_n!r} must be an int >= 1")
    first = -(-max(LONG_KEYS, MIN_KEY_BLOCKS * tile_n) // tile_n) * tile_n
    return sorted({first, first + 1, first + tile_n - 1, first + tile_n})


def _swamped_dq(ctx: BuildContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Key j carries a sign s_j in every coordinate of k_j and in v_j = s_j |V| (w + noise), so
    # dP_ij - D_i ~ s_j (dO_i . w) and each dS_ij k_jd has the sign of dO_i . w. Keys 0 and
    # Sk - 1 share k (equal scores, equal P) and hold v = +-A w: their dS cancel in D and their
    # dq terms cancel, while the running sum holds key 0's from the first block on.
    s, rng = ctx.shape, ctx.rng
    q = normal(rng, (s.B, s.Sq, s.Hq, s.D))
    sign = np.where(rng.random((s.B, s.Sk, s.Hkv, 1)) < 0.5, -1.0, 1.0)
    k = sign * (np.abs(normal(rng, (s.B, s.Sk, s.Hkv, s.D))) + 0.125)
    w = normal(rng, (s.B, 1, s.Hkv, s.Dv))
    v = sign * _SMALL_V * w * (1 + 0.125 * normal(rng, (s.B, s.Sk, s.Hkv, s.Dv)))
    anchor = _SMALL_V * rng.choice(_ANCHOR_WEIGHTS[ctx.dtype]) * s.Sk
    k[:, -1] = k[:, 0]
    v[:, 0], v[:, -1] = anchor * w[:, 0], -anchor * w[:, 0]
    return q, k, v


def _swamped_dq_claim(case: AttentionCase, block_n: int) -> Evidence:
    # Per batch and kv head: the anchors share k and hold opposite v; every key between them
    # has k of one sign and v . v_0 of that sign (so its dq term has the sign of dO . v_0).
    k, v = case.k.astype(np.float64), case.v.astype(np.float64)
    applicable = 0
    for b in range(case.B):
        n = case.k_length(b)
        if n < 3:
            continue
        for h in range(case.Hkv):
            kb, vb = k[b, :n, h], v[b, :n, h]
            signs = np.sign(kb[1:-1])
            along = np.sign(vb[1:-1] @ vb[0])
            if not (
                np.array_equal(kb[0], kb[-1])
                and np.array_equal(vb[0], -vb[-1])
                and (signs == signs[:, :1]).all()
                and (signs[:, 0] == along).all()
            ):
                return Evidence(applicable, f"swamped_dq: batch {b} kv head {h} breaks the signs")
            applicable += 1
    return Evidence(applicable)


SWAMPED_DQ = ScoreDistribution(
    "swamped_dq",
    "dq's running sum held large by two cancelling anchor keys while every other key adds a "
    "small term of one sign: a dQ accumulated in 16 bits across K blocks drops them",
    _swamped_dq,
    _swamped_dq_claim,
)


@st.composite
def _long_key_cases(
    draw: st.DrawFn, spec: KernelSpec, max_heads: int, max_head_dim: int
) -> AttentionCase:
    Sq = draw(st.sampled_from([1, 2]))
    Sk = draw(st.sampled_from(long_key_lengths(spec.tile_n)))
    Hq, Hkv = draw(head_counts(gqa=spec.gqa, max_heads=max_heads))
    dims = sorted(d for d in spec.head_dims if d <= max_head_dim) or [min(spec.head_dims)]
    D = draw(st.sampled_from(dims))
    shape = Shape(1, Sq, Sk, Hq, Hkv, D, draw_value_dim(draw, spec, D))
    causal = "causal" in spec.mask_kinds and draw(st.booleans())
    # Three times in four (and shrinking to it) the swamped pattern, else a plain distribution.
    swamped = draw(st.integers(0, 3)) < 3
    dist = SWAMPED_DQ if swamped else DISTRIBUTIONS[draw(st.sampled_from(PLAIN))]
    dtype = draw(st.sampled_from(sorted(spec.dtypes)))
    mask = Mask(causal=causal)
    ctx = BuildContext(
        rng=np.random.default_rng(draw(st.integers(0, 2**32 - 1))),
        shape=shape,
        dtype=dtype,
        mask=mask,
        softmax_scale=default_softmax_scale(D),
        tile_n=spec.tile_n,
        noise=0.25,
    )
    q, k, v = (cast_input(a, dtype) for a in dist.build(ctx))
    event(f"long keys: Sq={Sq} Sk={Sk} dist={dist.name}")
    label = f"dist={dist.name} dtype={dtype} long_keys=q{Sq}-k{Sk}"
    return AttentionCase(q, k, v, mask=mask, label=label)


def long_key_cases(
    *, spec: KernelSpec, max_heads: int = 2, max_head_dim: int = 64
) -> st.SearchStrategy[AttentionCase]:
    """One batch of 1 or 2 queries over :func:`long_key_lengths` keys, heads as
    :func:`head_counts` draws them (at most ``max_heads``), D at most ``max_head_dim`` where
    the spec allows, causal or not where declared, any declared dtype; scores three times in
    four from :data:`SWAMPED_DQ`, else from a plain distribution. ValueError where the spec's
    ``max_seqlen`` is below the longest length."""
    if not isinstance(spec, KernelSpec):
        raise ValueError(f"spec must be a KernelSpec, got {spec!r:.80}")
    longest = long_key_lengths(spec.tile_n)[-1]
    if spec.max_seqlen < longest:
        raise ValueError(
            f"spec.max_seqlen={spec.max_seqlen} must be >= {longest} for long-key cases"
        )
    for name, value in (("max_heads", max_heads), ("max_head_dim", max_head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    strategy = _long_key_cases(spec, max_heads, max_head_dim)
    return strategy if spec.causal_alignment is None else strategy.filter(spec.supports)
