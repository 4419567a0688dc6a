"""Score distributions: q, k, v built so that ``q . k`` has a pattern a kernel can get wrong.

Each distribution is one :class:`ScoreDistribution` in :data:`DISTRIBUTIONS`: a builder that
makes float64 q, k, v from a NumPy generator (never element by element:
docs/numerics.md#drawing-inputs), the bug class it targets, and a *claim* checked on the finished
case (and, for the ones about rescaling, on the streaming tier's
:class:`~reference.streaming.RescaleTrace`), so a distribution proves it produced what it
says. Patterns go in coordinate 0 of q and k with ``q0 = 1`` and ``k0 = logit / softmax_scale``;
other coordinates carry optional noise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from attention_crossval.properties._strategies.shapes import Shape
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.masks import visible_all

_FP16_MAX = 65504.0
# ln of the subnormal range of P's dtype ([smallest subnormal / 2, smallest normal)): P there
# loses bits or flushes to zero; fp32 (no P rounding) underflows in exp2 itself.
_SUBNORMAL_LOG = {
    "float16": (-24 * math.log(2), -14 * math.log(2)),
    "other": (-149 * math.log(2), -126 * math.log(2)),
}


@dataclass(frozen=True)
class BuildContext:
    """What a builder may use: a seeded generator, the shape, dtype, mask and scale."""

    rng: np.random.Generator
    shape: Shape
    dtype: str
    mask: Mask
    softmax_scale: float
    tile_n: int
    noise: float


@dataclass(frozen=True)
class Evidence:
    """Outcome of a claim: rows (or examples) it applied to, and the violation if any."""

    applicable: int
    failure: str | None = None


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class ScoreDistribution:
    """A named input family: ``build`` makes float64 q, k, v; ``claim(case, block_n)`` checks
    the case; ``trace_claim(case, trace, block_n)`` (optional) checks the streaming tier's
    :class:`~reference.streaming.RescaleTrace` run with K blocks of ``block_n``."""

    name: str
    targets: str
    build: Callable[[BuildContext], Arrays]
    claim: Callable[[AttentionCase, int], Evidence]
    trace_claim: Callable[[AttentionCase, object, int], Evidence] | None = None
    needs_key_padding: bool = False


def scaled_scores(case: AttentionCase) -> tuple[np.ndarray, np.ndarray]:
    """``(logits, seen)``: float64 ``softmax_scale * q . k`` as ``[B, Hq, Sq, Sk]`` with -inf
    where not visible, and the visibility. Padding (possibly NaN) never reaches the logits."""
    q = case.q.astype(np.float64)
    k = np.repeat(case.k.astype(np.float64), case.group_size, axis=2)
    seen = visible_all(case)
    with np.errstate(all="ignore"):
        logits = np.einsum("bihd,bjhd->bhij", q, k) * case.softmax_scale
    return np.where(seen, logits, -np.inf), seen


# Arrays up to this many elements are drawn directly from the case's generator, in float64:
# every recipe outside the gpu-long and gpu-huge presets keeps its values. Above, one thread drew
# float64 at ~45 M/s: 16.5 s for the 128k x 8 decode batch (K and V of 2^28 elements, target
# 20 s for the whole check); the gpu-long and gpu-huge presets' values changed when it came down
# from 2^28.
DIRECT_ELEMENTS = 1 << 24
_NORMAL_CHUNK = 1 << 24  # elements per spawned stream beyond it


def normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal values of ``shape``. Up to :data:`DIRECT_ELEMENTS`: float64 from
    ``rng``. Beyond (the long and huge presets' tensors): float32, in chunks
    of 2^24 drawn on threads from streams spawned off ``rng``, so the values depend on the
    recipe alone (not on the thread count), at a fraction of the time and half the memory."""
    count = math.prod(shape)
    if count <= DIRECT_ELEMENTS:
        return rng.standard_normal(shape)
    out = np.empty(count, np.float32)
    starts = range(0, count, _NORMAL_CHUNK)
    streams = rng.spawn(len(starts))

    def fill(index: int) -> None:
        chunk = out[starts[index] : starts[index] + _NORMAL_CHUNK]
        streams[index].standard_normal(dtype=np.float32, out=chunk)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the generators release the GIL
        list(pool.map(fill, range(len(starts))))
    return out.reshape(shape)


def _block_ids(case: AttentionCase, block_n: int) -> np.ndarray:
    return np.arange(case.Sk) // block_n


# A pattern that states the logit margin its claim relies on keeps the noise's logits (their
# standard deviation: softmax_scale * noise * sqrt(D - 1)) this many times below it.
NOISE_SIGMAS_PER_MARGIN = 12.0


def _pattern(
    ctx: BuildContext,
    k0: np.ndarray,
    *,
    noisy_scores: bool = True,
    margin: float | None = None,
) -> Arrays:
    """q, k, v with ``q0 = 1``, ``k[..., 0] = k0`` (``[B, Sk, Hkv]``); other coordinates of q
    random, of k ``noise``-scaled random (0 when ``noisy_scores`` is False); v standard normal.
    ``margin`` is the smallest gap of logits the builder's claim relies on: the noise is scaled
    down, where it must be, to a standard deviation :data:`NOISE_SIGMAS_PER_MARGIN` times below
    it, so that it never reorders the keys the claim ranks (found when a spike of 16 lost to a
    noisy key at scale 1, noise 1, D = 16, and a masked key 2.5 above a visible one to the
    noise, under two CI seeds; logits 20 below the sentinel crossed it at D = 128).
    Noise-free recipes draw the same values."""
    s, rng = ctx.shape, ctx.rng
    q = normal(rng, (s.B, s.Sq, s.Hq, s.D))
    scale, shape = (ctx.noise if noisy_scores else 0.0), (s.B, s.Sk, s.Hkv, s.D)
    if scale and margin is not None:
        sigma = ctx.softmax_scale * scale * math.sqrt(max(s.D - 1, 1))
        scale *= min(1.0, margin / (NOISE_SIGMAS_PER_MARGIN * sigma))
    if scale or math.prod(shape) <= DIRECT_ELEMENTS:
        k = normal(rng, shape) * scale
    else:  # a huge K without noise: no draw to multiply by zero (no recipe before drew one)
        k = np.zeros(shape, np.float32)
    q[..., 0] = 1.0
    k[..., 0] = k0
    return q, k, normal(rng, (s.B, s.Sk, s.Hkv, s.Dv))


def _per_key(ctx: BuildContext, logits: np.ndarray) -> np.ndarray:
    """Broadcast a per-key logit row ``[Sk]`` (or ``[B, Sk]``) to ``k0 [B, Sk, Hkv]``."""
    s = ctx.shape
    logits = np.broadcast_to(logits, (s.B, s.Sk))
    return np.repeat((logits / ctx.softmax_scale)[:, :, None], s.Hkv, axis=2)


def _power_of_two(x: float) -> float:
    return 2.0 ** round(math.log2(x))


# --- builders and claims, one family at a time ---------------------------------------------


def _gaussian(ctx: BuildContext) -> Arrays:
    s, rng = ctx.shape, ctx.rng
    sigma = rng.choice([0.5, 1.0, 2.0, 4.0])  # a power of two: exact in place, in float32 too
    q, k = normal(rng, (s.B, s.Sq, s.Hq, s.D)), normal(rng, (s.B, s.Sk, s.Hkv, s.D))
    q *= sigma  # in place: a float64 sigma would promote a float32 draw to a float64 copy
    k *= sigma
    return q, k, normal(rng, (s.B, s.Sk, s.Hkv, s.Dv))


def _no_claim(case: AttentionCase, block_n: int) -> Evidence:
    return Evidence(applicable=0)


def _ramp_k0(ctx: BuildContext, descending: bool) -> np.ndarray:
    # k0 = step * (block + 0.5 * position_in_block / tile_n): every key of block n+1 exceeds
    # every key of block n even after rounding (step a power of two, <= 64 blocks).
    j = np.arange(ctx.shape.Sk)
    blocks = -(-ctx.shape.Sk // ctx.tile_n)
    span = ctx.rng.uniform(4.0, 40.0)  # logits from first to last block
    step = _power_of_two(span / (blocks * ctx.softmax_scale))
    position = j % ctx.tile_n if not descending else ctx.tile_n - 1 - j % ctx.tile_n
    block = j // ctx.tile_n if not descending else blocks - 1 - j // ctx.tile_n
    return np.broadcast_to(
        step * (block + 0.5 * position / ctx.tile_n), (ctx.shape.B, ctx.shape.Sk)
    )


def _ramp(ctx: BuildContext) -> Arrays:
    blocks = -(-ctx.shape.Sk // ctx.tile_n)
    if _RAMP_BLOCKS < blocks <= _LONG_RAMP_BLOCKS and ctx.shape.D >= 3:
        return _long_ramp(ctx)
    k0 = np.repeat(_ramp_k0(ctx, descending=False)[:, :, None], ctx.shape.Hkv, axis=2)
    return _pattern(ctx, k0, noisy_scores=False)


_RAMP_BLOCKS = 64  # one key coordinate holds the ramp exactly up to this many blocks
_LONG_RAMP_BLOCKS = 4096  # three coordinates: 16 a + b + position, a < 256 (8 bf16 bits)


def _long_ramp(ctx: BuildContext) -> Arrays:
    """The ramp past 64 blocks (long contexts: hundreds of rescales on one row). One 16-bit key
    coordinate cannot hold ``block + position`` exactly beyond 8 significant bits, so the
    logit is split over three: ``k0 = 16 a step``, ``k1 = b step``, ``k2 = step position /
    (2 tile_n)`` with ``block = 16 a + b`` and ``q0 = q1 = q2 = 1``; each part has <= 8
    significant bits and their sum <= 20, so the scores are exact in float32 in any order and
    every block's keys exceed every earlier block's. A block raises the max by about 0.25 to
    1 (natural-log units), so each visible block after the first is a rescale. Needs D >= 3
    and at most 4096 blocks; other shapes keep the one-coordinate ramp."""
    s, rng = ctx.shape, ctx.rng
    step = _power_of_two(rng.uniform(0.25, 1.0) / ctx.softmax_scale)
    j = np.arange(s.Sk)
    block, position = j // ctx.tile_n, j % ctx.tile_n
    q = normal(rng, (s.B, s.Sq, s.Hq, s.D))
    k = np.zeros((s.B, s.Sk, s.Hkv, s.D))
    q[..., :3] = 1.0
    for axis, part in enumerate((16 * (block // 16), block % 16, position / (2 * ctx.tile_n))):
        k[..., axis] = (step * part)[None, :, None]
    return q, k, normal(rng, (s.B, s.Sk, s.Hkv, s.Dv))


def _descending(ctx: BuildContext) -> Arrays:
    k0 = np.repeat(_ramp_k0(ctx, descending=True)[:, :, None], ctx.shape.Hkv, axis=2)
    return _pattern(ctx, k0, noisy_scores=False)


def _block_maxima(case: AttentionCase, block_n: int) -> np.ndarray:
    """``[B, Hq, Sq, n_blocks]`` max visible logit per K block (-inf where none)."""
    logits, _ = scaled_scores(case)
    blocks = _block_ids(case, block_n)
    n_blocks = int(blocks[-1]) + 1 if case.Sk else 0
    return np.stack([logits[..., blocks == n].max(axis=-1) for n in range(n_blocks)], axis=-1)


def _ramp_claim(case: AttentionCase, block_n: int) -> Evidence:
    maxima = _block_maxima(case, block_n)
    running = np.maximum.accumulate(maxima, axis=-1)
    seen = maxima > -np.inf
    later = seen & (np.arange(maxima.shape[-1]) > np.argmax(seen, axis=-1)[..., None])
    stale = later & (maxima <= np.concatenate([running[..., :1], running[..., :-1]], axis=-1))
    rows = int((seen.sum(axis=-1) >= 2).sum())
    if stale.any():
        where = tuple(int(i) for i in np.argwhere(stale)[0])
        return Evidence(rows, f"ramp: block {where[-1]} of row {where[:-1]} sets no new max")
    return Evidence(rows)


def _ramp_trace_claim(case: AttentionCase, trace, block_n: int) -> Evidence:
    needed = np.maximum(trace.visible_blocks - 1, 0)
    short = trace.rescales < needed
    rows = int((needed > 0).sum())
    if short.any():
        where = tuple(int(i) for i in np.argwhere(short)[0])
        return Evidence(
            rows,
            f"ramp: row {where} rescaled {trace.rescales[where]} times over "
            f"{trace.visible_blocks[where]} visible blocks (needs >= visible_blocks - 1)",
        )
    return Evidence(rows)


def _descending_claim(case: AttentionCase, block_n: int) -> Evidence:
    maxima = _block_maxima(case, block_n)
    seen = maxima > -np.inf
    first = np.take_along_axis(maxima, np.argmax(seen, axis=-1)[..., None], axis=-1)[..., 0]
    rows = int((seen.sum(axis=-1) >= 2).sum())
    if (maxima > first[..., None]).any():
        return Evidence(rows, "descending: a later block exceeds the row's first visible block")
    return Evidence(rows)


def _descending_trace_claim(case: AttentionCase, trace, block_n: int) -> Evidence:
    rows = int((trace.visible_blocks >= 2).sum())
    if trace.rescales.any():
        return Evidence(rows, f"descending: {int(trace.rescales.sum())} rescales, expected 0")
    return Evidence(rows)


def _huge(ctx: BuildContext) -> Arrays:
    # |S| up to D * 2^16 for fp16 inputs (elements <= 255 so each product stays finite in fp16
    # terms), logits far past exp's overflow at 88.7 (fp32) and 11.1 (fp16).
    s, rng = ctx.shape, ctx.rng
    limit = 255.0 if ctx.dtype == "float16" else 2.0**12
    a = min(limit, math.sqrt(rng.uniform(200.0, 2e4) / (ctx.softmax_scale * math.sqrt(s.D))))
    q = np.clip(normal(rng, (s.B, s.Sq, s.Hq, s.D)) * a, -limit, limit)
    k = np.clip(normal(rng, (s.B, s.Sk, s.Hkv, s.D)) * a, -limit, limit)
    q[..., 0] = np.where(q[..., 0] >= 0, limit, -limit)
    k[..., 0] = limit * rng.choice([-1.0, 1.0], size=k[..., 0].shape)
    return q, k, normal(rng, (s.B, s.Sk, s.Hkv, s.Dv))


def _huge_claim(case: AttentionCase, block_n: int) -> Evidence:
    logits, seen = scaled_scores(case)
    if not seen.any():
        return Evidence(0)
    largest = float(np.abs(np.where(seen, logits, 0)).max())
    if largest <= 88.8:
        return Evidence(1, f"huge: largest |logit| {largest:.3g} does not overflow fp32 exp")
    return Evidence(1)


_SENTINELS = (-1e3, -1e4, -5e4, -1e5)
# The derived bound's exp2-argument error grows like |logit| (gamma_D(2^-23) + 2^-22) (fp32 MMA
# and score rounding, reference/bounds.py): a sentinel is drawn only while that stays <= this,
# so the O bound stays well below V's range and can see masked keys weighted like visible ones.
_SENTINEL_EXP_ERROR = 0.05


def _sentinels_for(D: int) -> tuple[float, ...]:
    """The sentinels whose logits (x 1.02, + 20) keep the bound non-vacuous at head dim ``D``
    (-1e3 always: up to D ~ 400)."""
    per_logit = D * 2.0**-23 / (1 - D * 2.0**-23) + 2.0**-22
    fit = tuple(x for x in _SENTINELS if (1.02 * -x + 20) * per_logit <= _SENTINEL_EXP_ERROR)
    return fit or _SENTINELS[:1]


def _below_sentinel(ctx: BuildContext) -> Arrays:
    # logit = -c * k0 * scale = sentinel * 1.02 - spread: below the sentinel after rounding.
    s, rng = ctx.shape, ctx.rng
    sentinel = rng.choice(_sentinels_for(s.D))
    logits = sentinel * 1.02 - rng.uniform(0.0, 20.0, size=(s.B, s.Sk))
    c = _power_of_two(max(1.0, 2.0 * abs(logits).max() / (ctx.softmax_scale * 4e4)))
    margin = _SENTINELS[0] - logits.max()  # below the claim's threshold (at least 20)
    q, k, v = _pattern(ctx, -_per_key(ctx, logits) / c, margin=margin)
    q[..., 0] = -c
    return q, k, v


def _below_sentinel_claim(case: AttentionCase, block_n: int) -> Evidence:
    logits, seen = scaled_scores(case)
    top = float(logits.max()) if seen.any() else -np.inf
    if top >= _SENTINELS[0]:
        return Evidence(
            int(seen.any()), f"below_sentinel: a visible logit {top:.6g} >= {_SENTINELS[0]:g}"
        )
    return Evidence(int(seen.any()))


def _near_ties(ctx: BuildContext) -> Arrays:
    # Background logits in [0, 30]; tie keys (0, 1 and a few more) at 40 + 0.1 t. The 0.1 t
    # goes in coordinate 1 so 16-bit rounding of the large part cannot erase it.
    s, rng = ctx.shape, ctx.rng
    background = rng.uniform(0.0, 30.0, size=(s.B, s.Sk))
    ties = np.zeros((s.B, s.Sk))
    chosen = np.unique(np.r_[0, 1, rng.integers(0, s.Sk, size=3)])
    chosen = chosen[chosen < s.Sk]
    background[:, chosen] = 40.0
    ties[:, chosen] = 0.1 * rng.permutation(len(chosen))
    if s.D == 1:
        return _pattern(ctx, _per_key(ctx, background + ties), noisy_scores=False)
    q, k, v = _pattern(ctx, _per_key(ctx, background), noisy_scores=False)
    q[..., 1] = 1.0
    k[..., 1] = _per_key(ctx, ties)
    return q, k, v


def _near_ties_claim(case: AttentionCase, block_n: int) -> Evidence:
    # Only tie keys reach 35; a row seeing two of them must see a gap of at most ~0.1-0.5.
    logits, _ = scaled_scores(case)
    if case.Sk < 2:
        return Evidence(0)
    top2 = -np.sort(-logits, axis=-1)[..., :2]
    rows = top2[..., 1] >= 35
    if (rows & (top2[..., 0] - np.where(rows, top2[..., 1], 0) > 0.5)).any():
        return Evidence(int(rows.sum()), "near_ties: top-2 logits >= 35 differ by > 0.5")
    return Evidence(int(rows.sum()))


def _spike_positions(case_or_shape, mask: Mask) -> np.ndarray:
    """The spike key per batch: the last valid key (in the last K block)."""
    Sk, B = case_or_shape.Sk, case_or_shape.B
    lengths = mask.k_lengths or (Sk,) * B
    return np.array([max(n - 1, 0) for n in lengths])


def _last_block_spike(ctx: BuildContext) -> Arrays:
    s, rng = ctx.shape, ctx.rng
    logits = normal(rng, (s.B, s.Sk)) * 2.0
    spike = rng.uniform(15.0, 60.0)
    margin = spike - logits.max()  # over the spike's rivals in every batch
    logits[np.arange(s.B), _spike_positions(s, ctx.mask)] = spike
    return _pattern(ctx, _per_key(ctx, logits), margin=max(margin, 1.0))  # 1: a floor only


def _spike_rows(case: AttentionCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    logits, seen = scaled_scores(case)
    spike = _spike_positions(case, case.mask)
    b = np.arange(case.B)
    sees = seen[b, :, :, spike]  # [B, Hq, Sq]
    return logits, sees, spike


def _spike_claim(case: AttentionCase, block_n: int) -> Evidence:
    logits, sees, spike = _spike_rows(case)
    argmax = logits.argmax(axis=-1)
    wrong = sees & (argmax != spike[:, None, None])
    if wrong.any():
        return Evidence(int(sees.sum()), "last_block_spike: the spike is not the row's max")
    return Evidence(int(sees.sum()))


def _spike_trace_claim(case: AttentionCase, trace, block_n: int) -> Evidence:
    maxima = _block_maxima(case, block_n)
    seen = maxima > -np.inf
    _, sees, spike = _spike_rows(case)
    later = sees & (np.argmax(seen, axis=-1) < (spike // block_n)[:, None, None])
    if (later & (trace.rescales < 1)).any():
        return Evidence(int(later.sum()), "last_block_spike: spike seen late but no rescale")
    return Evidence(int(later.sum()))


def _constant(ctx: BuildContext) -> Arrays:
    s, rng = ctx.shape, ctx.rng
    q = normal(rng, (s.B, s.Sq, s.Hq, s.D)) * rng.choice([0.5, 4.0])
    k = np.repeat(normal(rng, (s.B, 1, s.Hkv, s.D)), s.Sk, axis=1)  # identical keys
    return q, k, normal(rng, (s.B, s.Sk, s.Hkv, s.Dv))


def _span_per_row(case: AttentionCase) -> tuple[np.ndarray, np.ndarray]:
    logits, seen = scaled_scores(case)
    low = np.where(seen, logits, np.inf).min(axis=-1)
    rows = seen.sum(axis=-1) >= 2
    return np.where(rows, logits.max(axis=-1) - low, 0.0), rows


def _constant_claim(case: AttentionCase, block_n: int) -> Evidence:
    span, rows = _span_per_row(case)
    if span.max(initial=0.0) != 0:
        return Evidence(int(rows.sum()), f"constant: a row's logits span {span.max():.3g}")
    return Evidence(int(rows.sum()))


def _tiny_variance(ctx: BuildContext) -> Arrays:
    # Identical keys except coordinate 0, which moves by a few ulps of 1: logits differ by
    # ~1e-3, where the softmax is nearly uniform and rounding of S dominates.
    s, rng = ctx.shape, ctx.rng
    ulp = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}[ctx.dtype]
    q, k, v = _constant(ctx)
    q[..., 0] = 1.0
    k[..., 0] = 1.0 + ulp * rng.integers(0, 4, size=(s.B, s.Sk, s.Hkv))
    return q, k, v


def _tiny_variance_claim(case: AttentionCase, block_n: int) -> Evidence:
    span, rows = _span_per_row(case)
    if span.max(initial=0.0) > 0.05:
        return Evidence(int(rows.sum()), f"tiny_variance: a row's logits span {span.max():.3g}")
    return Evidence(int(rows.sum()))


def _large_v(ctx: BuildContext) -> Arrays:
    q, k, v = _gaussian(ctx)
    offset = ctx.rng.choice([-1.0, 1.0]) * ctx.rng.choice([1e2, 1e3, 1e4])
    return q, k, offset * (1.0 + 0.01 * v)


def _valid_v(case: AttentionCase) -> np.ndarray:
    lengths = np.array([case.k_length(b) for b in range(case.B)])
    valid = np.arange(case.Sk)[None, :] < lengths[:, None]
    return case.v.astype(np.float64)[valid]


def _large_v_claim(case: AttentionCase, block_n: int) -> Evidence:
    v = _valid_v(case)
    if v.size and np.abs(v).min() < 50:
        return Evidence(1, f"large_v: min |v| {np.abs(v).min():.3g} < 50")
    return Evidence(int(v.size > 0))


def _cancelling_v(ctx: BuildContext) -> Arrays:
    # v = +-M with the sign alternating along the keys: any two adjacent keys cancel.
    q, k, v = _gaussian(ctx)
    magnitude = ctx.rng.choice([1e2, 1e3, 1e4])
    alternating = (-1.0) ** np.arange(ctx.shape.Sk)[None, :, None, None]
    return q * 0.25, k * 0.25, magnitude * alternating * np.where(v[:, :1] < 0, -1.0, 1.0)


def _cancelling_v_claim(case: AttentionCase, block_n: int) -> Evidence:
    v = case.v.astype(np.float64)
    lengths = [case.k_length(b) for b in range(case.B)]
    cancel = [b for b, n in enumerate(lengths) if n >= 2]
    for b in cancel:
        valid = v[b, : lengths[b]]
        if (
            np.abs(valid).min() < 50
            or not ((valid.min(axis=0) < 0) & (valid.max(axis=0) > 0)).all()
        ):
            return Evidence(len(cancel), f"cancelling_v: batch {b} has |v| < 50 or one sign")
    return Evidence(len(cancel))


def _subnormal_band(dtype: str) -> tuple[float, float]:
    return _SUBNORMAL_LOG["float16" if dtype == "float16" else "other"]


def _subnormal_p(ctx: BuildContext) -> Arrays:
    # Anchor keys (every 4th, and key 0) at logit 0 hold the max; the rest sit in the band
    # where p = exp(logit - max) is subnormal in P's dtype.
    s, rng = ctx.shape, ctx.rng
    low, high = _subnormal_band(ctx.dtype)
    logits = rng.uniform(low + 0.5, high - 0.5, size=(s.B, s.Sk))
    logits[:, ::4] = 0.0
    return _pattern(ctx, _per_key(ctx, logits), noisy_scores=False)


def _subnormal_p_claim(case: AttentionCase, block_n: int) -> Evidence:
    # Rows whose max is an anchor (logit 0): every other visible p must be in the band.
    logits, seen = scaled_scores(case)
    low, high = _subnormal_band(case.dtype)
    anchored = logits.max(axis=-1, keepdims=True) == 0
    others = seen & anchored & (logits < 0)
    outside = others & ((logits < low - 0.7) | (logits >= high))
    rows = int(others.any(axis=-1).sum())
    if outside.any():
        return Evidence(rows, "subnormal_p: a visible p < 1 lies outside the subnormal range")
    return Evidence(rows)


def _mask_bait(ctx: BuildContext) -> Arrays:
    # Keys a leaking mask would let in get the largest logits: a ramp towards the restricted
    # side (right for causal / right windows / padding, left for left-only windows; the other
    # way when that leaves no row with a masked key above its visible ones, as a narrow window
    # on both sides can) plus a huge logit on keys no row may see (padding, masked columns).
    s, rng = ctx.shape, ctx.rng
    mask = ctx.mask
    zeros = [np.zeros((s.B, n, h, 1), np.float32) for n, h in ((s.Sq, s.Hq), (s.Sk, s.Hkv))]
    seen = visible_all(AttentionCase(zeros[0], zeros[1], zeros[1], mask=mask))  # [B,Hq,Sq,Sk]
    ramp = rng.uniform(20.0, 60.0) * np.arange(s.Sk) / max(s.Sk - 1, 1)
    step = ramp[1] if s.Sk > 1 else 1.0  # between neighbouring keys: the smallest gap ranked
    toward_right = mask.causal or mask.window_right is not None or mask.window_left is None
    candidates = (ramp, ramp[::-1]) if toward_right else (ramp[::-1], ramp)
    chosen = next((r for r in candidates if _outranks(r, seen)), candidates[0])
    logits = np.broadcast_to(chosen, (s.B, s.Sk)).copy()
    logits[~seen.any(axis=(1, 2))] += rng.uniform(40.0, 80.0)
    return _pattern(ctx, _per_key(ctx, logits), margin=step)


def _outranks(per_key: np.ndarray, seen: np.ndarray) -> bool:
    """Some row sees a key and has a masked key with a larger ``per_key`` logit."""
    logits = np.broadcast_to(per_key, seen.shape)
    hidden = np.where(~seen, logits, -np.inf).max(axis=-1)
    shown = np.where(seen, logits, -np.inf).max(axis=-1)
    return bool(((hidden > shown) & (shown > -np.inf)).any())


def _mask_bait_claim(case: AttentionCase, block_n: int) -> Evidence:
    _, seen = scaled_scores(case)
    q = case.q.astype(np.float64)
    k = np.repeat(case.k.astype(np.float64), case.group_size, axis=2)
    with np.errstate(all="ignore"):
        raw = np.einsum("bihd,bjhd->bhij", q, k) * case.softmax_scale
    hidden = np.where(~seen & np.isfinite(raw), raw, -np.inf).max(axis=-1)
    shown = np.where(seen, raw, -np.inf).max(axis=-1)
    rows = (hidden > -np.inf) & (shown > -np.inf)
    if rows.any() and not (rows & (hidden > shown)).any():
        return Evidence(int(rows.sum()), "mask_bait: no masked key outranks the visible ones")
    return Evidence(int(rows.sum()))


def _nonfinite_padding(ctx: BuildContext) -> Arrays:
    q, k, v = _gaussian(ctx)
    poison = np.array([np.nan, np.inf, -np.inf])
    for b, n in enumerate(ctx.mask.k_lengths or ()):
        k[b, n:] = ctx.rng.choice(poison, size=k[b, n:].shape)
        v[b, n:] = ctx.rng.choice(poison, size=v[b, n:].shape)
    for b, n in enumerate(ctx.mask.q_lengths or ()):
        q[b, n:] = np.nan
    return q, k, v


def _nonfinite_padding_claim(case: AttentionCase, block_n: int) -> Evidence:
    bad = (
        ~np.isfinite(case.k.astype(np.float32)).all()
        or ~np.isfinite(case.v.astype(np.float32)).all()
    )
    return Evidence(1, None if bad else "nonfinite_padding: padding holds no NaN/Inf")


DISTRIBUTIONS: dict[str, ScoreDistribution] = {
    d.name: d
    for d in (
        ScoreDistribution("gaussian", "baseline: any arithmetic slip", _gaussian, _no_claim),
        ScoreDistribution(
            "ramp",
            "a new row max in every K block: missed O or row_sum rescale, max init",
            _ramp,
            _ramp_claim,
            _ramp_trace_claim,
        ),
        ScoreDistribution(
            "descending",
            "max in the first block: rescale applied when it must not be",
            _descending,
            _descending_claim,
            _descending_trace_claim,
        ),
        ScoreDistribution(
            "huge",
            "|S| near 16-bit limits, logits past exp overflow: no max subtraction",
            _huge,
            _huge_claim,
        ),
        ScoreDistribution(
            "below_sentinel",
            "every logit below -5e4: finite 'masked' sentinels win, max=0 init",
            _below_sentinel,
            _below_sentinel_claim,
        ),
        ScoreDistribution(
            "near_ties",
            "large near-equal logits (gap ~0.1 at ~40): max selection, S rounding",
            _near_ties,
            _near_ties_claim,
        ),
        ScoreDistribution(
            "last_block_spike",
            "one dominant key in the last (partial) block: late rescale, tail",
            _last_block_spike,
            _spike_claim,
            _spike_trace_claim,
        ),
        ScoreDistribution(
            "constant", "equal scores: O = mean(V), normalisation", _constant, _constant_claim
        ),
        ScoreDistribution(
            "tiny_variance",
            "logits ~1e-3 apart: S rounding dominates",
            _tiny_variance,
            _tiny_variance_claim,
        ),
        ScoreDistribution(
            "large_v",
            "V ~ 1e2..1e4 with small spread: relative error in O",
            _large_v,
            _large_v_claim,
        ),
        ScoreDistribution(
            "cancelling_v",
            "V = +-M: O cancels, absolute error vs |V|",
            _cancelling_v,
            _cancelling_v_claim,
        ),
        ScoreDistribution(
            "subnormal_p",
            "P in the subnormal range of its dtype: flush-to-zero, P rounding",
            _subnormal_p,
            _subnormal_p_claim,
        ),
        ScoreDistribution(
            "mask_bait",
            "masked keys hold the largest logits: any mask leak dominates O",
            _mask_bait,
            _mask_bait_claim,
        ),
        ScoreDistribution(
            "nonfinite_padding",
            "NaN/Inf in padded K/V (and Q rows): padding read, NaN leak",
            _nonfinite_padding,
            _nonfinite_padding_claim,
            needs_key_padding=True,
        ),
    )
}


def score_distributions(
    *, names: Collection[str] | None = None
) -> st.SearchStrategy[ScoreDistribution]:
    """Entries of :data:`DISTRIBUTIONS` (all, or ``names``); shrinks towards ``gaussian``."""
    chosen = list(DISTRIBUTIONS) if names is None else list(names)
    unknown = sorted(set(chosen) - set(DISTRIBUTIONS))
    if unknown or not chosen:
        raise ValueError(f"names={chosen!r} must be a non-empty subset of {sorted(DISTRIBUTIONS)}")
    return st.sampled_from([DISTRIBUTIONS[n] for n in DISTRIBUTIONS if n in chosen])


__all__ = [
    "DISTRIBUTIONS",
    "BuildContext",
    "Evidence",
    "ScoreDistribution",
    "scaled_scores",
    "score_distributions",
]
