"""The project's own SM100 tcgen05 forward kernel (kernel/sm100/fwd.py) on a Blackwell GPU.

NEVER RUN: no Blackwell GPU is available to this project, so this adapter has never executed
a kernel. The kernel is only compiled for sm_100a on a CPU (properties/test_own_sm100.py); its
results are unverified. On any GPU that is not SM100 (compute capability 10.x) every call is
declined (:class:`kernel.harness.Declined`), so the harness records a skip, never a verdict.

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

from kernel.adapters import _torch
from kernel.spec import KernelSpec
from reference.case import AttentionCase, AttentionResult, CausalAlignment

TILE_M = TILE_N = 128  # kernel.sm100.fwd's tiles (not imported: that needs cutlass); tested equal
_COMPILED: dict[tuple[str, int, bool], Any] = {}  # (dtype, D, causal) -> compiled kernel


def _spec() -> KernelSpec:
    return KernelSpec(
        name="own-sm100",
        dtypes=frozenset({"float16", "bfloat16"}),
        head_dims=frozenset({64, 128}),
        mask_kinds=frozenset({"causal"}),
        causal_alignment=CausalAlignment.BOTTOM_RIGHT,
        gqa=False,
        tile_m=TILE_M,
        tile_n=TILE_N,
        returns_lse=True,
        device="cuda",
        deterministic=True,
    )


@dataclass
class OwnSm100Adapter:
    """Guard-banded inputs, prefilled and guard-banded ``o`` / ``lse``, one launch per call.
    Never run: no SM100 GPU exists here; declines on any other GPU."""

    spec: KernelSpec = field(default_factory=_spec)
    checks: frozenset[str] = frozenset(
        {"input-guard", "prefill", "output-guard", "padding-poison", "determinism", "nonfinite"}
    )

    def __call__(self, case: AttentionCase) -> AttentionResult:
        return self.run_guarded(case, prefill="zero")[0]

    def run_guarded(
        self, case: AttentionCase, *, prefill: str
    ) -> tuple[AttentionResult, tuple[str, ...]]:
        import torch

        from kernel.harness import Declined

        major, minor = torch.cuda.get_device_capability()
        if major != 10:
            raise Declined(
                f"own-sm100 needs an SM100 (Blackwell) GPU; this one is sm_{major}{minor}"
            )
        q, k, v = (_torch.to_device(getattr(case, n)) for n in "qkv")
        out = _torch.GuardedOutput.allocate(
            (case.B, case.Sq, case.Hq, case.Dv), case.dtype, axis=1, prefill=prefill
        )
        lse = _torch.GuardedOutput.allocate(
            (case.B, case.Hq, case.Sq), "float32", axis=2, prefill=prefill
        )
        launch(q, k, v, out.view, lse.view, case.softmax_scale, causal=case.mask.causal)
        torch.cuda.synchronize()
        writes = tuple(out.guard_writes("o") + lse.guard_writes("lse"))
        return AttentionResult(o=_torch.to_host(out.view), lse=_torch.to_host(lse.view)), writes


def launch(
    q: Any, k: Any, v: Any, out: Any, lse: Any, softmax_scale: float, *, causal: bool
) -> None:
    """Run the kernel on torch CUDA tensors ``q, k, v, out [B, S, H, D]``, ``lse [B, H, Sq]``
    (fp32) on the current stream, compiling on first use of (dtype, D, causal). Never run:
    no SM100 GPU exists here."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    from kernel.common.softmax import LOG2_E
    from kernel.sm100.fwd import FlashAttentionForwardSm100

    if q.shape[2] != k.shape[2]:
        raise ValueError(f"Hq={q.shape[2]} must equal Hkv={k.shape[2]} (no GQA in own-sm100)")
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
        kernel = FlashAttentionForwardSm100(dtype, key[1], causal)
        _COMPILED[key] = cute.compile(kernel, *tensors, scale_log2, stream)
    _COMPILED[key](*tensors, scale_log2, stream)


def create() -> OwnSm100Adapter:
    return OwnSm100Adapter()
