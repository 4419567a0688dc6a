"""Declared known findings: a kernel's real divergences, kept visible instead of declared away.

Narrowing a declaration (say, no varlen) hides a divergence from every report. A
:class:`KnownFinding` in ``KernelSpec.known_findings`` keeps the cases in scope instead: when
every failed check of a case is covered by a known finding that applies to it, the report calls
the record ``known`` (with the reason and link) and pytest calls it xfail
(:func:`kernel.harness.known.xfail_if_known`; a property test rejects the example); any other
failure still fails.
The strict-xfail test per known finding (properties/test_known_strict.py) turns an upstream fix
into a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from attention_crossval.kernel.contract.checks import BACKWARD_CHECKS, CHECKS
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.masks import empty_rows
from attention_crossval.reference.precision import cast_input

if TYPE_CHECKING:  # kernel.contract.spec imports this module: KernelSpec holds known findings
    from attention_crossval.kernel.contract.spec import KernelSpec


# What a known finding may require of a case beyond its mask: the forward-surface features a
# case carries in its own fields, named as in properties' feature vocabulary
# (properties._strategies.features.FEATURES).
FINDING_FEATURES = ("softcap", "sink", "paged", "splits", "packed")


def surface_features(case: AttentionCase) -> frozenset[str]:
    """The :data:`FINDING_FEATURES` ``case`` has: its call options, a softcap, a sink."""
    surface = {"softcap"} if case.softcap is not None else set()
    surface |= {"sink"} if case.sink is not None else set()
    return case.call_options | surface


@dataclass(frozen=True)
class KnownFinding:
    """A check the kernel is known to fail on some cases, and why.

    * ``check``: the harness check it fails (one of ``kernel.contract.checks.CHECKS``).
    * ``mask_kinds``: it applies to cases whose mask uses any of these kinds (a subset of the
      spec's ``mask_kinds``); empty: whatever the mask.
    * ``features``: and only to cases that have every one of these features
      (:data:`FINDING_FEATURES`, declared by the spec), e.g. ``{"paged"}`` for a read that only
      the page table reaches; empty: whatever the features.
    * ``reason``: what the kernel does, in one or two sentences.
    * ``link``: the upstream issue, or the upstream repository when not yet reported (then the
      reason says so).
    * ``backward``: it is a finding of the backward pass (a check of
      ``kernel.contract.checks.BACKWARD_CHECKS``), not of the forward.
    * ``head_dims``: and only to cases whose D is one of these; empty: whatever the head dim.
    """

    check: str
    mask_kinds: frozenset[str]
    reason: str
    link: str
    backward: bool = False
    features: frozenset[str] = frozenset()
    head_dims: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.backward, bool):
            raise ValueError(f"known_finding.backward={self.backward!r} must be a bool")
        vocabulary = BACKWARD_CHECKS if self.backward else CHECKS
        if self.check not in vocabulary:
            raise ValueError(
                f"known_finding.check={self.check!r} must be one of {list(vocabulary)}"
            )
        kinds = self.mask_kinds
        if not isinstance(kinds, (frozenset, set, tuple, list)) or not all(
            isinstance(kind, str) for kind in kinds
        ):
            raise ValueError(f"known_finding.mask_kinds={kinds!r} must be a set of mask kind names")
        object.__setattr__(self, "mask_kinds", frozenset(kinds))
        features = self.features
        if not isinstance(features, (frozenset, set, tuple, list)) or not set(features) <= set(
            FINDING_FEATURES
        ):
            raise ValueError(
                f"known_finding.features={features!r} must be a set of names from "
                f"{list(FINDING_FEATURES)}"
            )
        object.__setattr__(self, "features", frozenset(features))
        dims = self.head_dims
        if not isinstance(dims, (frozenset, set, tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims
        ):
            raise ValueError(f"known_finding.head_dims={dims!r} must be a set of ints >= 1")
        object.__setattr__(self, "head_dims", frozenset(dims))
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"known_finding.reason={self.reason!r} must be a non-empty str")
        if not isinstance(self.link, str) or not self.link.startswith("https://"):
            raise ValueError(f"known_finding.link={self.link!r} must be an https:// URL")

    def applies(self, case: AttentionCase) -> bool:
        masked = not self.mask_kinds or bool(self.mask_kinds & case.mask.kinds)
        sized = not self.head_dims or case.D in self.head_dims
        return masked and sized and self.features <= surface_features(case)

    @property
    def when(self) -> str:
        """The cases it applies to, in words."""
        parts = [f"{' or '.join(sorted(self.mask_kinds))} masks"] if self.mask_kinds else []
        parts += [f"{' and '.join(sorted(self.features))} cases"] if self.features else []
        if self.head_dims:
            parts.append(f"D = {' or '.join(str(d) for d in sorted(self.head_dims))}")
        return ", ".join(parts) or "every case"

    @property
    def name(self) -> str:
        """The check, prefixed ``backward`` for a backward finding."""
        return f"backward {self.check}" if self.backward else self.check

    def __str__(self) -> str:
        return f"known {self.name} with {self.when}: {self.reason} ({self.link})"

    def to_dict(self) -> dict[str, str]:
        return {"check": self.name, "when": self.when, "reason": self.reason, "link": self.link}


def without_empty_row_gradient(case: BackwardCase) -> BackwardCase:
    """``case`` with dO (and the LSE gradient) zeroed on every query row that sees no key."""
    empty = empty_rows(case.forward)  # [B, Hq, Sq]
    do = np.where(empty.transpose(0, 2, 1)[..., None], 0, case.do).astype(case.do.dtype)
    dlse = None if case.dlse is None else np.where(empty, 0, case.dlse).astype(case.dlse.dtype)
    return BackwardCase(case.forward, do, dlse, case.label)


def backward_trigger_case(spec: KernelSpec, known: KnownFinding) -> BackwardCase:
    """:func:`trigger_case` with a gaussian upstream gradient, for a backward finding; for
    ``nonfinite`` with hidden rows, dO is 0 on those rows (as a loss mask makes it)."""
    forward = trigger_case(spec, known)
    do = np.random.default_rng(1).standard_normal((forward.B, forward.Sq, forward.Hq, forward.Dv))
    case = BackwardCase(forward, do.astype(forward.q.dtype), label=forward.label)
    return without_empty_row_gradient(case) if known.check == "nonfinite" else case


def trigger_case(spec: KernelSpec, known: KnownFinding) -> AttentionCase:
    """A small deterministic case inside ``spec`` on which ``known`` shows, for the strict-xfail
    test: ``padding-read``: two batches of ``2 * tile_n`` keys, valid lengths ending mid-tile
    (the harness plants NaN past them); with the ``paged`` feature, pages of ``tile_n`` keys
    whose last one is half filled (the harness plants NaN in its tail), two sequences of
    ``1.5 * tile_n`` keys without a varlen finding; ``empty-rows``, ``zero-grad``: an explicit
    mask hiding whole rows; ``nonfinite``: one query row, hidden; ``nonfinite`` with a sink: one
    query whose scores lie about 1000 below the sink (``exp(sink - max score)`` overflows
    float32); ``hidden-nan``: a window or explicit mask hiding key 0 from every row, the other
    keys of its tile visible; a paged finding at named head dims: 63 queries over 64 keys in
    pages of one key, one head, at the smallest. ValueError for another check, mask kind or
    feature (write its trigger here)."""
    rng = np.random.default_rng(0)
    dtype = next(d for d in ("bfloat16", "float16", "float32") if d in spec.dtypes)
    D = min(spec.head_dims)
    Dv = D if D in spec.value_dims_for(D) else spec.value_dims_for(D)[0]
    if known.check == "nonfinite" and known.features == {"sink"} and not known.mask_kinds:
        return _dominant_sink_case(D, Dv, spec.tile_n, dtype, rng)
    if known.head_dims and known.features == {"paged"} and not known.mask_kinds:
        # one head, 63 queries over 64 keys in pages of one key, at the smallest named head dim
        D = Dv = min(known.head_dims)
        q, k, v = (rng.standard_normal((1, S, 1, D)) for S in (63, 64, 64))
        arrays = (cast_input(a, dtype) for a in (q, k, v))
        return AttentionCase(*arrays, page_size=1, label=f"trigger:{known.check}")
    Sk = 2 * spec.tile_n
    options: dict[str, Any] = {}
    padding = known.mask_kinds <= {"varlen"} and known.features <= {"paged"}
    if known.check == "padding-read" and padding and (known.mask_kinds or known.features):
        B, Sq, mask = 2, spec.tile_m, Mask(k_lengths=(Sk - spec.tile_n // 2, spec.tile_n // 2))
        if not known.mask_kinds:  # paged alone: every key valid, the last page half filled
            Sk, mask = Sk - spec.tile_n // 2, Mask()
        options = {"page_size": spec.tile_n} if known.features else {}
    elif (
        known.check in ("empty-rows", "zero-grad", "nonfinite")
        and "explicit" in known.mask_kinds
        and not known.features
    ):
        B, Sq = 1, 1 if known.check == "nonfinite" else spec.tile_m  # nonfinite: a decode row
        explicit = rng.random((1, 1, Sq, Sk)) < 0.5
        explicit[..., : max(1, Sq // 4), :] = False  # the first quarter of the rows sees no key
        mask = Mask(explicit=explicit)
    elif known.check == "hidden-nan" and len(known.mask_kinds) == 1 and not known.features:
        # key 0 hidden from every row, in a tile whose other keys every row sees
        B, Sq, Sk = 1, spec.tile_m, spec.tile_m + 1
        if known.mask_kinds == {"window"}:  # bottom-right offset 1: row i sees keys > i
            mask = Mask(window_left=0)
        elif known.mask_kinds == {"explicit"}:
            explicit = np.ones((1, 1, Sq, Sk), dtype=bool)
            explicit[..., 0] = False
            mask = Mask(explicit=explicit)
        else:
            raise ValueError(f"no hidden-nan trigger for {known.when}")
    else:
        raise ValueError(
            f"no trigger case for a known {known.check!r} with {known.when}: add one to "
            "kernel.contract.known_findings.trigger_case"
        )
    q, k, v = (rng.standard_normal((B, S, 2, d)) for S, d in ((Sq, D), (Sk, D), (Sk, Dv)))
    arrays = (cast_input(a, dtype) for a in (q, k, v))
    return AttentionCase(*arrays, mask=mask, label=f"trigger:{known.check}", **options)


def _dominant_sink_case(
    D: int, Dv: int, tile_n: int, dtype: str, rng: np.random.Generator
) -> AttentionCase:
    """One query over ``tile_n`` keys, every score ``-16 D`` (q = 4, k = -4, scale 1), a sink of
    0: the sink carries all the weight (LSE = 0, O about ``exp(-16 D)``), and a kernel that
    leaves the sink out of the running max computes ``exp(16 D)``, which overflows."""
    q = np.full((1, 1, 2, D), 4.0)
    k = np.full((1, tile_n, 2, D), -4.0)
    v = rng.standard_normal((1, tile_n, 2, Dv))
    arrays = (cast_input(a, dtype) for a in (q, k, v))
    return AttentionCase(
        *arrays, softmax_scale=1.0, sink=np.zeros(2, np.float32), label="trigger:nonfinite"
    )
