"""The kernel's forward surface as features of a drawn case: what ``attention_cases`` adds.

A feature is drawn only for a spec that declares it (:func:`spec_features`), and each is read
back from the finished case itself (:func:`case_features`), not from what was drawn, so a
coverage count or a sweep's claim is a property of the case the kernel got:

* ``softcap``, ``sink``: one of the named surfaces (``properties._strategies.surface``);
* ``hidden``: keys a mask hides from every query (the harness's opt-in ``hidden-nan`` check puts
  NaN there, ``kernel.harness.hidden_nan``);
* ``paged``, ``splits``, ``packed``: the call options ``page_size``, ``num_splits > 1`` and
  ``layout="packed"``;
* ``varlen_batch``: 3 or more sequences, one with no keys (sometimes one query per sequence), D
  at most 64 where declared (``properties._strategies.varlen``);
* ``long_decode``: at most 16 queries over 4096 keys or more, with GQA where declared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np
from hypothesis import assume, event
from hypothesis import strategies as st

from attention_crossval.kernel.contract.known_findings import surface_features
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.properties._strategies.hidden import hidden_key_cases, masked_hidden_keys
from attention_crossval.properties._strategies.paged import with_pages
from attention_crossval.properties._strategies.splits import draw_num_splits, with_splits
from attention_crossval.properties._strategies.surface import SURFACES, declared_features
from attention_crossval.reference.case import AttentionCase

FEATURES = (
    "softcap",
    "sink",
    "hidden",
    "paged",
    "splits",
    "packed",
    "varlen_batch",
    "long_decode",
)
BASES = ("varlen_batch", "long_decode")  # features that are a different base case
LONG_DECODE_KEYS = 4096
# Masks that reliably hide keys from every query (a bottom-right causal mask never does: its last
# row sees every key).
_HIDING = frozenset({"window", "explicit"})


def spec_features(spec: KernelSpec) -> tuple[str, ...]:
    """The features ``spec`` declares, in :data:`FEATURES` order."""
    has = {
        "hidden": bool(spec.mask_kinds & _HIDING),
        "varlen_batch": "varlen" in spec.mask_kinds,
        "long_decode": spec.max_seqlen >= LONG_DECODE_KEYS,
    }
    return tuple(name for name in FEATURES if has.get(name, name in spec.surface_features))


def case_features(case: AttentionCase) -> frozenset[str]:
    """The features ``case`` has (module docstring), read from its fields and mask."""
    k_lengths = [case.k_length(b) for b in range(case.B)]
    found = {
        "hidden": bool(masked_hidden_keys(case).any()),
        "varlen_batch": case.B >= 3 and "varlen" in case.mask.kinds and 0 in k_lengths,
        "long_decode": case.Sq <= 16 and case.Sk >= LONG_DECODE_KEYS,
    }
    return surface_features(case) | {name for name, present in found.items() if present}


def check_features(spec: KernelSpec, names: Collection[str], what: str) -> tuple[str, ...]:
    """``names`` as a tuple, ValueError unless each is a feature ``spec`` declares."""
    names = tuple(names)
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise ValueError(f"{what}={unknown} must be names from {list(FEATURES)}")
    undeclared = [n for n in names if n not in spec_features(spec)]
    if undeclared:
        raise ValueError(
            f"{what}={undeclared} are not declared by spec {spec.name!r} "
            f"(it declares {list(spec_features(spec))})"
        )
    return names


def long_decode_options(spec: KernelSpec) -> dict[str, int]:
    """``long_decode_cases`` options for ``spec``: a CPU kernel gets 4096 or 4097 keys, at most
    2 queries and 4 query heads, D at most 16 (about 1 s a case under the harness, most of it
    the exact tier's 4 rows); a GPU kernel up to 16k keys, 16 queries, D <= 64."""
    if spec.device == "cpu":
        return {
            "max_keys": LONG_DECODE_KEYS + 1,
            "max_head_dim": 16,
            "max_queries": 2,
            "max_heads": 4,
        }
    return {"max_head_dim": 64}


def _on(
    draw: st.DrawFn,
    name: str,
    allowed: tuple[str, ...],
    required: frozenset[str],
    chance: tuple[int, int] = (1, 4),
) -> bool:
    """Whether to add feature ``name``: always when required, else with ``chance`` = (hits,
    out of) when allowed. Hypothesis draws (and shrinks to) the integer 0 more often than one
    time in ``out of``, so 0 stands for the likelier side: off up to one in two, on above."""
    if name in required:
        return True
    hits, out_of = chance
    if name not in allowed:
        return False
    value = draw(st.integers(0, out_of - 1))
    return value < hits if 2 * hits > out_of else value >= out_of - hits


def _chance(name: str, case: AttentionCase, tile_n: int, splits: bool) -> tuple[int, int]:
    """How often optional feature ``name`` is drawn. Split-KV seven cases in eight on GQA with
    several kv heads (the split path must map heads as the plain loop does), three in four over
    two K blocks or more (a split then has keys of its own), else one in two; a sink three in
    four next to splits (counted once per row, not per split); a page table one in two (call
    options leave the case's values alone); the rest one in four."""
    if name == "splits":
        if 1 < case.Hkv < case.Hq:
            return (7, 8)
        return (3, 4) if max(case.k_length(b) for b in range(case.B)) > tile_n else (1, 2)
    if name == "paged":
        return (1, 2)
    return (1, 2) if name == "sink" and splits else (1, 4)


def add_features(
    draw: st.DrawFn,
    case: AttentionCase,
    spec: KernelSpec,
    allowed: tuple[str, ...],
    required: frozenset[str],
) -> AttentionCase:
    """``case`` with the layered features drawn: hidden keys first (they change the mask),
    whether to split, then a softcap or sink surface on the final mask, then the call options
    (how often: :func:`_chance`)."""

    def on(name: str, splits: bool = False) -> bool:
        return _on(draw, name, allowed, required, _chance(name, case, spec.tile_n, splits))

    if on("hidden"):
        case = draw(hidden_key_cases(st.just(case), spec=spec, poison=False))
    splits = on("splits")
    flags = {f for f in ("softcap", "sink") if on(f, splits)}
    if flags:
        names = [
            n
            for n, s in SURFACES.items()
            if s.needs <= flags
            and s.needs <= declared_features(spec)
            and s.needs >= (flags & required)
        ]
        assume(names)  # softcap and sink both required: only softcap+sink
        surface = SURFACES[draw(st.sampled_from(names))]
        with np.errstate(all="ignore"):  # padding may hold NaN: it never reaches the logits
            case = surface.build(draw, case)
        event(f"surface: {surface.name}")
        case = dataclasses.replace(case, label=f"{case.label} surface={surface.name}")
    if on("paged"):
        case = with_pages(draw, case, spec.tile_n)
    if splits:
        num_splits = draw_num_splits(draw, case, spec.tile_n, spec.max_splits)
        case = with_splits(case, num_splits, spec.tile_n)
    if on("packed"):
        case = dataclasses.replace(case, layout="packed", label=f"{case.label} layout=packed")
    return case
