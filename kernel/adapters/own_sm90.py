"""The project's own SM90 WGMMA forward kernel (kernel/sm90/fwd.py) on a Hopper GPU.

Declares what the kernel implements and nothing more: fp16/bf16, D = 64 or 128 (Dv = D),
Hq == Hkv, bottom-right causal or no mask (no windows, varlen or explicit masks), LSE natural
log in ``[B, Hq, Sq]``, empty rows O = 0 and LSE = -inf, FlashAttention's precision chain
(fp32 S and accumulators, P rounded to the input dtype, row_sum from the fp32 p, O rounded once).

One compiled kernel per (dtype, D, causal), cached for the process; B, H, Sq, Sk and all
strides are dynamic, so guard-banded views go straight to the kernel. torch and cutlass are
imported only inside calls (CI without either can still import this module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attention_crossval.kernel.adapters import _cute, _torch
from attention_crossval.kernel.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase

NUM_CONSUMER_WG = 2  # 128-row query tiles
TILE_N = 128


def _spec() -> KernelSpec:
    return _cute.own_kernel_spec("own-sm90", tile_m=64 * NUM_CONSUMER_WG, tile_n=TILE_N)


@dataclass
class OwnSm90Adapter(_torch.GuardedOutputsAdapter):
    """Guard-banded inputs, prefilled and guard-banded ``o`` / ``lse``, one launch per call."""

    spec: KernelSpec = field(default_factory=_spec)

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        launch(q, k, v, out, lse, case.softmax_scale, causal=case.mask.causal)


def launch(
    q: Any, k: Any, v: Any, out: Any, lse: Any, softmax_scale: float, *, causal: bool
) -> None:
    """Run the kernel on torch CUDA tensors (see :func:`kernel.adapters._cute.launch`)."""
    _cute.launch("own-sm90", _make_kernel, q, k, v, out, lse, softmax_scale, causal=causal)


def _make_kernel(dtype: str, head_dim: int, causal: bool) -> Any:
    from attention_crossval.kernel.sm90.fwd import FlashAttentionForwardSm90

    return FlashAttentionForwardSm90(
        dtype, head_dim, causal, num_consumer_wg=NUM_CONSUMER_WG, tile_n=TILE_N
    )


def create() -> OwnSm90Adapter:
    return OwnSm90Adapter()
