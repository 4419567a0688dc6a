"""Masks: causal in both alignments, sliding windows, varlen padding, explicit boolean masks.

Every mask kind is drawn where it is most likely to expose a bug: windows and lengths at tile
edges, Sq > Sk with bottom-right alignment (the first rows see nothing), zero-length sequences,
explicit masks with fully masked rows and fully masked tiles.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import MASK_KINDS
from attention_crossval.properties._strategies.shapes import Shape, tile_aware_lengths
from attention_crossval.reference.case import AttentionCase, CausalAlignment, Mask
from attention_crossval.reference.masks import empty_rows

_SHORT = {CausalAlignment.BOTTOM_RIGHT: "br", CausalAlignment.TOP_LEFT: "tl"}


def mask_class(case: AttentionCase) -> str:
    """Coverage label of ``case.mask``, e.g. ``causal(br)+window(l)+varlen+empty_rows``.

    ``empty_rows`` marks a valid (non-padding) query row that sees no key: the rows where a
    missing ``-inf`` guard produces NaN.
    """
    mask = case.mask
    parts = []
    if mask.causal:
        parts.append(f"causal({_SHORT[mask.alignment]})")
    if "window" in mask.kinds:
        sides = ("l" if mask.window_left is not None else "") + (
            "r" if mask.window_right is not None else ""
        )
        parts.append(f"window({sides},{_SHORT[mask.alignment]})")
    parts += [kind for kind in ("varlen", "explicit") if kind in mask.kinds]
    valid = (
        np.arange(case.Sq)[None, :] < np.array([case.q_length(b) for b in range(case.B)])[:, None]
    )
    if (empty_rows(case) & valid[:, None, :]).any():
        parts.append("empty_rows")
    return "+".join(parts) or "none"


def _window_sizes(tile: int) -> st.SearchStrategy[int]:
    """Window widths at tile edges (0, 1, tile/2, tile-1, tile, tile+1) or anything small."""
    edges = sorted({0, 1, max(tile // 2, 1), max(tile - 1, 0), tile, tile + 1})
    return st.one_of(st.sampled_from(edges), st.integers(0, 3 * tile))


def _explicit_mask(seed: int, shape: Shape, tile_m: int, tile_n: int, per_head: bool) -> np.ndarray:
    """Random visibility with whole rows, whole key columns and one whole tile masked out."""
    rng = np.random.default_rng(seed)
    heads = shape.Hq if per_head else 1
    dims = (shape.B, heads, shape.Sq, shape.Sk)
    explicit = rng.random(dims) < rng.choice([0.3, 0.7, 0.95])
    for b in range(shape.B):
        for h in range(heads):
            explicit[b, h, rng.integers(0, shape.Sq, size=max(1, shape.Sq // 4)), :] = False
            explicit[b, h, :, rng.integers(0, shape.Sk, size=max(1, shape.Sk // 8))] = False
            m0 = tile_m * rng.integers(0, -(-shape.Sq // tile_m))
            n0 = tile_n * rng.integers(0, -(-shape.Sk // tile_n))
            explicit[b, h, m0 : m0 + tile_m, n0 : n0 + tile_n] = False
    return explicit


@st.composite
def _masks(
    draw: st.DrawFn,
    shape: Shape,
    kinds: frozenset[str],
    alignments: tuple[CausalAlignment, ...],
    kernel_alignment: CausalAlignment | None,
    tile_m: int,
    tile_n: int,
    key_padding: bool,
    required: frozenset[str],
) -> Mask:
    # A required kind skips its coin flip, so draws without requirements are unchanged.
    if required & {"causal", "window"}:
        base = "causal" if "causal" in required else "window"
    else:
        base = draw(st.sampled_from(["none", *sorted(kinds & {"causal", "window"})]))
    causal = base == "causal"
    left = right = None
    if base == "window" or (
        causal and "window" in kinds and ("window" in required or draw(st.booleans()))
    ):
        sides = draw(st.sampled_from(["left", "right", "both"]))
        left = draw(_window_sizes(tile_n)) if sides in ("left", "both") else None
        right = draw(_window_sizes(tile_n)) if sides in ("right", "both") else None
    q_lengths = k_lengths = None
    if key_padding or ("varlen" in kinds and ("varlen" in required or draw(st.booleans()))):
        which = draw(st.sampled_from(["both", "keys", "queries"]))
        if which != "keys":
            q_len = tile_aware_lengths(tile=tile_m, max_len=shape.Sq)
            q_lengths = draw(st.lists(q_len, min_size=shape.B, max_size=shape.B))
        if which != "queries" or key_padding:
            k_len = tile_aware_lengths(tile=tile_n, max_len=shape.Sk)
            k_lengths = draw(st.lists(k_len, min_size=shape.B, max_size=shape.B))
            if key_padding:  # the case model allows non-finite values only in padding
                k_lengths[0] = min(k_lengths[0], shape.Sk - 1)
    explicit = None
    if "explicit" in kinds and ("explicit" in required or draw(st.integers(0, 3)) == 0):
        seed = draw(st.integers(0, 2**32 - 1))
        explicit = _explicit_mask(seed, shape, tile_m, tile_n, per_head=draw(st.booleans()))
    alignment = draw(st.sampled_from(alignments))
    if kernel_alignment is not None and alignment is not kernel_alignment:
        qs = q_lengths or [shape.Sq] * shape.B
        ks = k_lengths or [shape.Sk] * shape.B
        if any(q != k for q, k in zip(qs, ks, strict=True)):
            alignment = kernel_alignment  # the kernel's diagonal differs here: not its contract
    return Mask(
        causal=causal,
        window_left=left,
        window_right=right,
        alignment=alignment,
        q_lengths=None if q_lengths is None else tuple(q_lengths),
        k_lengths=None if k_lengths is None else tuple(k_lengths),
        explicit=explicit,
    )


def masks(
    *,
    shape: Shape,
    kinds: Collection[str] = MASK_KINDS,
    alignments: Collection[CausalAlignment] = tuple(CausalAlignment),
    kernel_alignment: CausalAlignment | None = None,
    tile_m: int = 128,
    tile_n: int = 128,
    key_padding: bool = False,
    required: Collection[str] = (),
) -> st.SearchStrategy[Mask]:
    """Masks for ``shape`` using only ``kinds`` (subset of {causal, window, varlen, explicit}).

    * none, causal, or a window (left only, right only, both; widths at tile edges); causal
      may carry a window too. Both ``alignments`` are drawn; with ``kernel_alignment`` set, the
      other one only where every batch has equal valid q and k lengths (both diagonals agree).
    * varlen: per-batch ``q_lengths`` / ``k_lengths`` around tile multiples, zero included.
    * explicit: random visibility with fully masked rows, key columns and one fully masked tile.
    * ``key_padding=True`` forces ``k_lengths[0] < Sk`` so padding exists (for NaN/Inf there).
    * ``required``: kinds every mask uses (a subset of ``kinds``), e.g. for a coverage sweep.

    Bug classes: causal off by one, wrong alignment, window bounds, empty rows (NaN from
    ``-inf - -inf``), padding read, masks applied per tile. Shrinks to no mask.
    """
    if not isinstance(shape, Shape):
        raise ValueError(f"shape must be a Shape, got {type(shape).__name__}")
    kinds = frozenset(kinds)
    if not kinds <= MASK_KINDS:
        raise ValueError(f"kinds={sorted(kinds)} must be a subset of {sorted(MASK_KINDS)}")
    alignments = tuple(alignments)
    if not alignments or not all(isinstance(a, CausalAlignment) for a in alignments):
        raise ValueError(f"alignments={alignments!r} must be a non-empty list of CausalAlignment")
    for name, value in (("tile_m", tile_m), ("tile_n", tile_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if key_padding and (shape.Sk < 1 or "varlen" not in kinds):
        raise ValueError("key_padding=True needs Sk >= 1 and 'varlen' in kinds")
    required = frozenset(required)
    if not required <= kinds:
        raise ValueError(f"required={sorted(required)} must be a subset of kinds={sorted(kinds)}")
    return _masks(shape, kinds, alignments, kernel_alignment, tile_m, tile_n, key_padding, required)
