"""Find a kernel adapter by built-in name or by dotted path ``package.module:attr``.

A user's kernel outside this repository plugs in without edits: ``--kernel mypkg.fa:adapter``
where ``attr`` is an adapter instance (an object with ``spec`` and ``__call__(case)``) or a
zero-argument factory returning one. Nothing here imports torch.

User kernels run in a worker process (:class:`kernel.harness.isolation.IsolatedKernel`), factory
included; only the built-ins in :data:`IN_PROCESS` run in the caller's process by default.
:func:`kernel.harness.isolation.describe` gives a kernel's declaration either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import reprlib

from attention_crossval.kernel.contract.spec import KernelAdapter, KernelSpec

OWN_KERNEL_MODULES = ("cutlass", "tvm_ffi")
# name -> (dotted path of a zero-arg factory, module(s) whose presence makes it available)
BUILTIN: dict[str, tuple[str, str | tuple[str, ...] | None]] = {
    "streaming-fa": ("attention_crossval.kernel.adapters.streaming:create", None),
    "sdpa-math": ("attention_crossval.kernel.adapters.sdpa:math", "torch"),
    "sdpa-flash": ("attention_crossval.kernel.adapters.sdpa:flash", "torch"),
    "sdpa-efficient": ("attention_crossval.kernel.adapters.sdpa:efficient", "torch"),
    "sdpa-cudnn": ("attention_crossval.kernel.adapters.sdpa:cudnn", "torch"),
    "flash-attn-cute": (
        "attention_crossval.kernel.adapters.flash_attn_cute:create",
        "flash_attn.cute",
    ),
    # the same kernel with deterministic=True in its backward (a backward-suite variant)
    "flash-attn-cute-deterministic": (
        "attention_crossval.kernel.adapters.flash_attn_cute:deterministic",
        "flash_attn.cute",
    ),
    # torch.compile'd FlexAttention: a CUDA kernel (spec.device "cuda"), available with torch
    "flex-attention": ("attention_crossval.kernel.adapters.flex:create", "torch"),
    # the own kernels compile with CuTe DSL and launch through TVM-FFI (adapters/_cute.py)
    "own-sm90": ("attention_crossval.kernel.adapters.own_sm90:create", OWN_KERNEL_MODULES),
    # the same kernel declaring GQA, varlen and windows (run on the H200)
    "own-sm90-full": (
        "attention_crossval.kernel.adapters.own_sm90:create_full",
        OWN_KERNEL_MODULES,
    ),
    # its FP8 forward (e4m3/e5m2, descales, bf16 out)
    "own-sm90-fp8": ("attention_crossval.kernel.adapters.own_sm90_fp8:create", OWN_KERNEL_MODULES),
    "own-sm100": (
        "attention_crossval.kernel.adapters.own_sm100:create",
        OWN_KERNEL_MODULES,
    ),  # compile-only: no SM100 here
    # a small Triton FP8 forward (testing/broken/triton_fp8.py): constants that never clamp P,
    # and FA4's e4m3 constants, which do (a fixture the suite must fail)
    "triton-fp8": ("attention_crossval.testing.broken.triton_fp8:fixed", "triton"),
    "triton-fp8-fa4": ("attention_crossval.testing.broken.triton_fp8:fa4_constants", "triton"),
}
# Built-ins that run in the caller's process unless told otherwise: project code with no native
# part that could crash or hang (the streaming tier); every other kernel gets a worker process.
IN_PROCESS = frozenset({"streaming-fa"})
GPU_BUILTIN = tuple(name for name in BUILTIN if name != "streaming-fa")
# Built-ins whose forward is another built-in's: in the backward suite's defaults only.
BACKWARD_VARIANTS = frozenset({"flash-attn-cute-deterministic"})
# Built-ins not shown to pass on a GPU: never run there, or run and failing the kernel suite.
# Reachable with --kernel only, so a default GPU run neither fails on them nor vouches for them;
# a built-in leaves this set once its kernel suite passes on a GPU (own-sm90-full, own-sm90-fp8
# and triton-fp8 did: docs/results-h200.md). own-sm100, never run, is kept out of the defaults
# on other GPUs by REQUIRED_COMPUTE_MAJOR instead.
UNPROVEN: frozenset[str] = frozenset()
# Built-ins that are deliberately broken: fixtures a suite must fail, reachable with --kernel
# only, never in the defaults.
BROKEN_FIXTURES = frozenset({"triton-fp8-fa4"})
# Built-ins that run on one GPU generation only (compute capability major): left out of the
# defaults on other GPUs, where they would decline every case; still reachable with --kernel.
REQUIRED_COMPUTE_MAJOR = {"own-sm100": 10}


def factory_path(name_or_path: str) -> str:
    """The ``package.module:attr`` of a built-in name or dotted path, checked without importing.

    >>> factory_path("streaming-fa")
    'attention_crossval.kernel.adapters.streaming:create'
    """
    if not isinstance(name_or_path, str):
        raise ValueError(f"kernel={reprlib.repr(name_or_path)} must be a str")
    path = BUILTIN[name_or_path][0] if name_or_path in BUILTIN else name_or_path
    module_name, colon, attr = path.partition(":")
    if not (colon and module_name and attr):
        raise ValueError(
            f"kernel={name_or_path!r} must be a built-in name ({', '.join(BUILTIN)}) "
            "or a dotted path package.module:attr"
        )
    return path


def resolve(name_or_path: str) -> KernelAdapter:
    """The adapter for a built-in name or ``package.module:attr``, built in this process (the
    user's module and factory run here: use :class:`kernel.harness.isolation.IsolatedKernel` or
    :func:`kernel.harness.isolation.describe` to keep them out).

    >>> resolve("streaming-fa").spec.device
    'cpu'
    """
    path = factory_path(name_or_path)
    module_name, _, attr = path.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except Exception as error:  # noqa: BLE001 - any failure at import is a kernel that cannot load
        raise ValueError(
            f"kernel={name_or_path!r}: cannot load {path} ({type(error).__name__}: {error})"
        ) from error
    adapter = target
    if callable(target) and not isinstance(target, KernelAdapter):
        try:
            adapter = target()
        except Exception as error:  # noqa: BLE001 - any failure of a user's factory is a bad name
            raise ValueError(
                f"kernel={name_or_path!r}: {path} must be an adapter or a zero-argument factory "
                f"returning one; calling it raised {type(error).__name__}: {error}"
            ) from error
    if not isinstance(adapter, KernelAdapter):
        raise ValueError(
            f"kernel={name_or_path!r}: {path} must be an adapter (spec + __call__(case)) or a "
            f"zero-argument factory returning one, got {type(adapter).__name__}"
        )
    if not isinstance(adapter.spec, KernelSpec):
        raise ValueError(
            f"kernel={name_or_path!r}: {path}.spec must be a KernelSpec, "
            f"got {type(adapter.spec).__name__}"
        )
    return adapter


def available(names: tuple[str, ...] = tuple(BUILTIN)) -> list[str]:
    """Built-in names whose packages are importable here (a GPU may still be missing)."""
    return [name for name in names if _importable(BUILTIN[name][1])]


def default_kernels(has_gpu: bool, *, backward: bool = False) -> list[str]:
    """What ``--kernel`` means when not given: every available GPU adapter that can run on
    this GPU (see :data:`REQUIRED_COMPUTE_MAJOR`; the :data:`BACKWARD_VARIANTS` only for the
    backward; never the :data:`UNPROVEN` nor the :data:`BROKEN_FIXTURES` ones), else the CPU
    one."""
    if not has_gpu:
        return ["streaming-fa"]
    names = [
        name
        for name in available(GPU_BUILTIN)
        if name not in UNPROVEN | BROKEN_FIXTURES and _runs_on_this_gpu(name)
    ]
    return [name for name in names if backward or name not in BACKWARD_VARIANTS]


def _runs_on_this_gpu(name: str) -> bool:
    from attention_crossval.kernel.harness.gpu_workers import cuda_available

    major = REQUIRED_COMPUTE_MAJOR.get(name)
    if major is None or not cuda_available()[0]:
        return True  # no GPU to ask: gpu tests are skipped anyway
    import torch

    return torch.cuda.get_device_capability()[0] == major


def _importable(modules: str | tuple[str, ...] | None) -> bool:
    """Whether every one of ``modules`` can be imported (None: nothing is needed)."""
    if modules is None:
        return True
    try:
        return all(
            importlib.util.find_spec(module) is not None
            for module in ((modules,) if isinstance(modules, str) else modules)
        )
    except ModuleNotFoundError:
        return False
