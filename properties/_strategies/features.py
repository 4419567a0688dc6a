"""The kernel's forward surface as features of a drawn case: what ``attention_cases`` adds.

A feature is drawn only for a spec that declares it (:func:`spec_features`), and each is read
back from the finished case itself (:func:`case_features`), not from what was drawn, so a
coverage count or a sweep's claim is a property of the case the kernel got:

* ``softcap``, ``sink``: one of the named surfaces (``properties._strategies.surface``);
* ``hidden``: keys a mask hides from every query (the harness's opt-in ``hidden-nan`` check puts
  NaN there, ``kernel.hidden_nan``);
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

from attention_crossval.kernel.known_findings import surface_features
from attention_crossval.kernel.spec import KernelSpec
from attention_crossval.properties._strategies.hidden import hidden_key_cases, masked_hidden_keys
from attention_crossval.properties._strategies.paged import with_pages
from attention_crossval.properties._strategies.splits import split_choices, with_splits
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


def _on(draw: st.DrawFn, name: str, allowed: tuple[str, ...], required: frozenset[str]) -> bool:
    """Whether to add feature ``name``: always when required, else one time in four (shrinks
    to off) when allowed."""
    if name in required:
        return True
    return name in allowed and draw(st.integers(0, 3)) == 3


def add_features(
    draw: st.DrawFn,
    case: AttentionCase,
    spec: KernelSpec,
    allowed: tuple[str, ...],
    required: frozenset[str],
) -> AttentionCase:
    """``case`` with the layered features drawn: hidden keys first (they change the mask), then
    a softcap or sink surface on the final mask, then the call options."""
    if _on(draw, "hidden", allowed, required):
        case = draw(hidden_key_cases(st.just(case), spec=spec, poison=False))
    flags = {f for f in ("softcap", "sink") if _on(draw, f, allowed, required)}
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
    if _on(draw, "paged", allowed, required):
        case = with_pages(draw, case, spec.tile_n)
    if _on(draw, "splits", allowed, required):
        choices = [n for n in split_choices(case, spec.tile_n, spec.max_splits) if n > 1]
        case = with_splits(case, draw(st.sampled_from(choices)), spec.tile_n)
    if _on(draw, "packed", allowed, required):
        case = dataclasses.replace(case, layout="packed", label=f"{case.label} layout=packed")
    return case
