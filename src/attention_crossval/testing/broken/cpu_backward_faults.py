"""CPU backward kernels with one deliberate bug each, to prove each backward check bites.

Each is the streaming backward (FlashAttention's deterministic chain, 16 x 16 tiles) writing
dq/dk/dv into NaN/zero-prefilled, guard-banded NumPy buffers, with one bug from the backward's
classic list; :data:`EXPECTED` names the checks that must catch it and no others:

* ``missing_d``: ``dS = P * dP``, the ``D = rowsum(dO * O)`` term left out (O read as 0);
* ``stale_lse``: P recomputed from an LSE that is not the forward's (off by 0.25);
* ``no_group_sum``: dK/dV of only the first query head of each GQA group;
* ``read_padding``: a tile multiplies the keys and values past ``k_lengths`` by zero;
* ``skip_last_k_block``: dK/dV of the last K block never stored;
* ``oob_write``: one dK row stored past the end;
* ``atomic_dq``: dQ partials added in a different order on each call, yet declared deterministic;
* ``padded_grad``: nonzero dK on keys past ``k_lengths``;
* ``exit``: the process dies inside the backward (a CUDA fault does the same);
* ``dq_16bit_accumulator``: the dQ accumulator is the input dtype, so each K block's partial is
  added in fp16/bf16 (fp32 inputs: fp32, no bug);
* ``ds_bf16``: dS rounded to bf16 before its MMAs where the declared fp16 chain rounds it to fp16;
* ``dk_default_scale``: dk scaled by the default ``1/sqrt(D)`` instead of the case's
  ``softmax_scale`` (invisible unless a case sets another scale).

``dq_16bit_accumulator`` and ``dk_default_scale`` are source edits of
``reference/streaming_backward.py`` (:data:`SOURCE_EDITS`, applied as the forward's mutants are);
:func:`trigger_case` gives a case on which each bug is caught by exactly its checks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference import streaming_backward as correct_tier
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.precision import BackwardPrecision
from attention_crossval.reference.streaming import streaming_attention

TILE = 16
GUARD = 4
_GUARD_VALUE = -7.0e300  # a value no gradient can hold

EXPECTED: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "missing_d": frozenset({"dq-bound", "dk-bound"}),  # dV = P^T dO has no D term
    "stale_lse": frozenset({"dq-bound", "dk-bound", "dv-bound"}),
    "no_group_sum": frozenset({"dk-bound", "dv-bound"}),
    "read_padding": frozenset({"padding-read"}),
    "skip_last_k_block": frozenset({"unwritten"}),
    "oob_write": frozenset({"output-guard"}),
    "atomic_dq": frozenset({"determinism"}),
    "padded_grad": frozenset({"zero-grad", "dk-bound"}),  # the reference is 0 there as well
    "exit": frozenset({"crash"}),
    "dq_16bit_accumulator": frozenset({"dq-bound"}),
    "ds_bf16": frozenset({"dq-bound", "dk-bound"}),
    "dk_default_scale": frozenset({"dk-bound"}),
}

# (original snippet, replacement) in reference/streaming_backward.py, each occurring once.
SOURCE_EDITS: dict[str, tuple[tuple[str, str], ...]] = {
    "dq_16bit_accumulator": (
        (
            "dQ[rows] += dS_mma @ K",
            "dQ[rows] = round_to(dQ[rows] + dS_mma @ K, fwd.dtype)",
        ),
    ),
    "dk_default_scale": (
        (
            "dk_acc = dk_acc if per_head else dk_acc * scale_at_end",
            "dk_acc = dk_acc if per_head else dk_acc * acc.type(fwd.D**-0.5)",
        ),
    ),
}


@functools.cache
def _tier(bug: str) -> types.ModuleType:
    """``reference.streaming_backward``, with ``bug``'s source edits where it has any."""
    if bug not in SOURCE_EDITS:
        return correct_tier
    from attention_crossval.testing.mutants import Mutation, mutated_module

    edits = [Mutation(correct_tier.__name__, old, new) for old, new in SOURCE_EDITS[bug]]
    return mutated_module(correct_tier.__name__, edits, f"backward_{bug}")


def _spec() -> KernelSpec:
    return KernelSpec(
        name="cpu-backward",
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        head_dims=frozenset({8, 16, 32, 64}),
        mask_kinds=frozenset({"causal", "window", "varlen", "explicit"}),
        tile_m=TILE,
        tile_n=TILE,
        device="cpu",
        backward=True,
        backward_deterministic=True,
    )


@dataclass
class BrokenBackwardAdapter:
    """The streaming forward and backward with the backward bug ``bug`` (see the module)."""

    bug: str = "none"
    spec: KernelSpec = field(default_factory=_spec)
    checks: frozenset[str] = frozenset({"padding-read", "determinism", "nonfinite"})
    backward_checks: frozenset[str] = frozenset(
        {"unwritten", "output-guard", "padding-read", "determinism", "nonfinite"}
    )
    calls: int = 0

    def __post_init__(self) -> None:
        if self.bug not in EXPECTED:
            raise ValueError(f"bug={self.bug!r} must be one of {sorted(EXPECTED)}")

    def __call__(self, case: AttentionCase) -> AttentionResult:
        return streaming_attention(
            case, self.spec.precision_for(case.dtype), block_m=TILE, block_n=TILE
        )

    def backward(self, case: BackwardCase) -> Gradients:
        return self.run_backward_guarded(case, prefill="zero")[0]

    def run_backward_guarded(
        self, case: BackwardCase, *, prefill: str
    ) -> tuple[Gradients, tuple[str, ...]]:
        """The gradients written into ``prefill``ed, guard-banded buffers; any guard writes."""
        grads = self._gradients(case)
        self.calls += 1
        last_tile = (case.forward.Sk - 1) // TILE * TILE
        written = {"dk": last_tile, "dv": last_tile} if self.bug == "skip_last_k_block" else {}
        arrays, writes = {}, []
        for name in ("dq", "dk", "dv"):
            oob = self.bug == "oob_write" and name == "dk"
            arrays[name], touched = _store(getattr(grads, name), prefill, written.get(name), oob)
            if touched:
                writes.append(f"{name}: guard band written")
        return Gradients(**arrays), tuple(writes)

    def _gradients(self, case: BackwardCase) -> Gradients:
        precision = self.spec.backward_precision_for(case.forward.dtype)
        forward = self(case.forward)

        def run(which: BackwardCase = case, chain: BackwardPrecision = precision, **kw):
            kw.setdefault("forward", forward if which is case else None)
            return _tier(self.bug).streaming_backward(
                which, chain, block_m=TILE, block_n=TILE, **kw
            )

        if self.bug == "exit":
            os._exit(3)
        if self.bug == "missing_d":  # D = rowsum(dO * O) with O read as 0
            return run(forward=AttentionResult(o=np.zeros_like(forward.o), lse=forward.lse))
        if self.bug == "stale_lse":
            return run(forward=AttentionResult(o=forward.o, lse=forward.lse + 0.25))
        if self.bug == "atomic_dq":
            return run(chain=dataclasses.replace(precision, dq_order="permuted"), seed=self.calls)
        if self.bug == "ds_bf16" and precision.ds_dtype == "float16":
            return run(chain=dataclasses.replace(precision, ds_dtype="bfloat16"))
        grads = run()
        if self.bug == "no_group_sum":
            group = case.forward.group_size
            fwd = case.forward
            explicit = fwd.mask.explicit
            if explicit is not None and explicit.shape[1] > 1:  # per-head mask: its first heads
                mask = dataclasses.replace(fwd.mask, explicit=explicit[:, ::group])
            else:
                mask = fwd.mask
            first = dataclasses.replace(fwd, q=fwd.q[:, :, ::group], mask=mask)
            alone = run(BackwardCase(first, case.do[:, :, ::group]))
            return Gradients(dq=grads.dq, dk=alone.dk, dv=alone.dv)
        fwd = case.forward
        for b in range(fwd.B):
            padding = slice(fwd.k_length(b), fwd.Sk)
            if self.bug == "read_padding":  # P = 0 times the padded K/V rows
                grads.dk[b] += 0.0 * fwd.k[b, padding].astype(np.float64).sum()
                grads.dv[b] += 0.0 * fwd.v[b, padding].astype(np.float64).sum()
            if self.bug == "padded_grad":
                grads.dk[b, padding] = 2.0**-10
        return grads


def _store(
    values: np.ndarray, prefill: str, rows: int | None, oob: bool
) -> tuple[np.ndarray, bool]:
    """``values [B, S, H, X]`` stored (its first ``rows`` rows; all when None) into a
    ``prefill``ed buffer with guard bands along S; ``oob`` also stores one row past the end.
    Returns the stored view's copy and whether a guard changed."""
    B, S = values.shape[:2]
    buf = np.full((B, S + 2 * GUARD, *values.shape[2:]), _GUARD_VALUE)
    buf[:, GUARD : GUARD + S] = np.nan if prefill == "nan" else 0.0
    rows = S if rows is None else rows
    buf[:, GUARD : GUARD + rows] = values[:, :rows]
    if oob:
        buf[:, GUARD + S] = values[:, -1]
    guards = np.concatenate([buf[:, :GUARD], buf[:, GUARD + S :]], axis=1)
    return buf[:, GUARD : GUARD + S].copy(), bool((guards != _GUARD_VALUE).any())


def sample_case(
    dtype: type = np.float16, *, Hq: int = 4, Hkv: int = 2, D: int = 16
) -> BackwardCase:
    """GQA, varlen (padded rows and keys, five K tiles of 16), causal: every bug of the first
    list shows. dQ's summation order shows in its bits only when they are not rounded to 16
    bits: ``atomic_dq`` runs on float32."""
    rng = np.random.default_rng(5)
    B, Sq, Sk = 2, 20, 70
    q, k, v = (rng.standard_normal((B, S, H, D)) for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))
    mask = Mask(causal=True, q_lengths=(20, 5), k_lengths=(70, 19))
    forward = AttentionCase(*(a.astype(dtype) for a in (q, k, v)), mask=mask)
    do = rng.standard_normal((B, Sq, Hq, D)).astype(dtype)
    return BackwardCase(forward, do)


def swamped_dq_case(dtype: str, n_keys: int, middle: float) -> BackwardCase:
    """One query row over ``n_keys`` keys with equal scores (P = 1/n_keys), whose dq_0 =
    scale sum_j dS_j k_j0 is a sum of small terms of one sign (``middle / n_keys`` each) between
    a first key's +1/n_keys and a last key's -1/n_keys: a 16-bit accumulator holds about
    1/n_keys after the first K block, and a block's small terms below half its ulp are lost."""
    D = 16
    q, do = np.zeros((1, 1, 1, D)), np.zeros((1, 1, 1, D))
    k, v = np.zeros((1, n_keys, 1, D)), np.zeros((1, n_keys, 1, D))
    q[..., 1] = do[..., 0] = 1.0  # no key has a component along q: equal scores
    sign = np.where(np.arange(n_keys) % 2 == 0, 1.0, -1.0)
    v[0, :, 0, 0], k[0, :, 0, 0] = sign / 16, sign * middle * 16  # dS_j k_j0 = middle / n_keys
    v[0, [0, -1], 0, 0], k[0, [0, -1], 0, 0] = (1.0, -1.0), 1.0
    cast = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    return BackwardCase(AttentionCase(*(x.astype(cast) for x in (q, k, v))), do.astype(cast))


def trigger_case(bug: str) -> BackwardCase:
    """A case on which ``bug`` fails exactly its :data:`EXPECTED` checks."""
    if bug == "atomic_dq":
        return sample_case(np.float32)
    if bug == "dk_default_scale":  # any scale but 1/sqrt(D)
        case = sample_case()
        return BackwardCase(dataclasses.replace(case.forward, softmax_scale=1.0), case.do)
    if bug == "dq_16bit_accumulator":  # one row over 1024 keys whose small dq terms it loses
        return swamped_dq_case("bfloat16", 1024, 2.0**-15)
    return sample_case()


def correct() -> BrokenBackwardAdapter:
    """The same adapter without a bug: the control of the mutant benchmark."""
    return BrokenBackwardAdapter("none")


def atomic_dq() -> BrokenBackwardAdapter:
    return BrokenBackwardAdapter("atomic_dq")


def dq_16bit_accumulator() -> BrokenBackwardAdapter:
    return BrokenBackwardAdapter("dq_16bit_accumulator")


def ds_bf16() -> BrokenBackwardAdapter:
    return BrokenBackwardAdapter("ds_bf16")


def dk_default_scale() -> BrokenBackwardAdapter:
    return BrokenBackwardAdapter("dk_default_scale")


def exit_in_backward() -> BrokenBackwardAdapter:
    return BrokenBackwardAdapter("exit")


def missing_d() -> BrokenBackwardAdapter:
    return BrokenBackwardAdapter("missing_d")


def no_group_sum() -> BrokenBackwardAdapter:
    return BrokenBackwardAdapter("no_group_sum")


def read_padding() -> BrokenBackwardAdapter:
    return BrokenBackwardAdapter("read_padding")
