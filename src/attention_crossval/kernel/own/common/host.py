"""Host-side pieces every own kernel shares: the CuTe views of the project layout, and the
compile-only build on fake tensors. Both run at trace time on the host.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from attention_crossval.kernel.own.common.softmax import LOG2_E


def attention_views(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor
) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor, cute.Tensor, cute.Tensor]:
    """``[B, S, H, D]`` q/k/v/o and ``[B, H, Sq]`` lse as the kernels index them: (s, d, h, b)
    for Q, K and O; (d, s, h, b) for V (the PV B operand is MN-major); (s, h, b) for the LSE."""
    mQ = cute.make_tensor(q.iterator, cute.select(q.layout, mode=[1, 3, 2, 0]))
    mK = cute.make_tensor(k.iterator, cute.select(k.layout, mode=[1, 3, 2, 0]))
    mV = cute.make_tensor(v.iterator, cute.select(v.layout, mode=[3, 1, 2, 0]))
    mO = cute.make_tensor(o.iterator, cute.select(o.layout, mode=[1, 3, 2, 0]))
    mLSE = cute.make_tensor(lse.iterator, cute.select(lse.layout, mode=[2, 1, 0]))
    return mQ, mK, mV, mO, mLSE


def fake_arguments(
    dtype: type,
    *,
    varlen: bool = False,
    window: bool = False,
    max_ctas: int | None = None,
    env_stream: bool = False,
    fp8: bool = False,
) -> tuple:
    """The arguments an own kernel compiles on without a GPU, typed like the adapters' runtime
    ones: q, k, v, o of ``dtype`` with every extent and stride dynamic but D's unit stride (as
    ``from_dlpack(t).mark_layout_dynamic(leading_dim=3)`` gives), lse ``[B, H, Sq]`` float32,
    ``scale_log2`` and a fake stream. ``env_stream``: under TVM-FFI the stream is no argument
    but the caller's current stream (torch's, read by TVM-FFI at each call).

    ``varlen`` / ``window`` add the trailing arguments such a kernel takes: the per-batch int32
    lengths ``seqused_q`` / ``seqused_k`` and the ``Int32`` window bounds (None when off).
    ``max_ctas`` (a kernel that takes it: the SM90 kernel's persistent grid cap) goes after them
    as an ``Int32``, the lengths and bounds then passed as None where off.

    ``fp8`` (the SM90 kernel's FP8 inputs): v has unit stride along S instead of D (keys
    contiguous, as the FP8 WGMMA reads V), o is bfloat16, and three float32 ``[B, Hkv]``
    descales go last (the other trailing arguments None where off)."""
    from cutlass import BFloat16, Int32
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    def qkv(element: type = dtype, unit_stride_dim: int = 3) -> object:
        shape = tuple(cute.sym_int() for _ in range(4))
        strides = tuple(1 if i == unit_stride_dim else cute.sym_int64() for i in range(4))
        return make_fake_tensor(element, shape, strides, assumed_align=16)

    lse = make_fake_tensor(
        Float32,
        (cute.sym_int(), cute.sym_int(), cute.sym_int()),
        (cute.sym_int64(), cute.sym_int64(), 1),
        assumed_align=4,
    )
    stream = make_fake_stream(use_tvm_ffi_env_stream=env_stream)
    v = qkv(unit_stride_dim=1) if fp8 else qkv()
    o = qkv(BFloat16) if fp8 else qkv()
    args: tuple = (qkv(), qkv(), v, o, lse, Float32(LOG2_E), stream)
    if varlen or window or max_ctas is not None or fp8:
        lengths = [
            make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4) if varlen else None
            for _ in range(2)
        ]
        bounds = [Int32(0) if window else None] * 2
        args += (*lengths, *bounds)
    if max_ctas is not None or fp8:
        args += (None if max_ctas is None else Int32(max_ctas),)
    if fp8:
        args += tuple(
            make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int()), (cute.sym_int64(), 1))
            for _ in range(3)
        )
    return args


def compile_on_fake_tensors(
    kernel: object,
    dtype: type,
    arch: str | None,
    options: str = "",
    *,
    varlen: bool = False,
    window: bool = False,
    max_ctas: int | None = None,
    tvm_ffi: bool = False,
    fp8: bool = False,
) -> object:
    """``cute.compile`` of ``kernel`` for ``arch`` (e.g. ``sm_90a``) on :func:`fake_arguments`
    (``varlen``, ``window``, ``max_ctas`` and ``fp8`` as there). Never touches a GPU; with ``arch``
    ``--gpu-arch`` is passed, so it does not depend on ``CUTE_DSL_ARCH`` (None: the DSL's
    choice, ``CUTE_DSL_ARCH`` or the GPU's).

    ``tvm_ffi``: the adapters' launch build (``--enable-tvm-ffi``, the stream taken from the
    caller's current stream). Its compiled function takes torch tensors and Python scalars
    directly, every parameter positional but the stream, and checks each tensor's dtype, rank,
    device, unit D stride and 16-byte alignment (4 for lse and lengths) in C++."""
    args = fake_arguments(
        dtype, varlen=varlen, window=window, max_ctas=max_ctas, env_stream=tvm_ffi, fp8=fp8
    )
    flags = [f"--gpu-arch={arch}" if arch else "", "--enable-tvm-ffi" if tvm_ffi else "", options]
    return cute.compile(kernel, *args, options=" ".join(flag for flag in flags if flag))
