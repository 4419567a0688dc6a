"""FP8 inputs (docs/fp8.md): values quantized as real quantizers do, descales drawn honestly
and adversarially, and the creeping-max scores that trigger FA4's saturation bug.

A quantizer divides a tensor by its descale and converts to FP8 with satfinite; the case then
means attention of ``fp8 value * descale``. Descales are per (batch, kv head), float32:

* ``amax``: ``amax / fp8 max``, the per-tensor scaling of real quantizers (the group's
  largest magnitude lands on the format's largest value);
* ``amax_pow2``: the next power of two above it (quantizers that keep the scale exact);
* ``squeezed``: ``2^8`` times ``amax``'s: every value sits 8 binades below the top, many in
  the subnormals, where FP8 keeps one or two bits (adversarial);
* ``clipping``: ``2^-4`` times ``amax``'s: the largest values saturate at the FP8 maximum
  (adversarial: the case is the clipped values, as a real overflow would leave them).

``creeping_max`` (built for FP8 inputs in place of the ``ramp``, :func:`fp8_arrays`) makes
logits with std about 1 on top of a ramp whose row max rises by 1 to just under 4 log2 units
per K block over many blocks: a lazy rescale with threshold 4 keeps skipping, so P scaled by
``2^max_offset`` climbs towards ``2^(max_offset + 4)``, which FA4's constants (8 and 4, e4m3)
clamp at 448. ``tests/reference/test_fp8.py`` proves it with the streaming trace's counts of skipped
rescales and clamped P.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from hypothesis import strategies as st

from attention_crossval.properties._strategies.scores import DISTRIBUTIONS, BuildContext
from attention_crossval.properties._strategies.shapes import Shape
from attention_crossval.reference.case import FP8_DTYPES, INPUT_DTYPES
from attention_crossval.reference.precision import cast_input, fp8_max, round_to

DESCALE_KINDS = ("none", "amax", "amax_pow2", "squeezed", "clipping")
# Descale factor relative to amax / fp8 max, per kind (amax_pow2 rounds the result up to 2^k).
_DESCALE_FACTOR = {"amax": 1.0, "amax_pow2": 1.0, "squeezed": 2.0**8, "clipping": 2.0**-4}
# The lazy-rescale threshold the creeping ramp stays under (FA4's, log2 units) and its blocks.
CREEP_THRESHOLD_LOG2 = 4.0
CREEP_BLOCKS = (6, 12)


def descale_kinds(descales: bool) -> st.SearchStrategy[str]:
    """How a case's inputs are quantized: ``none`` only unless the kernel takes descales."""
    return st.sampled_from(DESCALE_KINDS if descales else ("none",))


def quantize(
    x: np.ndarray, dtype: str, kind: str, Hkv: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(values, descale)``: float64 ``x`` ``[B, S, H, X]`` quantized to FP8 ``dtype`` with
    satfinite, and its float32 ``[B, Hkv]`` descale (None for ``kind="none"``: ``x`` converted
    as it is). Query heads share their kv head's descale, as flash_attn.cute's do."""
    if dtype not in FP8_DTYPES or kind not in DESCALE_KINDS:
        raise ValueError(f"dtype={dtype!r}, kind={kind!r} must be in {FP8_DTYPES}, {DESCALE_KINDS}")
    cast = INPUT_DTYPES[dtype]
    if kind == "none":
        return round_to(x, dtype).astype(cast), None
    B, _, H, _ = x.shape
    group = H // Hkv
    with np.errstate(invalid="ignore"):  # padding may hold inf or NaN: not in the amax
        finite = np.where(np.isfinite(x), np.abs(x), 0.0)
    amax = finite.reshape(B, x.shape[1], Hkv, group, -1).max(axis=(1, 3, 4), initial=0.0)
    descale = np.where(amax > 0, amax, 1.0) / fp8_max(dtype) * _DESCALE_FACTOR.get(kind, 1.0)
    if kind == "amax_pow2":
        descale = 2.0 ** np.ceil(np.log2(descale))
    # float32's normal range: a larger amax clips at the FP8 maximum, as a quantizer's would
    descale = np.clip(descale, 2.0**-126, 2.0**127).astype(np.float32)
    per_head = np.repeat(descale.astype(np.float64), group, axis=1)[:, None, :, None]
    return round_to(x / per_head, dtype).astype(cast), descale


def fp8_arrays(dist: str, ctx: BuildContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 q, k, v of distribution ``dist`` for FP8 inputs: the ``ramp`` as
    :func:`creeping_max`, any other built as for bf16 inputs (its patterns then quantized)."""
    if dist == "ramp":  # the rescale-forcing family: for FP8, a row max creeping under 4
        return creeping_max(ctx.rng, ctx.shape, ctx.softmax_scale, ctx.tile_n)
    return DISTRIBUTIONS[dist].build(dataclasses.replace(ctx, dtype="bfloat16"))


def quantized_inputs(
    arrays: tuple[np.ndarray, ...], dtype: str, kinds: tuple[str, ...], Hkv: int
) -> dict[str, np.ndarray | None]:
    """``q``, ``k``, ``v`` and their descales (``AttentionCase`` keywords): each of
    ``arrays`` quantized by :func:`quantize` with its kind of ``kinds``."""
    fields = {}
    with np.errstate(all="ignore"):  # padding may be huge or non-finite
        for name, x, kind in zip("qkv", arrays, kinds, strict=True):
            fields[name], fields[f"{name}_descale"] = quantize(x, dtype, kind, Hkv)
    return fields


def drawn_inputs(
    draw: st.DrawFn, dist: str, ctx: BuildContext, descales: bool
) -> tuple[dict[str, np.ndarray | None], str]:
    """``AttentionCase`` keywords for distribution ``dist`` in ``ctx.dtype``, and a label part:
    16/32-bit inputs built and rounded as always (no draw, label ""); FP8 inputs from
    :func:`fp8_arrays`, quantized with a drawn kind each (``descales``: the kernel takes them)."""
    if ctx.dtype not in FP8_DTYPES:
        with np.errstate(all="ignore"):  # rounding huge/non-finite padding to 16 bits is intended
            built = DISTRIBUTIONS[dist].build(ctx)
            return {n: cast_input(a, ctx.dtype) for n, a in zip("qkv", built, strict=True)}, ""
    kinds = tuple(draw(descale_kinds(descales)) for _ in "qkv")
    fields = quantized_inputs(fp8_arrays(dist, ctx), ctx.dtype, kinds, ctx.shape.Hkv)
    return fields, f" descales={'/'.join(kinds)}"


def creeping_max(rng: np.random.Generator, shape: Shape, scale: float, block_n: int):
    """float64 q, k, v: logits ``scale q.k`` with std about 1 around a ramp rising by a drawn
    1 to 3.9 log2 units per ``block_n`` keys (module docstring); V gaussian."""
    B, Sq, Sk, Hq, Hkv, D, Dv = (
        shape.B,
        shape.Sq,
        shape.Sk,
        shape.Hq,
        shape.Hkv,
        shape.D,
        shape.Dv,
    )
    rise = rng.uniform(1.0, CREEP_THRESHOLD_LOG2 - 0.1) * math.log(2)  # natural log per block
    q = rng.standard_normal((B, Sq, Hq, D))
    k = rng.standard_normal((B, Sk, Hkv, D))
    if D > 1:  # the rest of q.k: std sqrt(D - 1) times scale ~ 1
        q[..., 1:] *= 1.0 / math.sqrt(scale * math.sqrt(D - 1))
        k[..., 1:] *= 1.0 / math.sqrt(scale * math.sqrt(D - 1))
    q[..., 0] = 1.0
    k[..., 0] = (rise * np.arange(Sk) / block_n / scale)[None, :, None]
    v = rng.standard_normal((B, Sk, Hkv, Dv))
    return q, k, v
