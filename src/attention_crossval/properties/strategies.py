"""Hypothesis strategies for attention cases: the public surface (docs/design.md#public-surface).

``attention_cases()`` draws a shape inside a kernel's declaration, a mask, a score
distribution, a dtype and a seed, and builds exact q, k, v with NumPy. Every case carries a label
``dist=<name> shape=<class> mask=<class> dtype=<dtype> tile_n=<n>`` that the coverage summary
(:mod:`properties.coverage`) and failure reports read, and fires ``hypothesis.event`` for each
part so ``--hypothesis-show-statistics`` shows what was hit.

Example::

    @given(attention_cases(spec=my_kernel.spec, max_len=300))
    def test_kernel_matches_exact(case): ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TypeVar

import numpy as np
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import MASK_KINDS, KernelSpec
from attention_crossval.properties import coverage
from attention_crossval.properties._strategies.features import (
    BASES,
    FEATURES,
    add_features,
    case_features,
    check_features,
    long_decode_options,
    spec_features,
)
from attention_crossval.properties._strategies.fp8 import drawn_inputs
from attention_crossval.properties._strategies.gradients import (
    GRADIENT_DISTRIBUTIONS,
    GradientDistribution,
    build_do,
    gradient_distributions,
)
from attention_crossval.properties._strategies.hidden import hidden_key_cases
from attention_crossval.properties._strategies.long import LONG_KINDS, long_context_cases
from attention_crossval.properties._strategies.long_keys import (
    SWAMPED_DQ,
    long_key_cases,
    long_key_lengths,
)
from attention_crossval.properties._strategies.masks import mask_class, masks
from attention_crossval.properties._strategies.paged import paged_cases
from attention_crossval.properties._strategies.scores import (
    DISTRIBUTIONS,
    BuildContext,
    Evidence,
    ScoreDistribution,
    scaled_scores,
    score_distributions,
)
from attention_crossval.properties._strategies.shapes import (
    Shape,
    attention_shapes,
    head_counts,
    length_class,
    shape_class,
    tile_aware_lengths,
)
from attention_crossval.properties._strategies.splits import num_splits_of, splitkv_cases
from attention_crossval.properties._strategies.surface import SURFACES, surface_cases
from attention_crossval.properties._strategies.varlen import (
    PLAIN,
    long_decode_cases,
    varlen_batches,
)
from attention_crossval.reference.case import (
    WIDE_DTYPES,
    AttentionCase,
    CausalAlignment,
    default_softmax_scale,
)
from attention_crossval.reference.gradients import BackwardCase

T = TypeVar("T")  # what a strategy draws

# The reference tiers as a "kernel": every dtype and mask, small head dims and tiles so CPU
# runs see many blocks per row (tile_m != tile_n catches the two being swapped).
REFERENCE_SPEC = KernelSpec(
    name="reference",
    dtypes=frozenset(WIDE_DTYPES),
    head_dims=frozenset({1, 2, 4, 8, 16}),
    head_dims_v=frozenset({1, 2, 4, 8, 16}),
    mask_kinds=MASK_KINDS,
    gqa=True,
    tile_m=16,
    tile_n=8,
    max_seqlen=1 << 12,
    device="cpu",
)


@st.composite
def _regular_case(
    draw: st.DrawFn,
    spec: KernelSpec,
    kernel_alignment: CausalAlignment | None,
    dtypes: tuple[str, ...],
    max_len: int,
    max_batch: int,
    max_heads: int,
    head_dims: frozenset[int] | None,
    distributions: tuple[str, ...],
    mask_kinds: frozenset[str],
    required_mask_kinds: frozenset[str],
) -> AttentionCase:
    """A shape, mask, score distribution, dtype and seed, built into q, k, v; the label names
    the distribution and the dtype."""
    shape = draw(
        attention_shapes(
            spec=spec,
            max_len=max_len,
            max_batch=max_batch,
            max_heads=max_heads,
            head_dims=head_dims,
        )
    )
    dist = draw(score_distributions(names=distributions))
    mask = draw(
        masks(
            shape=shape,
            kinds=mask_kinds,
            kernel_alignment=kernel_alignment,
            tile_m=spec.tile_m,
            tile_n=spec.tile_n,
            key_padding=dist.needs_key_padding,
            required=required_mask_kinds,
        )
    )
    dtype = draw(st.sampled_from(dtypes))
    softmax_scale = draw(st.sampled_from([None, 1.0, 0.125]))
    noise = draw(st.sampled_from([0.0, 0.25, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    ctx = BuildContext(
        rng=np.random.default_rng(seed),
        shape=shape,
        dtype=dtype,
        mask=mask,
        softmax_scale=softmax_scale or default_softmax_scale(shape.D),
        tile_n=spec.tile_n,
        noise=noise,
    )
    inputs, descales = drawn_inputs(draw, dist.name, ctx, spec.descales)
    label = f"dist={dist.name} dtype={dtype}{descales}"
    return AttentionCase(softmax_scale=softmax_scale, mask=mask, label=label, **inputs)


@st.composite
def _attention_cases(
    draw: st.DrawFn,
    regular: st.SearchStrategy[AttentionCase],
    spec: KernelSpec,
    max_len: int,
    features: tuple[str, ...],
    required_features: frozenset[str],
    base_options: dict,
) -> AttentionCase:
    bases = [b for b in BASES if b in required_features] or [b for b in BASES if b in features]
    base = "regular"
    if bases and (bases[0] in required_features or draw(st.integers(0, 7)) == 7):
        base = draw(st.sampled_from(bases))
    if base == "varlen_batch":
        case = draw(varlen_batches(spec=spec, max_len=max_len, **base_options))
    elif base == "long_decode":
        options = long_decode_options(spec)
        case = draw(long_decode_cases(spec=spec, **options, **base_options))
    else:
        case = draw(regular)
    case = add_features(draw, case, spec, features, required_features)
    drawn = dict(part.split("=", 1) for part in case.label.split())
    shape = Shape(case.B, case.Sq, case.Sk, case.Hq, case.Hkv, case.D, case.Dv)
    parts = {
        "dist": drawn.pop("dist"),
        "shape": shape_class(shape, spec.tile_n),
        "mask": mask_class(case),
        "dtype": drawn.pop("dtype"),
    }
    for name, value in parts.items():
        event(f"{name}: {value}")
    found = case_features(case) if features or required_features else frozenset()
    extras = [f"{key}={value}" for key, value in drawn.items()]
    if found:
        extras.append(f"features={'+'.join(sorted(found))}")
    label = " ".join([*(f"{name}={value}" for name, value in parts.items()), *extras])
    case = dataclasses.replace(case, label=f"{label} tile_n={spec.tile_n}")
    coverage.record(case)
    return case


def attention_cases(
    *,
    spec: KernelSpec | None = None,
    dtypes: Collection[str] | None = None,
    max_len: int | None = None,
    max_batch: int = 2,
    max_heads: int = 4,
    head_dims: Collection[int] | None = None,
    distributions: Collection[str] | None = None,
    mask_kinds: Collection[str] | None = None,
    required_mask_kinds: Collection[str] = (),
    features: Collection[str] | None = None,
    required_features: Collection[str] = (),
) -> st.SearchStrategy[AttentionCase]:
    """Attention cases inside ``spec`` (None = the reference tiers, :data:`REFERENCE_SPEC`).

    * ``spec``: lengths cluster at ``k * spec.tile_m`` / ``k * spec.tile_n`` +- {0, 1}; dtypes,
      head dims, mask kinds, GQA and alignment stay inside the declaration (the other causal
      alignment only where both diagonals agree). With ``spec=None`` both alignments are free.
    * ``dtypes``, ``head_dims``, ``mask_kinds``: subsets of the spec's (default: all of them).
    * ``required_mask_kinds``: kinds every case's mask uses (a subset of ``mask_kinds``).
    * ``max_len``: longest Sq / Sk (default ``4 * spec.tile_n + 1``, at most ``spec.max_seqlen``);
      ``max_batch``, ``max_heads``: at least 1.
    * ``distributions``: names from :data:`DISTRIBUTIONS` (default: all that the mask kinds
      allow; ``nonfinite_padding`` needs ``varlen``).
    * ``features``: forward-surface features (:data:`FEATURES`: softcap, sink, hidden keys,
      paged, splits, packed, varlen batches of 3+, long decode) that may be drawn, each about
      one case in four (the two base features one in eight); default: every one a given
      ``spec`` declares (:func:`spec_features`), none for ``spec=None``. varlen_batch and
      long_decode draw their own dtypes and head dims (so need the default ones), take their
      scores from ``distributions`` and are causal or not: they are drawn only where those
      meet ``required_mask_kinds``.
      ``required_features``: features every case has. The label gains
      ``features=<a+b>`` read from the finished case (:func:`case_features`).

    Bug classes: see each distribution's ``targets`` and :func:`masks`. Shrinks towards B=1,
    Sq=Sk=1, one head, no mask, the ``gaussian`` distribution, the first dtype, seed 0.
    """
    if spec is not None and not isinstance(spec, KernelSpec):
        raise ValueError(f"spec={spec!r} must be a KernelSpec or None")
    kernel_alignment = None if spec is None else spec.causal_alignment
    spec = spec or REFERENCE_SPEC
    chosen_dtypes = tuple(sorted(spec.dtypes)) if dtypes is None else tuple(dtypes)
    if not chosen_dtypes or not set(chosen_dtypes) <= spec.dtypes:
        raise ValueError(
            f"dtypes={list(chosen_dtypes)} must be a non-empty subset of spec.dtypes="
            f"{sorted(spec.dtypes)}"
        )
    kinds = spec.mask_kinds if mask_kinds is None else frozenset(mask_kinds)
    if not kinds <= spec.mask_kinds:
        raise ValueError(
            f"mask_kinds={sorted(kinds)} must be a subset of spec.mask_kinds="
            f"{sorted(spec.mask_kinds)}"
        )
    required = frozenset(required_mask_kinds)
    if not required <= kinds:
        raise ValueError(
            f"required_mask_kinds={sorted(required)} must be a subset of mask_kinds={sorted(kinds)}"
        )
    max_len = min(4 * spec.tile_n + 1, spec.max_seqlen) if max_len is None else max_len
    if distributions is None:
        names = tuple(
            n for n, d in DISTRIBUTIONS.items() if "varlen" in kinds or not d.needs_key_padding
        )
    else:
        names = tuple(distributions)
        score_distributions(names=names)  # validates the names
        needy = [n for n in names if DISTRIBUTIONS[n].needs_key_padding]
        if needy and "varlen" not in kinds:
            raise ValueError(f"distributions={needy} need 'varlen' in mask_kinds={sorted(kinds)}")
    allowed, required_feats = _features(
        spec,
        kernel_alignment is not None,
        kinds,
        features,
        required_features,
        bases=_usable_bases(names, required, free=dtypes is None and head_dims is None),
    )
    attention_shapes(
        spec=spec, max_len=max_len, max_batch=max_batch, max_heads=max_heads, head_dims=head_dims
    )  # validates the shape options now rather than at the first draw
    regular = _regular_case(
        spec,
        kernel_alignment,
        chosen_dtypes,
        max_len,
        max_batch,
        max_heads,
        None if head_dims is None else frozenset(head_dims),
        names,
        kinds,
        required,
    )
    base_options = {
        # a sweep's distributions; the free test keeps the bases' own
        "distributions": PLAIN if distributions is None else names,
        "causal": True if "causal" in required else (None if "causal" in kinds else False),
    }
    strategy = _attention_cases(regular, spec, max_len, allowed, required_feats, base_options)
    return strategy if kernel_alignment is None else strategy.filter(spec.supports)


def _usable_bases(
    distributions: tuple[str, ...], required_mask_kinds: frozenset[str], *, free: bool
) -> frozenset[str]:
    """The base features (:data:`BASES`) a case may be drawn from: they draw their own dtypes
    and head dims (so only ``free`` of those), their scores from ``distributions`` (long
    decode: those without key padding), and their masks are causal or not, with lengths for
    a varlen batch, so they meet ``required_mask_kinds`` only within those."""
    if not free:
        return frozenset()
    plain = any(not DISTRIBUTIONS[n].needs_key_padding for n in distributions)
    usable = {
        "varlen_batch": required_mask_kinds <= {"varlen", "causal"},
        "long_decode": plain and required_mask_kinds <= {"causal"},
    }
    return frozenset(base for base, ok in usable.items() if ok)


def _features(
    spec: KernelSpec,
    given_spec: bool,
    kinds: frozenset[str],
    features: Collection[str] | None,
    required_features: Collection[str],
    *,
    bases: frozenset[str],
) -> tuple[tuple[str, ...], frozenset[str]]:
    """The features ``attention_cases`` may draw and must draw, validated (docstring)."""
    if features is None:
        features = spec_features(spec) if given_spec else ()
    allowed = check_features(spec, features, "features")
    required = frozenset(check_features(spec, required_features, "required_features"))
    masked = {"varlen_batch": "varlen" in kinds, "hidden": bool(kinds & {"window", "explicit"})}
    unusable = [f for f in required if not masked.get(f, True) or (f in BASES and f not in bases)]
    if unusable or len(required & set(BASES)) > 1:
        raise ValueError(
            f"required_features={sorted(required)}: at most one of {list(BASES)}, which need "
            "the default dtypes and head dims and no required mask kinds beyond causal (and "
            "varlen for varlen_batch), long_decode a distribution without key padding; "
            "varlen_batch needs 'varlen' and hidden a window or explicit mask in mask_kinds "
            f"(not usable: {unusable})"
        )
    allowed = tuple(f for f in allowed if masked.get(f, True) and (f not in BASES or f in bases))
    return allowed, required


@st.composite
def _backward_cases(
    draw: st.DrawFn,
    forward: st.SearchStrategy[AttentionCase],
    do_distributions: tuple[str, ...],
) -> BackwardCase:
    case = draw(forward)
    dist = draw(gradient_distributions(names=do_distributions))
    seed = draw(st.integers(0, 2**32 - 1))
    event(f"grad: {dist.name}")
    return build_do(dist, case, seed)


def backward_cases(
    *, do_distributions: Collection[str] | None = None, **attention_options: object
) -> st.SearchStrategy[BackwardCase]:
    """Backward cases: a forward case from :func:`attention_cases` (``attention_options`` are
    its keyword arguments: spec, dtypes, lengths, heads, score distributions, masks) plus dO
    from ``do_distributions`` (names from :data:`GRADIENT_DISTRIBUTIONS`, default all).

    The label is the forward label plus ``grad=<name>``. Bug classes: see each gradient
    distribution's ``targets``. Shrinks as the forward case does, and dO towards ``gaussian``.
    """
    names = _gradient_names(do_distributions)
    spec = attention_options.get("spec")
    if isinstance(spec, KernelSpec):
        attention_options["spec"] = _backward_spec(spec)
    forward = attention_cases(**{"features": (), **attention_options})  # forward-only surface
    return _backward_cases(forward, names)


def long_key_backward_cases(
    *,
    spec: KernelSpec,
    max_heads: int = 2,
    max_head_dim: int = 64,
    do_distributions: Collection[str] | None = None,
) -> st.SearchStrategy[BackwardCase]:
    """Backward cases of one or two queries over 1024 keys or more (eight K blocks or more):
    the forward from :func:`long_key_cases` (three times in four :data:`SWAMPED_DQ`, where a
    dQ accumulated in 16 bits across the K blocks shows), dO from ``do_distributions`` (names
    from :data:`GRADIENT_DISTRIBUTIONS`, default all)."""
    names = _gradient_names(do_distributions)
    if not isinstance(spec, KernelSpec):
        raise ValueError(f"spec must be a KernelSpec, got {spec!r:.80}")
    forward = long_key_cases(
        spec=_backward_spec(spec), max_heads=max_heads, max_head_dim=max_head_dim
    )
    return _backward_cases(forward, names)


def _gradient_names(do_distributions: Collection[str] | None) -> tuple[str, ...]:
    """``do_distributions`` (default: every name), validated now rather than at the first draw."""
    names = tuple(GRADIENT_DISTRIBUTIONS) if do_distributions is None else tuple(do_distributions)
    gradient_distributions(names=names)
    return names


def _backward_spec(spec: KernelSpec) -> KernelSpec:
    """``spec`` with the head dims its backward is declared for (all, if it names none)."""
    if spec.backward_head_dims is None:
        return spec
    return dataclasses.replace(
        spec, head_dims=spec.backward_head_dims, head_dims_v=None, head_dim_pairs=None
    )


def drawn_examples(
    strategy: st.SearchStrategy[T], count: int, *, seed: int | None = None
) -> list[T]:
    """The first ``count`` values ``strategy`` draws, generation only (as the kernel suite draws:
    no shrinking, no example database), repeatable: under ``seed``, else derandomized."""
    drawn: list[T] = []

    @settings(
        max_examples=count,
        derandomize=seed is None,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: T) -> None:
        drawn.append(value)

    (collect if seed is None else hypothesis_seed(seed)(collect))()
    return drawn[:count]


__all__ = [
    "DISTRIBUTIONS",
    "FEATURES",
    "GRADIENT_DISTRIBUTIONS",
    "LONG_KINDS",
    "GradientDistribution",
    "REFERENCE_SPEC",
    "SURFACES",
    "SWAMPED_DQ",
    "Evidence",
    "ScoreDistribution",
    "Shape",
    "attention_cases",
    "attention_shapes",
    "backward_cases",
    "build_do",
    "case_features",
    "drawn_examples",
    "gradient_distributions",
    "head_counts",
    "hidden_key_cases",
    "long_context_cases",
    "long_decode_cases",
    "long_key_backward_cases",
    "long_key_cases",
    "long_key_lengths",
    "length_class",
    "mask_class",
    "masks",
    "num_splits_of",
    "paged_cases",
    "scaled_scores",
    "score_distributions",
    "shape_class",
    "spec_features",
    "splitkv_cases",
    "surface_cases",
    "tile_aware_lengths",
    "varlen_batches",
]
