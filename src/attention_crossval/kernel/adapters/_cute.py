"""Launching the project's own CuTe DSL kernels from torch tensors, shared by every own kernel.

Each own kernel declares the same base feature set (fp16/bf16, D = 64 or 128, Hq == Hkv,
bottom-right causal or no mask, natural-log LSE) and is launched the same way: check shapes,
wrap the torch tensors for CuTe with dynamic layouts, compile once per (dtype, D, causal) per
process, run on the current stream. A kernel that takes more (GQA, varlen lengths, a window:
the SM90 kernel as ``own-sm90-full``) gets them through the same call, and the presence of the
lengths and of the window is part of the compile key. torch and cutlass are imported only
inside calls.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import CausalAlignment

# (kernel name, dtype, D, causal, varlen, window, variant) -> compiled kernel, for this process
_COMPILED: dict[tuple[str, str, int, bool, bool, bool, Hashable], Any] = {}


def own_kernel_spec(name: str, *, tile_m: int, tile_n: int) -> KernelSpec:
    """The declaration every own kernel shares: exactly what they implement, nothing more."""
    return KernelSpec(
        name=name,
        dtypes=frozenset({"float16", "bfloat16"}),
        head_dims=frozenset({64, 128}),
        mask_kinds=frozenset({"causal"}),
        causal_alignment=CausalAlignment.BOTTOM_RIGHT,
        gqa=False,
        tile_m=tile_m,
        tile_n=tile_n,
        returns_lse=True,
        device="cuda",
        deterministic=True,
    )


def launch(
    name: str,
    make_kernel: Callable[[str, int, bool], Any],
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    softmax_scale: float,
    *,
    causal: bool,
    gqa: bool = False,
    lengths: tuple[Any, Any] | None = None,
    window: tuple[int, int] | None = None,
    variant: Hashable = None,
    max_ctas: int | None = None,
) -> None:
    """Run kernel ``name`` on torch CUDA tensors ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``,
    ``out`` like q and ``lse [B, Hq, Sq]`` (fp32) on the current stream.
    ``make_kernel(dtype, D, causal)`` builds the kernel object on first use of that combination
    in this process.

    For a kernel that takes them (kernel/own/sm90/fwd.py): ``gqa`` allows Hq a multiple of Hkv;
    ``lengths`` are int32 ``[B]`` CUDA tensors of the valid q and k lengths (padded layout);
    ``window`` is ``(left, right)``, clamped as :func:`kernel.adapters.own_sm90.window_bounds`
    does. Lengths and window go to the kernel as trailing arguments (None when absent).
    ``variant`` names the compile-time knobs ``make_kernel`` builds in (e.g. the SM90 kernel's
    ``overlap``); it is part of the compile cache key, so variants of one kernel coexist.
    ``max_ctas`` (the SM90 kernel's ``persistent`` grid cap) goes last as an ``Int32`` (the
    lengths and window then None where absent); a runtime value, not part of the key."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    from attention_crossval.kernel.own.common.softmax import LOG2_E

    Hq, Hkv = q.shape[2], k.shape[2]
    if (Hq % Hkv if gqa else Hq != Hkv) or not Hkv:
        wanted = "a multiple of" if gqa else "equal to (no GQA in this kernel)"
        raise ValueError(f"Hq={Hq} must be {wanted} Hkv={Hkv} in {name}")
    if k.shape != v.shape or q.shape[::3] != k.shape[::3] or out.shape != q.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out "
            f"{tuple(out.shape)}: k and v must match, q/k share B and D, out must match q"
        )
    dtype = str(q.dtype).removeprefix("torch.")
    key = (
        name, dtype, int(q.shape[-1]), bool(causal), lengths is not None, window is not None,
        variant,
    )  # fmt: skip
    tensors = [
        from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.ndim - 1)
        for t in (q, k, v, out)
    ]
    tensors.append(from_dlpack(lse, assumed_align=4).mark_layout_dynamic(leading_dim=2))
    args = [*tensors, cutlass.Float32(softmax_scale * LOG2_E)]
    args.append(cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    if lengths is not None or window is not None or max_ctas is not None:  # optional, trailing
        for values, wrap in (
            (lengths, lambda t: from_dlpack(t, assumed_align=4).mark_layout_dynamic(leading_dim=0)),
            (window, cutlass.Int32),
        ):
            args += [None, None] if values is None else [wrap(value) for value in values]
    if max_ctas is not None:
        args.append(cutlass.Int32(max_ctas))
    if key not in _COMPILED:
        kernel = make_kernel(dtype, key[2], key[3])
        _COMPILED[key] = cute.compile(kernel, *args)
    _COMPILED[key](*args)
