"""Launching the project's own CuTe DSL kernels from torch tensors, shared by every own kernel.

Each own kernel declares the same base feature set (fp16/bf16, D = 64 or 128, Hq == Hkv,
bottom-right causal or no mask, natural-log LSE) and is launched the same way: check shapes,
compile once per (dtype, D, causal) per process with TVM-FFI on fake tensors whose extents and
strides are dynamic, and pass the torch tensors straight to the compiled function, which runs
on torch's current stream. A kernel that takes more (GQA, varlen lengths, a window: the SM90
kernel as ``own-sm90-full``) gets them through the same call, and the presence of the lengths
and of the window is part of the compile key. The launch is generic in the kernel's dtype: the
fake tensors take the kernel object's ``dtype``. TVM-FFI (``apache-tvm-ffi``) takes torch
tensors through torch's DLPack exchange API (torch >= 2.10, or ``torch-c-dlpack-ext``), which
also hands it the current stream. torch and cutlass are imported only inside calls.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.phases import phase
from attention_crossval.kernel.own.sm90.fp8_layout import padded_keys
from attention_crossval.reference.case import CausalAlignment
from attention_crossval.reference.precision import LOG2_E

# (kernel name, torch dtype, D, causal, varlen, window, variant, max_ctas given, FP8 descales
# given) -> the compiled function and its None padding (:func:`compiled`), for this process
_COMPILED: dict[tuple, tuple[Any, tuple]] = {}


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
    descales: tuple[Any, Any, Any] | None = None,
) -> None:
    """Run kernel ``name`` on torch CUDA tensors ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``,
    ``out`` like q and ``lse [B, Hq, Sq]`` (fp32) on torch's current stream.
    ``make_kernel(dtype, D, causal)`` builds the kernel object on first use of that combination
    in this process.

    For a kernel that takes them (kernel/own/sm90/fwd.py): ``gqa`` allows Hq a multiple of Hkv;
    ``lengths`` are int32 ``[B]`` CUDA tensors of the valid q and k lengths (padded layout);
    ``window`` is ``(left, right)``, clamped as :func:`kernel.adapters.own_sm90.window_bounds`
    does. Lengths and window go to the kernel as trailing arguments (None when absent).
    ``variant`` names the compile-time knobs ``make_kernel`` builds in (e.g. the SM90 kernel's
    ``overlap``); it is part of the compile cache key, so variants of one kernel coexist.
    ``max_ctas`` (the SM90 kernel's ``persistent`` grid cap) goes last as an ``Int32`` (the
    lengths and window then None where absent); its presence is part of the key, its value a
    runtime one. ``descales`` (the SM90 kernel's FP8 inputs: q, k and v descales, float32
    ``[B, Hkv]``) go after it, the others then None where absent; ``v`` is then the launcher's
    keys-contiguous copy, ``[B, padded_keys(Sk), Hkv, D]``
    (:func:`kernel.adapters.own_sm90_fp8.keys_contiguous_v`), and ``out`` bf16.

    The call is TVM-FFI's (:func:`compiled`): the tensors go to the compiled function as they
    are, with no per-call wrapping, and the function checks them in C++; what is left in Python
    is the head and shape check below (TVM-FFI would not name the rule) and one dict lookup."""
    q_shape, k_shape = q.shape, k.shape  # each read builds a torch.Size: once per call
    B, Sq, Hq, D = q_shape
    Hkv = k_shape[2]
    if (Hq % Hkv if gqa else Hq != Hkv) or not Hkv:
        wanted = "a multiple of" if gqa else "equal to (no GQA in this kernel)"
        raise ValueError(f"Hq={Hq} must be {wanted} Hkv={Hkv} in {name}")
    v_shape = k_shape if descales is None else (B, padded_keys(k_shape[1]), Hkv, D)
    if (
        v.shape != v_shape
        or k_shape[0] != B
        or k_shape[3] != D
        or out.shape != q_shape
        or lse.shape != (B, Hq, Sq)
    ):
        raise ValueError(
            f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v.shape)}, out "
            f"{tuple(out.shape)}, lse {tuple(lse.shape)}: k and v must match, q/k share B and "
            f"D, out must match q, lse must be [B, Hq, Sq]"
        )
    key = (
        name, q.dtype, D, bool(causal), lengths is not None, window is not None, variant,
        max_ctas is not None, descales is not None,
    )  # fmt: skip
    entry = _COMPILED.get(key)
    if entry is None:
        with phase("compile"):
            entry = _COMPILED[key] = compiled(key, make_kernel)
    function, padding = entry
    args = (q, k, v, out, lse, softmax_scale * LOG2_E)
    if lengths is not None or window is not None or max_ctas is not None or descales is not None:
        args += (*(lengths or (None, None)), *(window or (None, None)), max_ctas)  # trailing
    if descales is not None:
        args += tuple(descales)
    function(*args, *padding[len(args) :])


def compiled(key: tuple, make_kernel: Callable[[str, int, bool], Any]) -> tuple[Any, tuple]:
    """The cache entry of :func:`launch`'s ``key``: the kernel compiled with TVM-FFI on fake
    tensors (kernel/own/common/host.py; the same build the CPU tests compile and inspect), as the
    bare ``tvm_ffi.Function`` (positional only: the DSL's wrapper around it, which fills in
    defaults by keyword, costs a Python frame per call), and a None per parameter but the
    stream, whose tail pads a call that leaves optional parameters out (each compiled in as
    absent). The arch is the DSL's: ``CUTE_DSL_ARCH``, else the GPU's."""
    import inspect
    import os

    from attention_crossval.kernel.own.common.host import compile_on_fake_tensors

    name, torch_dtype, head_dim, causal, varlen, window, _, capped, fp8 = key
    kernel = make_kernel(str(torch_dtype).removeprefix("torch."), int(head_dim), bool(causal))
    compiled_kernel = compile_on_fake_tensors(
        kernel, kernel.dtype, None, varlen=varlen, window=window,
        max_ctas=1 if capped else None, tvm_ffi=True, fp8=fp8,
    )  # fmt: skip
    function = compiled_kernel.__tvm_ffi_object__()
    if function is None:  # the DSL loads no build for an arch other than the runtime's
        raise RuntimeError(
            f"{name}: compiled for another arch than this process runs (CUTE_DSL_ARCH="
            f"{os.environ.get('CUTE_DSL_ARCH')!r}); unset it or set it to this GPU's"
        )
    parameters = len(inspect.signature(kernel.__call__).parameters) - 1  # the stream is TVM-FFI's
    return function, (None,) * parameters
