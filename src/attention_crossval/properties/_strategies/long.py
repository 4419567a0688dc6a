"""Long-context cases (docs/long-context.md): decode and prefill at 32k-128k keys, GQA, varlen
batches of one long sequence and short ones, and ramps that force a rescale in every K block.

Sizes come from a few tile-aware key counts between ``min_keys`` and ``max_keys`` (the edges,
one past them, the middle on a tile), so a run meets both ends of the range without drawing
every length. Inputs are built by a score distribution's vectorized builder, as every case is.
"""

from __future__ import annotations

import numpy as np
from hypothesis import event
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.properties._strategies.fp8 import drawn_inputs
from attention_crossval.properties._strategies.scores import BuildContext
from attention_crossval.properties._strategies.shapes import Shape
from attention_crossval.reference.case import (
    AttentionCase,
    Mask,
    default_softmax_scale,
    element_budget,
)

LONG_KINDS = ("decode", "prefill", "varlen", "ramp")
_PLAIN = ("gaussian", "near_ties", "last_block_spike", "large_v")  # builders needing no padding


def _keys(min_keys: int, max_keys: int, tile: int) -> list[int]:
    """Key counts: both ends, one past the low end, the middle on a tile edge."""
    middle = max(min_keys, (min_keys + max_keys) // 2 // tile * tile)
    return sorted({min_keys, min(min_keys + 1, max_keys), middle, max_keys})


@st.composite
def _long_cases(
    draw: st.DrawFn, spec: KernelSpec, kinds: tuple[str, ...], min_keys: int, max_keys: int
) -> AttentionCase:
    kind = draw(st.sampled_from(kinds))
    Sk = draw(st.sampled_from(_keys(min_keys, max_keys, spec.tile_n)))
    pairs = [(8, 2), (4, 1), (8, 8)] if spec.gqa else [(4, 4)]
    Hq, Hkv = draw(st.sampled_from(pairs))
    D = draw(st.sampled_from(sorted(d for d in spec.head_dims if d >= 3) or [min(spec.head_dims)]))
    Dv = D if spec.head_dims_v is None else draw(st.sampled_from(sorted(spec.head_dims_v)))
    causal = "causal" in spec.mask_kinds
    # batches stay inside the element budget (a K of B * Sk * Hkv * D elements)
    batch = max(1, min(5, element_budget() // (Sk * Hkv * max(D, Dv))))
    B, Sq, mask = 1, 1, Mask()
    if kind == "decode":
        B = draw(st.integers(1, min(4, batch)))
    elif kind == "prefill":
        Sq, mask = Sk, Mask(causal=causal)
    elif kind == "varlen":  # one long sequence among short ones, as a server batches them
        B = draw(st.integers(min(3, batch), batch))
        short = [draw(st.integers(0, 4 * spec.tile_n + 1)) for _ in range(B - 1)]
        long_at = draw(st.integers(0, B - 1))
        k_lengths = [*short[:long_at], Sk, *short[long_at:]]
        prefill = causal and draw(st.booleans())
        q_lengths = k_lengths if prefill else [1] * B
        Sq = max(q_lengths)
        mask = Mask(causal=prefill, q_lengths=tuple(q_lengths), k_lengths=tuple(k_lengths))
    else:  # ramp: a decode or a few rows where every K block raises the max
        Sq = draw(st.sampled_from([1, 2, 16]))
        mask = Mask(causal=causal and Sq > 1)
    name = "ramp" if kind == "ramp" else draw(st.sampled_from(_PLAIN))
    dtype = draw(st.sampled_from(sorted(spec.dtypes)))
    ctx = BuildContext(
        rng=np.random.default_rng(draw(st.integers(0, 2**32 - 1))),
        shape=Shape(B, Sq, Sk, Hq, Hkv, D, Dv),
        dtype=dtype,
        mask=mask,
        softmax_scale=default_softmax_scale(D),
        tile_n=spec.tile_n,
        noise=0.0,
    )
    inputs, descales = drawn_inputs(draw, name, ctx, spec.descales)
    event(f"long context: {kind}")
    label = f"dist={name} dtype={dtype}{descales} long={kind}-q{Sq}-k{Sk}-h{Hq}/{Hkv}"
    return AttentionCase(mask=mask, label=label, **inputs)


def long_context_cases(
    *,
    spec: KernelSpec,
    kinds: tuple[str, ...] = LONG_KINDS,
    min_keys: int = 32768,
    max_keys: int | None = None,
) -> st.SearchStrategy[AttentionCase]:
    """Long cases inside ``spec``, of ``kinds`` (:data:`LONG_KINDS`):

    * ``decode``: Sq = 1, B <= 4;
    * ``prefill``: Sq = Sk, causal where declared;
    * ``varlen``: 3 to 5 sequences, one of Sk keys, the others at most four tiles; a decode, or
      a causal prefill where declared;
    * ``ramp``: 1, 2 or 16 rows where every K block of ``spec.tile_n`` keys raises the max, so
      the streaming trace proves ``visible blocks - 1`` rescales per row (hundreds here).

    Sk is drawn from ``min_keys``..``max_keys`` (default ``min(131072, spec.max_seqlen)``), GQA
    ratios 4 and 1 where declared, batches inside the element budget. A case costs ``Sq * Sk``:
    a prefill at 128k keys is a GPU case (docs/long-context.md)."""
    if not isinstance(spec, KernelSpec):
        raise ValueError(f"spec must be a KernelSpec, got {spec!r:.80}")
    max_keys = min(131072, spec.max_seqlen) if max_keys is None else max_keys
    if not (isinstance(min_keys, int) and 1 <= min_keys <= max_keys <= spec.max_seqlen):
        raise ValueError(
            f"min_keys={min_keys!r} <= max_keys={max_keys!r} must lie in [1, spec.max_seqlen]"
        )
    unknown = set(kinds) - set(LONG_KINDS)
    if not kinds or unknown:
        raise ValueError(f"kinds={list(kinds)} must be a non-empty subset of {list(LONG_KINDS)}")
    if "varlen" in kinds and "varlen" not in spec.mask_kinds:
        raise ValueError("kinds has 'varlen' but the spec does not declare varlen masks")
    ramp_blocks = -(-max_keys // spec.tile_n)
    if "ramp" in kinds and ramp_blocks > 4096:  # the exact long ramp's limit (scores.py)
        raise ValueError(f"ramp needs max_keys <= 4096 * spec.tile_n, got {ramp_blocks} blocks")
    return _long_cases(spec, tuple(kinds), min_keys, max_keys)
