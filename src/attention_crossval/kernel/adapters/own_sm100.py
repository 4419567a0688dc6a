"""The project's own SM100 tcgen05 forward kernel (kernel/own/sm100/fwd.py) on a Blackwell GPU.

NEVER RUN: no Blackwell GPU is available to this project, so this adapter has never executed
a kernel. The kernel is only compiled for sm_100a on a CPU (tests/kernel/test_own_sm100.py); its
results are unverified. On any GPU that is not SM100 (compute capability 10.x) every call is
declined (:class:`kernel.contract.declined.Declined`), so the harness records a skip, never a
verdict.

Declares what the kernel implements and nothing more: fp16/bf16, D = 64 or 128 (Dv = D),
Hq == Hkv, bottom-right causal or no mask, LSE natural log in ``[B, Hq, Sq]``, empty rows
O = 0 and LSE = -inf, FlashAttention's precision chain (fp32 S and accumulators, P rounded to
the input dtype, row_sum from the fp32 p, O rounded once). Tiles 128 x 128.

One compiled kernel per (dtype, D, causal), cached for the process; B, H, Sq, Sk and all
strides are dynamic. torch and cutlass are imported only inside calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attention_crossval.kernel.adapters import _cute, _torch
from attention_crossval.kernel.contract.declined import Declined
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase

TILE_M = TILE_N = (
    128  # kernel.own.sm100.fwd's tiles (not imported: that needs cutlass); tested equal
)


def _spec() -> KernelSpec:
    return _cute.own_kernel_spec("own-sm100", tile_m=TILE_M, tile_n=TILE_N)


@dataclass
class OwnSm100Adapter(_torch.GuardedOutputsAdapter):
    """Guard-banded inputs, prefilled and guard-banded ``o`` / ``lse``, one launch per call.
    Never run: no SM100 GPU exists here; declines on any other GPU."""

    spec: KernelSpec = field(default_factory=_spec)

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        import torch

        major, minor = torch.cuda.get_device_capability()
        if major != 10:
            raise Declined(
                f"own-sm100 needs an SM100 (Blackwell) GPU; this one is sm_{major}{minor}"
            )
        _cute.launch(
            "own-sm100", _make_kernel, q, k, v, out, lse, case.softmax_scale,
            causal=case.mask.causal,
        )  # fmt: skip


def _make_kernel(dtype: str, head_dim: int, causal: bool) -> Any:
    from attention_crossval.kernel.own.sm100.fwd import FlashAttentionForwardSm100

    return FlashAttentionForwardSm100(dtype, head_dim, causal)


def create() -> OwnSm100Adapter:
    return OwnSm100Adapter()
