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

from kernel.adapters import _torch
from kernel.spec import KernelSpec
from reference.case import AttentionCase, CausalAlignment

NUM_CONSUMER_WG = 2  # 128-row query tiles
TILE_N = 128
_COMPILED: dict[tuple[str, int, bool], Any] = {}  # (dtype, D, causal) -> compiled kernel


def _spec() -> KernelSpec:
    return KernelSpec(
        name="own-sm90",
        dtypes=frozenset({"float16", "bfloat16"}),
        head_dims=frozenset({64, 128}),
        mask_kinds=frozenset({"causal"}),
        causal_alignment=CausalAlignment.BOTTOM_RIGHT,
        gqa=False,
        tile_m=64 * NUM_CONSUMER_WG,
        tile_n=TILE_N,
        returns_lse=True,
        deterministic=True,
    )


@dataclass
class OwnSm90Adapter(_torch.GuardedOutputsAdapter):
    """Guard-banded inputs, prefilled and guard-banded ``o`` / ``lse``, one launch per call."""

    spec: KernelSpec = field(default_factory=_spec)

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        launch(q, k, v, out, lse, case.softmax_scale, causal=case.mask.causal)


def launch(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    softmax_scale: float,
    *,
    causal: bool,
) -> None:
    """Run the kernel on torch CUDA tensors ``q, k, v, out [B, S, H, D]``, ``lse [B, H, Sq]``
    (fp32) on the current stream, compiling on first use of (dtype, D, causal) in this
    process."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    from kernel.common.softmax import LOG2_E
    from kernel.sm90.fwd import FlashAttentionForwardSm90

    if q.shape[2] != k.shape[2]:
        raise ValueError(f"Hq={q.shape[2]} must equal Hkv={k.shape[2]} (no GQA in own-sm90)")
    if k.shape != v.shape or q.shape[::3] != k.shape[::3] or out.shape != q.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out "
            f"{tuple(out.shape)}: k and v must match, q/k share B and D, out must match q"
        )
    dtype = str(q.dtype).removeprefix("torch.")
    key = (dtype, int(q.shape[-1]), bool(causal))
    tensors = [
        from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.ndim - 1)
        for t in (q, k, v, out)
    ]
    tensors.append(from_dlpack(lse, assumed_align=4).mark_layout_dynamic(leading_dim=2))
    scale_log2 = cutlass.Float32(softmax_scale * LOG2_E)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    if key not in _COMPILED:
        kernel = FlashAttentionForwardSm90(
            dtype, key[1], causal, num_consumer_wg=NUM_CONSUMER_WG, tile_n=TILE_N
        )
        _COMPILED[key] = cute.compile(kernel, *tensors, scale_log2, stream)
    _COMPILED[key](*tensors, scale_log2, stream)


def create() -> OwnSm90Adapter:
    return OwnSm90Adapter()
