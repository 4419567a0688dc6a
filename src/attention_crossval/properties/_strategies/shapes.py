"""Shapes: lengths that cluster where tiled kernels break, head layouts, head dims.

Lengths are drawn around the kernel's own tiles (``k * tile + {-1, 0, +1}``, half-tile residues,
1, below one tile), because masks and partial blocks fail at block edges, not in the middle.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec


@dataclass(frozen=True)
class Shape:
    """The layout letters of one case (see the glossary in ``reference``)."""

    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int
    Dv: int


def length_class(n: int, tile: int) -> str:
    """Where ``n`` sits relative to ``tile``: the bug class a length of this kind exercises.

    ``zero``, ``one``, ``sub_tile`` (one partial block), ``tile_multiple`` (no partial block),
    ``tile+1`` / ``tile-1`` (a one-element partial block or one missing), ``half_tile``
    (residue tile/2), ``other``.
    """
    if n <= 1:
        return ("zero", "one")[n]
    if n < tile:
        return "sub_tile"
    residue = n % tile
    if residue == 0:
        return "tile_multiple"
    if residue == 1:
        return "tile+1"
    if residue == tile - 1:
        return "tile-1"
    if residue == tile // 2:
        return "half_tile"
    return "other"


def shape_class(shape: Shape, tile_n: int) -> str:
    """``<Sq vs Sk>:<class of Sk>``, e.g. ``sq>sk:tile+1`` or ``decode:sub_tile``."""
    if shape.Sq == 1:
        relation = "decode"
    else:
        relation = "sq<sk" if shape.Sq < shape.Sk else "sq>sk" if shape.Sq > shape.Sk else "sq=sk"
    return f"{relation}:{length_class(shape.Sk, tile_n)}"


def _tile_lengths(tile: int, min_len: int, max_len: int) -> list[int]:
    """Sorted candidates 0, 1, 2, tile/2, and k*tile + {-1, 0, +1, tile/2} up to ``max_len``."""
    candidates = {0, 1, 2, tile // 2, max_len}
    for k in range(1, max_len // tile + 2):
        candidates.update({k * tile - 1, k * tile, k * tile + 1, k * tile + tile // 2})
    return sorted(n for n in candidates if min_len <= n <= max_len)


def tile_aware_lengths(*, tile: int, max_len: int, min_len: int = 0) -> st.SearchStrategy[int]:
    """Sequence lengths in ``[min_len, max_len]`` clustered around multiples of ``tile``.

    Mostly ``k * tile + {-1, 0, 1}``, half-tile residues, 1 and 2 (bug class: partial last
    blocks, off-by-one block counts, masks at block edges); sometimes any length. Shrinks
    towards ``min_len``.
    """
    for name, value in (("tile", tile), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if isinstance(min_len, bool) or not isinstance(min_len, int) or not 0 <= min_len <= max_len:
        raise ValueError(f"min_len={min_len!r} must be an int in [0, max_len={max_len}]")
    edges = st.sampled_from(_tile_lengths(tile, min_len, max_len))
    anything = st.integers(min_len, max_len)
    return st.integers(0, 3).flatmap(lambda r: anything if r == 0 else edges)  # 3/4 at edges


def head_counts(*, gqa: bool, max_heads: int = 4) -> st.SearchStrategy[tuple[int, int]]:
    """``(Hq, Hkv)``: MHA (Hq == Hkv), and with ``gqa`` also GQA (1 < Hkv < Hq) and MQA
    (Hkv == 1 < Hq). The layout is drawn first, GQA with several kv heads twice as often as
    each other one: only there do ``h // (Hq / Hkv)``, ``h % Hkv``, ``h`` and 0 all differ.
    Bug class: query head h reading the wrong kv head. Shrinks to (1, 1)."""
    if isinstance(max_heads, bool) or not isinstance(max_heads, int) or max_heads < 1:
        raise ValueError(f"max_heads={max_heads!r} must be an int >= 1")
    grouped = [(hq, hkv) for hq in range(2, max_heads + 1) for hkv in range(1, hq) if hq % hkv == 0]
    several = [pair for pair in grouped if pair[1] > 1]
    layouts = [[(h, h) for h in range(1, max_heads + 1)]]
    if gqa:
        layouts += [several, several, [pair for pair in grouped if pair[1] == 1]]
    layouts = [pairs for pairs in layouts if pairs]
    # Two plain integers, not a flatmap, so each shrinks on its own (towards (1, 1)).
    within = st.integers(0, math.lcm(*(len(pairs) for pairs in layouts)) - 1)
    return st.tuples(st.integers(0, len(layouts) - 1), within).map(
        lambda drawn: layouts[drawn[0]][drawn[1] % len(layouts[drawn[0]])]
    )


def draw_value_dim(draw: st.DrawFn, spec: KernelSpec, D: int) -> int:
    """Dv for head dim ``D``: one of ``spec.value_dims_for(D)`` (a declared pair where the spec
    names pairs), drawn only when there is a choice, so a spec with Dv = D draws nothing."""
    dims_v = spec.value_dims_for(D)
    return dims_v[0] if len(dims_v) == 1 else draw(st.sampled_from(dims_v))


@st.composite
def _shapes(
    draw: st.DrawFn,
    spec: KernelSpec,
    max_len: int,
    max_batch: int,
    max_heads: int,
    head_dims: tuple[int, ...],
) -> Shape:
    lengths = tile_aware_lengths(tile=spec.tile_n, max_len=max_len, min_len=1)
    Sk = draw(lengths)
    # Sq around tile_m, or deliberately just above / below Sk (bottom-right alignment edges).
    q_lengths = tile_aware_lengths(tile=spec.tile_m, max_len=max_len, min_len=1)
    near_sk = st.sampled_from([n for n in (Sk - 1, Sk, Sk + 1) if 1 <= n <= max_len])
    Sq = draw(st.one_of(q_lengths, near_sk))
    Hq, Hkv = draw(head_counts(gqa=spec.gqa, max_heads=max_heads))
    D = draw(st.sampled_from(head_dims))
    Dv = draw_value_dim(draw, spec, D)
    B = draw(st.integers(1, max_batch))
    return Shape(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv)


def attention_shapes(
    *,
    spec: KernelSpec,
    max_len: int,
    max_batch: int = 2,
    max_heads: int = 4,
    head_dims: Collection[int] | None = None,
) -> st.SearchStrategy[Shape]:
    """Shapes inside ``spec``: Sq and Sk tile-aware (Sq also Sk +- 1 and 1 = decode), Hq/Hkv
    per :func:`head_counts`, D from ``head_dims`` (default ``spec.head_dims``), Dv from those
    declared with it (:func:`draw_value_dim`). Shrinks to B=1, Sq=Sk=1, Hq=Hkv=1, smallest D."""
    if not isinstance(spec, KernelSpec):
        raise ValueError(f"spec must be a KernelSpec, got {type(spec).__name__}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len={max_len!r} must be an int >= 1")
    if max_len > spec.max_seqlen:
        raise ValueError(f"max_len={max_len} must not exceed spec.max_seqlen={spec.max_seqlen}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r} must be an int >= 1")
    dims = spec.head_dims if head_dims is None else frozenset(head_dims)
    if not dims or not dims <= spec.head_dims:
        raise ValueError(
            f"head_dims={sorted(dims)} must be a non-empty subset of spec.head_dims="
            f"{sorted(spec.head_dims)}"
        )
    head_counts(gqa=spec.gqa, max_heads=max_heads)  # validates max_heads now, not at draw time
    return _shapes(spec, max_len, max_batch, max_heads, tuple(sorted(dims)))
