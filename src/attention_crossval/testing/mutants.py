"""Deliberately broken streaming tiers, made by textual mutation, to prove the properties bite.

Each :class:`Mutant` replaces exact snippets of ``reference/streaming.py`` (or of
``reference/masks.py``, whose :func:`~reference.masks.visible` the streaming tier calls) and
executes the result as a fresh module, so the production code stays clean (mutation testing).
Every snippet must occur exactly once in the current source, else :func:`load_mutant` raises:
a mutant can never silently stop mutating when streaming.py changes.

:func:`hunt` runs the float64 agreement property (the "kernel" against the certified exact tier
with the derived bound, docs/numerics.md#error-bound) under Hypothesis until a counterexample
appears, and reports how many examples and seconds that took and which case caught it. Only an
``AssertionError`` counts as a catch (:func:`is_a_catch`); any other error propagates.
:func:`trigger_case` gives each mutant one small hand-made case that exposes it, so a test can
show the property bites without relying on what a random hunt happens to draw.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from attention_crossval.properties._strategies.scores import DISTRIBUTIONS, BuildContext
from attention_crossval.properties._strategies.shapes import Shape
from attention_crossval.reference.bounds import error_bound, lse_error_bound
from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase, AttentionResult, Mask
from attention_crossval.reference.compare import assert_within_bound
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.precision import StreamingPrecision

FLOAT64 = StreamingPrecision.float64()
Attention = Callable[..., AttentionResult]


@dataclass(frozen=True)
class Mutation:
    """Replace ``original`` (which must occur exactly once) by ``replacement`` in ``module``."""

    module: str
    original: str
    replacement: str


@dataclass(frozen=True)
class Mutant:
    """A named bug: the kernel mistake it models and the source edits that make it."""

    name: str
    bug: str
    mutations: tuple[Mutation, ...]


def _streaming(original: str, replacement: str) -> Mutation:
    return Mutation("attention_crossval.reference.streaming", original, replacement)


def _masks(original: str, replacement: str) -> Mutation:
    return Mutation("attention_crossval.reference.masks", original, replacement)


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant(
            "missed_o_rescale",
            "O is not multiplied by alpha when the running max rises",
            (
                _streaming(
                    "O = O * alpha[:, None] + P_mma.astype(accum_dtype) @ V",
                    "O = O + P_mma.astype(accum_dtype) @ V",
                ),
            ),
        ),
        Mutant(
            "missed_row_sum_rescale",
            "row_sum is not multiplied by alpha when the running max rises",
            (
                _streaming(
                    "row_sum = row_sum * alpha + P_sum.sum(",
                    "row_sum = row_sum + P_sum.sum(",
                ),
            ),
        ),
        Mutant(
            "causal_off_by_one",
            "causal mask lets query i see key i + offset + 1",
            (
                _masks(
                    "right = 0 if right is None else min(right, 0)",
                    "right = 1 if right is None else min(right, 1)",
                ),
            ),
        ),
        Mutant(
            "wrong_alignment",
            "bottom-right and top-left causal/window diagonals swapped",
            (
                _masks(
                    "k_len - q_len if mask.alignment is CausalAlignment.BOTTOM_RIGHT else 0",
                    "0 if mask.alignment is CausalAlignment.BOTTOM_RIGHT else k_len - q_len",
                ),
            ),
        ),
        Mutant(
            "partial_last_block_unmasked",
            "the last K block is read whole and keys past k_length are not masked",
            (
                _streaming(
                    "slice(n0, min(n0 + block_n, k_len))",
                    "slice(n0, n0 + block_n)",
                ),
                _streaming(
                    "seen = visible(case, b, h, rows, cols)",
                    "seen = visible(case, b, h, rows, cols) | "
                    "(np.arange(case.Sk)[cols] >= case.k_length(b))[None, :]",
                ),
            ),
        ),
        Mutant(
            "max_init_zero",
            "running max initialised to 0 instead of -inf",
            (
                _streaming(
                    "row_max = np.full(Q.shape[0], -np.inf, score_dtype)",
                    "row_max = np.zeros(Q.shape[0], score_dtype)",
                ),
            ),
        ),
        Mutant(
            "masked_inf_nan",
            "fully masked tiles give exp2(-inf - -inf) = NaN (no guard for an all -inf max)",
            (_streaming("m_safe = np.where(row_max == -np.inf, 0, row_max)", "m_safe = row_max"),),
        ),
    )
}


class MutantRotError(ValueError):
    """A mutant's original snippet no longer occurs exactly once in its module."""


def mutated_module(module: str, mutations: list[Mutation], name: str) -> types.ModuleType:
    """Execute ``module``'s source with ``mutations`` applied as a new module (not imported
    anywhere else); :class:`MutantRotError` if a snippet does not occur exactly once."""
    path = Path(importlib.util.find_spec(module).origin)
    source = path.read_text()
    for mutation in mutations:
        count = source.count(mutation.original)
        if count != 1:
            raise MutantRotError(
                f"mutant {name!r}: snippet {mutation.original!r} occurs {count} times in {path} "
                "(must be exactly once): update testing/mutants.py"
            )
        source = source.replace(mutation.original, mutation.replacement)
    mutated = types.ModuleType(f"attention_crossval.properties._mutant_{name}.{module}")
    mutated.__file__ = str(path)
    sys.modules[mutated.__name__] = mutated  # classes defined inside look their module up here
    exec(compile(source, f"<mutant {name}: {path}>", "exec"), mutated.__dict__)
    return mutated


def load_mutant(name: str) -> types.ModuleType:
    """A fresh ``reference.streaming`` module with mutant ``name`` applied (masks mutations
    are applied to a private ``reference.masks`` whose ``visible`` the module then uses)."""
    if name not in MUTANTS:
        raise ValueError(f"name={name!r} must be one of {sorted(MUTANTS)}")
    mutations = MUTANTS[name].mutations
    streaming = mutated_module(
        "attention_crossval.reference.streaming",
        [m for m in mutations if m.module == "attention_crossval.reference.streaming"],
        name,
    )
    mask_mutations = [m for m in mutations if m.module == "attention_crossval.reference.masks"]
    if mask_mutations:
        streaming.visible = mutated_module(
            "attention_crossval.reference.masks", mask_mutations, name
        ).visible
    return streaming


def trigger_case(name: str, *, block_n: int) -> AttentionCase:
    """The smallest case we know exposes mutant ``name`` with K blocks of ``block_n`` keys (one
    row, one head, D = 4, float32, seed 0); the unmutated tier passes every one of them."""
    if name not in MUTANTS:
        raise ValueError(f"name={name!r} must be one of {sorted(MUTANTS)}")
    causal = Mask(causal=True)
    empty = Mask(k_lengths=(0,))  # no key at all: LSE -inf, O 0
    dist, Sq, Sk, mask = {
        # three K blocks, each raising the row max: every block needs the rescale
        "missed_o_rescale": ("ramp", 1, 2 * block_n + 1, Mask()),
        "missed_row_sum_rescale": ("ramp", 1, 2 * block_n + 1, Mask()),
        # Sq > Sk, bottom-right: row 0 sees nothing, a leak lets in the largest logit
        "causal_off_by_one": ("mask_bait", 3, 2, causal),
        # Sq < Sk: the swapped diagonal hides every key but the first
        "wrong_alignment": ("mask_bait", 1, block_n + 1, causal),
        # NaN/Inf in keys past k_length, inside the last partial block
        "partial_last_block_unmasked": (
            "nonfinite_padding", 1, block_n + 3, Mask(k_lengths=(block_n + 1,)),
        ),
        "max_init_zero": ("gaussian", 1, 1, empty),
        # row 0 sees no key of the one K block it visits: an all -inf tile
        "masked_inf_nan": ("gaussian", 2, 1, causal),
    }[name]  # fmt: skip
    shape = Shape(B=1, Sq=Sq, Sk=Sk, Hq=1, Hkv=1, D=4, Dv=4)
    context = BuildContext(
        rng=np.random.default_rng(0),
        shape=shape,
        dtype="float32",
        mask=mask,
        softmax_scale=0.5,
        tile_n=block_n,
        noise=0.0,
    )
    with np.errstate(all="ignore"):  # NaN/Inf padding is intended
        q, k, v = (a.astype(INPUT_DTYPES["float32"]) for a in DISTRIBUTIONS[dist].build(context))
    return AttentionCase(q, k, v, 0.5, mask, label=f"trigger of {name}: dist={dist}")


def float64_agreement(
    attention: Attention, case: AttentionCase, *, block_m: int, block_n: int
) -> None:
    """The property: ``attention`` in float64 mode matches the certified exact tier within the
    derived float64 bound, O and LSE (``AssertionError`` naming the worst element if not).
    Floating-point warnings are silenced: a kernel does not warn, its output is judged."""
    __tracebackhide__ = True
    with np.errstate(all="ignore"):
        actual = attention(case, FLOAT64, block_m=block_m, block_n=block_n)
        exact = exact_attention(case)
        bound = error_bound(case, exact.as_result(), FLOAT64, block_n=block_n)
        lse_bound = lse_error_bound(case, exact.as_result(), FLOAT64, block_n=block_n)
        assert_within_bound(actual, exact, bound, output_dtype="float64", lse_bound=lse_bound)


@dataclass(frozen=True)
class HuntResult:
    """Outcome of :func:`hunt`: ``caught`` with the first failing example's number, time and
    label (distribution / shape / mask / dtype), the shrunk case's label, the total time."""

    caught: bool
    examples: int
    seconds_to_catch: float | None
    first_label: str | None
    shrunk_label: str | None
    seconds_total: float
    message: str = ""


def is_a_catch(exc: BaseException) -> bool:
    """True for the property's failure: an ``AssertionError``, or a group (Hypothesis'
    several-bugs report) made only of them. ``Flaky`` (a failure that did not reproduce),
    health checks and any other exception are errors of the hunt, never a catch."""
    if isinstance(exc, Flaky):
        return False
    if isinstance(exc, BaseExceptionGroup):
        return all(is_a_catch(inner) for inner in exc.exceptions)
    return isinstance(exc, AssertionError)


def hunt(
    attention: Attention,
    strategy: st.SearchStrategy[AttentionCase],
    *,
    block_m: int,
    block_n: int,
    hypothesis_settings: settings | None = None,
    examples: tuple[AttentionCase, ...] = (),
) -> HuntResult:
    """Run :func:`float64_agreement` on ``examples`` (explicit, first), then on ``strategy``,
    under ``hypothesis_settings`` (default: the loaded profile, without the example database so
    counts are honest)."""
    chosen = hypothesis_settings or settings(settings.default, database=None)
    state = {"examples": 0, "first": None, "last": None}
    start = time.perf_counter()

    @chosen
    @given(strategy)
    def agreement(case: AttentionCase) -> None:
        if state["first"] is None:
            state["examples"] += 1
        try:
            float64_agreement(attention, case, block_m=block_m, block_n=block_n)
        except AssertionError:
            if state["first"] is None:
                state["first"] = (time.perf_counter() - start, case.label)
            state["last"] = case.label
            raise

    for case in reversed(examples):  # decorators apply bottom-up: keep the given order
        agreement = example(case)(agreement)
    return run_hunt(agreement, state, start)


def run_hunt(test: Callable[[], None], state: dict, start: float) -> HuntResult:
    """Run a hunt's Hypothesis ``test``; ``state`` holds what its body recorded (``examples``,
    ``first`` = (seconds, label) of the first failure, ``last`` label). Only an assertion
    (:func:`is_a_catch`) is a catch; a crash, a health check or flakiness propagates."""
    try:
        test()
    except Exception as exc:
        if not is_a_catch(exc):
            raise
        seconds, label = state["first"] or (None, None)
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return HuntResult(
            True, state["examples"], seconds, label, state["last"],
            time.perf_counter() - start, message,
        )  # fmt: skip
    return HuntResult(False, state["examples"], None, None, None, time.perf_counter() - start)
