"""Forward-surface options drawn on top of a case: softcap and learnable sinks.

:func:`surface_cases` takes cases from a base strategy (``attention_cases``) and adds one of the
named :data:`SURFACES` that the kernel's spec declares (``spec.softcap``, ``spec.sink``). Each
surface states the bug class it targets and a claim checked on the finished case (as the score
distributions do), so "the sink dominates" is proved on every case, not hoped for. The case's
label gains ``surface=<name>``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
from hypothesis import event
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.properties._strategies.scores import Evidence, scaled_scores
from attention_crossval.reference.case import AttentionCase

# |y| >= 4 puts tanh(y) within 7e-4 of +-1: such logits are within 1.4e-3 cap of each other.
SATURATION = 4.0
_CAPS = (0.5, 5.0, 30.0, 50.0)  # 30 and 50: the caps of published models (final, attention)


def surface_logits(case: AttentionCase) -> tuple[np.ndarray, np.ndarray]:
    """``(logits, seen)``: float64 ``[B, Hq, Sq, Sk]`` logits as the softmax sees them (scaled,
    then capped when ``case.softcap`` is set), -inf where not visible."""
    logits, seen = scaled_scores(case)
    if case.softcap is not None:
        logits = np.where(seen, case.softcap * np.tanh(logits / case.softcap), -np.inf)
    return logits, seen


@dataclass(frozen=True)
class Surface:
    """A named forward-surface option: ``build(draw, case)`` returns the case with it set;
    ``claim(case)`` checks the finished case; ``needs`` are the spec flags it requires."""

    name: str
    targets: str
    needs: frozenset[str]
    build: Callable[[st.DrawFn, AttentionCase], AttentionCase]
    claim: Callable[[AttentionCase], Evidence]


def _visible_extremes(case: AttentionCase) -> tuple[np.ndarray, np.ndarray]:
    """Per query head, the largest and smallest visible logit (NaN for a head that sees none)."""
    logits, seen = surface_logits(case)
    any_seen = seen.any(axis=(0, 2, 3))
    top = np.where(seen, logits, -np.inf).max(axis=(0, 2, 3))
    low = np.where(seen, logits, np.inf).min(axis=(0, 2, 3))
    return np.where(any_seen, top, np.nan), np.where(any_seen, low, np.nan)


def _sink(values: np.ndarray, direction: float = 0.0) -> np.ndarray:
    """``values`` as float32, rounded towards ``direction`` (+inf: never below, -inf: never
    above, 0: nearest), so a margin promised in float64 survives the rounding."""
    rounded = np.asarray(values, dtype=np.float32)
    if direction:
        off = rounded < values if direction > 0 else rounded > values
        rounded = np.where(off, np.nextafter(rounded, np.float32(direction)), rounded)
    return rounded.astype(np.float32)


def _with_cap(draw: st.DrawFn, case: AttentionCase) -> AttentionCase:
    # A published cap, or one at the logits' own scale, where tanh bends (a cap far above
    # every logit is the identity, and then where the scale enters does not show).
    logits, seen = scaled_scores(case)
    top = float(np.abs(logits[seen]).max(initial=0.0))
    if top > 2.0**-20 and draw(st.booleans()):
        cap = 2.0 ** round(math.log2(top)) * draw(st.sampled_from([0.25, 0.5, 1.0]))
    else:
        cap = draw(st.sampled_from(_CAPS))
    return dataclasses.replace(case, softcap=cap)


def _no_claim(case: AttentionCase) -> Evidence:
    return Evidence(applicable=0)


def _saturated(draw: st.DrawFn, case: AttentionCase) -> AttentionCase:
    # The cap: a power of two at most median|logit| / (2 SATURATION), so at least half the
    # visible logits sit beyond SATURATION caps: they all saturate to near-ties at +-cap.
    logits, seen = scaled_scores(case)
    magnitudes = np.abs(logits[seen])
    median = float(np.median(magnitudes)) if magnitudes.size else 0.0
    if median <= 2.0**-20:  # nothing (or nothing measurable) to saturate: a plain small cap
        return dataclasses.replace(case, softcap=0.5)
    cap = 2.0 ** math.floor(math.log2(median / (2 * SATURATION)))
    return dataclasses.replace(case, softcap=cap * draw(st.sampled_from([1.0, 0.25, 2.0**-6])))


def _saturated_claim(case: AttentionCase) -> Evidence:
    logits, seen = scaled_scores(case)
    y = np.abs(logits[seen]) / case.softcap
    if not y.size or np.median(np.abs(logits[seen])) <= 2.0**-20:
        return Evidence(0)
    share = float((y >= SATURATION).mean())
    if share < 0.5:
        return Evidence(1, f"softcap_saturated: only {share:.0%} of visible logits saturate")
    return Evidence(1)


def _competing_sink(draw: st.DrawFn, case: AttentionCase) -> AttentionCase:
    # Around the head's own logits, so the sink takes a real share of the denominator.
    top, low = _visible_extremes(case)
    spread = np.where(np.isnan(top), 1.0, np.maximum(top - low, 1.0))
    middle = np.where(np.isnan(top), 0.0, (top + low) / 2)
    offsets = np.array(draw(st.lists(st.floats(-1, 1), min_size=case.Hq, max_size=case.Hq)))
    return dataclasses.replace(case, sink=_sink(middle + offsets * spread))


def _dominant_sink(draw: st.DrawFn, case: AttentionCase) -> AttentionCase:
    top, _ = _visible_extremes(case)
    # Past 88.7 above the max, exp(sink - max) overflows float32 (past 709.8, float64): a
    # kernel that adds the sink outside its running max returns inf (flash-attn-cute on the
    # H200, docs/results-h200.md). A third of the draws overflow float32 only, a third float64 too.
    margin = draw(st.one_of(st.floats(20, 80), st.floats(89, 700), st.floats(710, 1000)))
    sink = _sink(np.where(np.isnan(top), 0.0, top) + margin, np.inf)
    return dataclasses.replace(case, sink=sink)


def _dominant_claim(case: AttentionCase) -> Evidence:
    # Every visible logit at least 20 below the sink: each weight < e^-20 of the sink's, so
    # |O| <= Sk e^-20 max|v| and LSE - sink < Sk e^-20 (O ~ 0, LSE ~ sink).
    logits, seen = surface_logits(case)
    gap = case.sink[None, :, None, None] - logits
    if not seen.any():
        return Evidence(0)
    if (gap[seen] < 20 - 1e-3).any():
        return Evidence(1, f"sink_dominant: a logit within {gap[seen].min():.3g} of the sink")
    return Evidence(1)


def _low_sink(draw: st.DrawFn, case: AttentionCase) -> AttentionCase:
    _, low = _visible_extremes(case)
    # Half the draws within 4 of the lowest logit, where the sink's weight (e^-4 of that
    # key's or more) still shows when it is counted twice (once per split).
    margin = draw(st.one_of(st.floats(1, 4), st.floats(4, 30)))
    sink = _sink(np.where(np.isnan(low), 0.0, low) - margin, -np.inf)
    return dataclasses.replace(case, sink=sink)


def _low_claim(case: AttentionCase) -> Evidence:
    logits, seen = surface_logits(case)
    if not seen.any():
        return Evidence(0)
    below = case.sink[None, :, None, None] < logits
    if not below[seen].all():
        return Evidence(1, "sink_below: the sink is not below every visible logit")
    return Evidence(1)


def _cap_and_sink(draw: st.DrawFn, case: AttentionCase) -> AttentionCase:
    return _competing_sink(draw, _with_cap(draw, case))


SURFACES: dict[str, Surface] = {
    s.name: s
    for s in (
        Surface(
            "softcap",
            "softcap placement (scale before the cap) and tanh in the precision chain",
            frozenset({"softcap"}),
            _with_cap,
            _no_claim,
        ),
        Surface(
            "softcap_saturated",
            "scores far beyond the cap: logits saturate to near-ties at +-cap",
            frozenset({"softcap"}),
            _saturated,
            _saturated_claim,
        ),
        Surface(
            "sink",
            "a sink competing with the scores: it must be in the normalizer and the LSE",
            frozenset({"sink"}),
            _competing_sink,
            _no_claim,
        ),
        Surface(
            "sink_dominant",
            "a dominating sink: O ~ 0 and LSE ~ sink (a sink left out of the LSE shows)",
            frozenset({"sink"}),
            _dominant_sink,
            _dominant_claim,
        ),
        Surface(
            "sink_below",
            "a sink below every score: it must change nothing but a little of the LSE",
            frozenset({"sink"}),
            _low_sink,
            _low_claim,
        ),
        Surface(
            "softcap+sink",
            "a sink (not capped) next to capped logits",
            frozenset({"softcap", "sink"}),
            _cap_and_sink,
            _no_claim,
        ),
    )
}


def declared_features(spec: KernelSpec) -> frozenset[str]:
    """The surface flags ``spec`` declares: a subset of {softcap, sink}."""
    return frozenset(name for name in ("softcap", "sink") if getattr(spec, name))


@st.composite
def _surface_cases(
    draw: st.DrawFn, base: st.SearchStrategy[AttentionCase], names: tuple[str, ...]
) -> AttentionCase:
    case = draw(base)
    surface = SURFACES[draw(st.sampled_from(names))]
    with np.errstate(all="ignore"):  # padding may hold NaN: it never reaches the logits
        case = surface.build(draw, case)
    event(f"surface: {surface.name}")
    return dataclasses.replace(case, label=f"{case.label} surface={surface.name}".strip())


def surface_cases(
    base: st.SearchStrategy[AttentionCase],
    *,
    spec: KernelSpec,
    surfaces: Collection[str] | None = None,
) -> st.SearchStrategy[AttentionCase]:
    """Cases of ``base`` with one of ``surfaces`` (default: every one ``spec`` declares the
    flags for) set. Raises ``ValueError`` when the spec declares none of them."""
    if not isinstance(spec, KernelSpec):
        raise ValueError(f"spec={spec!r} must be a KernelSpec")
    declared = declared_features(spec)
    allowed = tuple(name for name, s in SURFACES.items() if s.needs <= declared)
    names = allowed if surfaces is None else tuple(surfaces)
    unknown = [n for n in names if n not in SURFACES]
    if unknown:
        raise ValueError(f"surfaces={unknown} must be names from {list(SURFACES)}")
    undeclared = [n for n in names if not SURFACES[n].needs <= declared]
    if not names or undeclared:
        raise ValueError(
            f"surfaces={list(names)} must be non-empty and declared by the spec: "
            f"spec.softcap={spec.softcap}, spec.sink={spec.sink} (not: {undeclared})"
        )
    return _surface_cases(base, names)


def surface_of(case: AttentionCase) -> Surface | None:
    """The surface named in ``case.label`` (``surface=<name>``), None if there is none."""
    for part in case.label.split():
        key, _, value = part.partition("=")
        if key == "surface":
            return SURFACES[value]
    return None
