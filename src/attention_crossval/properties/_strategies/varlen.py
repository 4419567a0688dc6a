"""Varlen batches beyond two sequences, and long decode: the shapes of reported offset bugs.

:func:`varlen_batches` draws 3 or more sequences with a zero key length among them (packed varlen
offset overruns need sequences on both sides of an empty one), optionally as a decode batch of
one query per sequence. :func:`long_decode_cases` draws few queries (<= 16) over many keys (from
``min_keys`` up to the kernel's ``max_seqlen``) with GQA where the kernel has it: the split-KV
decode path. Both build q, k, v with a score distribution's builder (by default one of
:data:`PLAIN`; a sweep hands its own), and take ``causal`` True to force the causal mask (a
sweep that requires it; False: never).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
from hypothesis import event
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.properties._strategies.fp8 import drawn_inputs
from attention_crossval.properties._strategies.scores import DISTRIBUTIONS, BuildContext
from attention_crossval.properties._strategies.shapes import (
    Shape,
    draw_value_dim,
    head_counts,
    tile_aware_lengths,
)
from attention_crossval.reference.case import AttentionCase, Mask, default_softmax_scale

PLAIN = ("gaussian", "ramp", "near_ties", "large_v")  # builders that need no key padding


def _build(
    draw: st.DrawFn,
    spec: KernelSpec,
    shape: Shape,
    mask: Mask,
    label: str,
    distributions: tuple[str, ...],
) -> AttentionCase:
    """q, k, v from a drawn distribution of ``distributions``, dtype and seed."""
    dist = DISTRIBUTIONS[draw(st.sampled_from(distributions))]
    dtype = draw(st.sampled_from(sorted(spec.dtypes)))
    ctx = BuildContext(
        rng=np.random.default_rng(draw(st.integers(0, 2**32 - 1))),
        shape=shape,
        dtype=dtype,
        mask=mask,
        softmax_scale=default_softmax_scale(shape.D),
        tile_n=spec.tile_n,
        noise=draw(st.sampled_from([0.0, 0.25, 1.0])),
    )
    inputs, descales = drawn_inputs(draw, dist.name, ctx, spec.descales)
    label = f"dist={dist.name} dtype={dtype}{descales} {label}"
    return AttentionCase(mask=mask, label=label, **inputs)


def _causal(draw: st.DrawFn, spec: KernelSpec, causal: bool | None) -> bool:
    """The causal flag: ``causal`` where given (True / False), else drawn where the spec
    declares it."""
    if causal is not None:
        return causal
    return "causal" in spec.mask_kinds and draw(st.booleans())


def _check_options(
    spec: KernelSpec, distributions: Collection[str], causal: bool | None, padded: bool
) -> tuple[str, ...]:
    """``distributions`` as a tuple, ValueError unless they are known score distributions
    (needing key padding only where ``padded``) and ``causal`` is declared when forced."""
    names = tuple(distributions)
    allowed = [n for n, d in DISTRIBUTIONS.items() if padded or not d.needs_key_padding]
    if not names or not set(names) <= set(allowed):
        raise ValueError(f"distributions={list(names)} must be a non-empty subset of {allowed}")
    if causal and "causal" not in spec.mask_kinds:
        raise ValueError(f"causal=True needs 'causal' in spec.mask_kinds={sorted(spec.mask_kinds)}")
    return names


def _head_dims(draw: st.DrawFn, spec: KernelSpec, max_head_dim: int) -> tuple[int, int]:
    dims = sorted(d for d in spec.head_dims if d <= max_head_dim) or [min(spec.head_dims)]
    D = draw(st.sampled_from(dims))
    return D, draw_value_dim(draw, spec, D)


@st.composite
def _varlen_batches(
    draw: st.DrawFn,
    spec: KernelSpec,
    min_batch: int,
    max_batch: int,
    max_len: int,
    decode: bool | None,
    max_head_dim: int,
    distributions: tuple[str, ...],
    causal: bool | None,
) -> AttentionCase:
    B = draw(st.integers(min_batch, max_batch))
    lengths = tile_aware_lengths(tile=spec.tile_n, max_len=max_len, min_len=0)
    k_lengths = [draw(lengths) for _ in range(B)]
    k_lengths[draw(st.integers(0, B - 1))] = 0  # an empty sequence between others
    is_decode = draw(st.booleans()) if decode is None else decode
    if is_decode:  # one query per sequence (none for an empty sequence, as a packed batch has)
        q_lengths = [1 if n else draw(st.integers(0, 1)) for n in k_lengths]
    else:
        q_lengths = [draw(lengths) for _ in range(B)]
    Hq, Hkv = draw(head_counts(gqa=spec.gqa, max_heads=4))
    D, Dv = _head_dims(draw, spec, max_head_dim)
    shape = Shape(B, max(1, max(q_lengths)), max(1, max(k_lengths)), Hq, Hkv, D, Dv)
    mask = Mask(
        causal=_causal(draw, spec, causal), q_lengths=tuple(q_lengths), k_lengths=tuple(k_lengths)
    )
    event(f"varlen batch: B={B}{' decode' if is_decode else ''}")
    label = f"varlen_batch=B{B}{'-decode' if is_decode else ''}"
    return _build(draw, spec, shape, mask, label, distributions)


def varlen_batches(
    *,
    spec: KernelSpec,
    min_batch: int = 3,
    max_batch: int = 5,
    max_len: int | None = None,
    decode: bool | None = None,
    max_head_dim: int = 64,
    distributions: Collection[str] = PLAIN,
    causal: bool | None = None,
) -> st.SearchStrategy[AttentionCase]:
    """Varlen cases of ``min_batch``..``max_batch`` sequences (``spec`` must declare varlen),
    one with no keys; ``decode`` True/False forces one query per sequence or not (None: both).
    Lengths are tile-aware up to ``max_len`` (default ``4 * spec.tile_n + 1``); D is at most
    ``max_head_dim`` where the spec allows; scores from ``distributions`` (any score
    distribution: the batch has padding); ``causal`` True / False forces the causal mask on or
    off (None: drawn)."""
    if not isinstance(spec, KernelSpec) or "varlen" not in spec.mask_kinds:
        raise ValueError(f"spec must be a KernelSpec declaring 'varlen', got {spec!r:.80}")
    if not (isinstance(min_batch, int) and isinstance(max_batch, int) and 1 <= min_batch):
        raise ValueError(f"min_batch={min_batch!r}, max_batch={max_batch!r} must be ints >= 1")
    if max_batch < min_batch:
        raise ValueError(f"max_batch={max_batch} must be >= min_batch={min_batch}")
    max_len = min(4 * spec.tile_n + 1, spec.max_seqlen) if max_len is None else max_len
    if not (isinstance(max_len, int) and 1 <= max_len <= spec.max_seqlen):
        raise ValueError(f"max_len={max_len!r} must be an int in [1, spec.max_seqlen]")
    names = _check_options(spec, distributions, causal, padded=True)
    return _varlen_batches(
        spec, min_batch, max_batch, max_len, decode, max_head_dim, names, causal
    )  # fmt: skip


@st.composite
def _long_decode(
    draw: st.DrawFn,
    spec: KernelSpec,
    min_keys: int,
    max_keys: int,
    max_head_dim: int,
    max_queries: int,
    max_heads: int,
    distributions: tuple[str, ...],
    causal: bool | None,
) -> AttentionCase:
    Sq = draw(st.sampled_from([n for n in (1, 1, 2, 16) if n <= max_queries]))
    keys = {min_keys, min_keys + 1, max_keys, (min_keys + max_keys) // 2}
    Sk = draw(st.sampled_from(sorted(n for n in keys if n <= max_keys)))
    pairs = [(hq, hkv) for hq, hkv in [(4, 1), (8, 2), (2, 1)] if spec.gqa and hq <= max_heads]
    pairs = pairs or [(2, 2)]
    Hq, Hkv = draw(st.sampled_from(pairs))
    D, Dv = _head_dims(draw, spec, max_head_dim)
    mask = Mask(causal=_causal(draw, spec, causal))
    shape = Shape(1, Sq, Sk, Hq, Hkv, D, Dv)
    event(f"long decode: Sq={Sq} Sk={Sk} Hq/Hkv={Hq // Hkv}")
    return _build(draw, spec, shape, mask, f"long_decode=q{Sq}-k{Sk}", distributions)


def long_decode_cases(
    *,
    spec: KernelSpec,
    min_keys: int = 4096,
    max_keys: int | None = None,
    max_head_dim: int = 64,
    max_queries: int = 16,
    max_heads: int = 8,
    distributions: Collection[str] = PLAIN,
    causal: bool | None = None,
) -> st.SearchStrategy[AttentionCase]:
    """One batch of Sq in {1, 2, 16} queries (at most ``max_queries``) over
    ``min_keys``..``max_keys`` keys (default up to ``spec.max_seqlen``, at least 16k where it
    allows), GQA ratios 2 and 4 where declared (at most ``max_heads`` query heads), D at most
    ``max_head_dim`` where the spec allows; scores from ``distributions`` (none that needs key
    padding), ``causal`` as for :func:`varlen_batches`. The cost grows with the keys only."""
    max_keys = min(spec.max_seqlen, max(16384, min_keys)) if max_keys is None else max_keys
    if not (isinstance(min_keys, int) and 1 <= min_keys <= max_keys <= spec.max_seqlen):
        raise ValueError(
            f"min_keys={min_keys!r} <= max_keys={max_keys!r} must lie in [1, spec.max_seqlen]"
        )
    for name, value in (("max_queries", max_queries), ("max_heads", max_heads)):
        if not isinstance(value, int) or value < 2:
            raise ValueError(f"{name}={value!r} must be an int >= 2")
    names = _check_options(spec, distributions, causal, padded=False)
    return _long_decode(
        spec, min_keys, max_keys, max_head_dim, max_queries, max_heads, names, causal
    )  # fmt: skip
