"""A tiny Triton FlashAttention forward, correct or with one deliberate bug.

Each variant is a zero-argument factory for ``--kernel kernel.broken.triton_fa:<variant>`` and
names the harness check that must catch it (``expected_check``):

* ``correct``: the baseline; must pass every check.
* ``no_rescale``: drops ``O = O * alpha`` when the running max rises -> ``bound``.
* ``oob_write``: stores whole query tiles past ``Sq`` -> ``output-guard``.
* ``skip_last_tile``: never writes the last query tile -> ``unwritten``.
* ``read_padding``: uses keys past ``k_lengths`` -> ``padding-read``.
* ``late_rescale``: skips ``O = O * alpha`` from K block :data:`LATE_BLOCK` on (keys past
  32768): exact on every row with fewer visible keys -> ``bound`` past 32k keys only
  (docs/long-context.md).
* ``int32_offsets``: ``key * stride`` in int32, which wraps once a K or V has more than 2^31
  elements (the ``gpu-huge`` preset): it then reads far outside the tensor -> ``error`` (an
  illegal address) where nothing is mapped there, else wrong keys (``bound`` / ``nonfinite``).

All of them ran on the H200 (docs/results-h200.md): the first five before their offsets became
int64; ``late_rescale`` fails the bound on a 64k-key ramp and ``int32_offsets`` fails with an
illegal memory access on ``gpu-huge``, where the correct variant passes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from attention_crossval.kernel.adapters import _torch
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, CausalAlignment

BLOCK_M, BLOCK_N = 64, 64
LATE_BLOCK = 512  # late_rescale: the first K block (of BLOCK_N keys) whose O is not rescaled
_BUGS = {
    "correct": ({}, None),
    "no_rescale": ({"RESCALE": False}, "bound"),
    "oob_write": ({"MASK_STORE": False}, "output-guard"),
    "skip_last_tile": ({"SKIP_LAST": True}, "unwritten"),
    "read_padding": ({"KEY_LIMIT_PADDED": True}, "padding-read"),
    "late_rescale": ({"LATE_BLOCK": LATE_BLOCK}, "bound"),
    "int32_offsets": ({"OFFSETS_64": False}, "error"),
}


@dataclass
class TritonFlashAdapter(_torch.GuardedOutputsAdapter):
    """The Triton kernel with the switches of one variant."""

    variant: str
    spec: KernelSpec
    expected_check: str | None
    switches: dict[str, bool | int] = field(default_factory=dict)

    @classmethod
    def create(cls, variant: str) -> TritonFlashAdapter:
        if variant not in _BUGS:
            raise ValueError(f"variant={variant!r} must be one of {sorted(_BUGS)}")
        switches, expected = _BUGS[variant]
        spec = KernelSpec(
            name=f"triton-fa-{variant}".replace("_", "-"),
            dtypes=frozenset({"float16", "bfloat16"}),
            head_dims=frozenset({16, 32, 64, 128}),
            mask_kinds=frozenset({"varlen"}),
            causal_alignment=CausalAlignment.BOTTOM_RIGHT,
            tile_m=BLOCK_M,
            tile_n=BLOCK_N,
            padded_rows="unwritten",
        )
        return cls(variant, spec, expected, switches=switches)

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        import torch

        from attention_crossval.testing.broken._triton_kernel import attention_fwd

        q_len = torch.tensor(
            [case.q_length(b) for b in range(case.B)], dtype=torch.int32, device=q.device
        )
        k_len = torch.tensor(
            [case.k_length(b) for b in range(case.B)], dtype=torch.int32, device=q.device
        )
        switches = {
            "RESCALE": True,
            "MASK_STORE": True,
            "SKIP_LAST": False,
            "KEY_LIMIT_PADDED": False,
            "LATE_BLOCK": 0,
            "OFFSETS_64": True,
        }
        switches.update(self.switches)
        grid = (max(1, math.ceil(case.Sq / BLOCK_M)), case.B * case.Hq)
        attention_fwd[grid](
            q, k, v, out, lse, q_len, k_len,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            case.Hq, case.group_size, case.Sk, case.softmax_scale / math.log(2), case.softmax_scale,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=case.D, **switches,
        )  # fmt: skip


def correct() -> TritonFlashAdapter:
    return TritonFlashAdapter.create("correct")


def no_rescale() -> TritonFlashAdapter:
    return TritonFlashAdapter.create("no_rescale")


def oob_write() -> TritonFlashAdapter:
    return TritonFlashAdapter.create("oob_write")


def skip_last_tile() -> TritonFlashAdapter:
    return TritonFlashAdapter.create("skip_last_tile")


def read_padding() -> TritonFlashAdapter:
    return TritonFlashAdapter.create("read_padding")


def late_rescale() -> TritonFlashAdapter:
    return TritonFlashAdapter.create("late_rescale")


def int32_offsets() -> TritonFlashAdapter:
    return TritonFlashAdapter.create("int32_offsets")
