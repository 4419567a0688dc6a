"""The project's own SM90 WGMMA forward kernel (kernel/own/sm90/fwd.py) on a Hopper GPU, as two
registered adapters over the same kernel.

Both declare everything the kernel implements: fp16/bf16, D = 64 or 128 (Dv = D), GQA/MQA,
bottom-right causal, varlen (``q_lengths`` / ``k_lengths`` in the padded layout, passed as
per-batch lengths; rows past ``q_lengths`` are left unwritten) and sliding windows with or
without causal (no explicit masks), LSE natural log in ``[B, Hq, Sq]``, empty rows O = 0 and
LSE = -inf, FlashAttention's precision chain (fp32 S and accumulators, P rounded to the input
dtype, row_sum from the fp32 p, O rounded once). ``own-sm90`` runs a case that needs none of
GQA, lengths or a window on the kernel's dense path (:func:`takes_dense_path`) and the others
on its varlen path; ``own-sm90-full`` runs every case on the varlen path (full lengths where the
case has none), so that the suite puts that path through every case it draws. A varlen-path
case compiles one of 16 variants: (dtype, D, causal, window).

Both adapters have run on the H200 under the kernel suite and the targeted cases, with the
present :data:`DEFAULT_KNOBS` and without knobs; docs/results-h200.md has the runs and their
commands.

The kernel variant: both adapters run :data:`DEFAULT_KNOBS` (``overlap``: intra-warpgroup
overlap of the softmax with the WGMMAs; ``pingpong``: the consumer warpgroups take turns
issuing their WGMMAs; ``longest_first``: causal and windowed tiles in decreasing work order;
``smem_epilogue``: O through shared memory and a TMA store; ``m192``: three consumer warpgroups,
192-row query tiles, at D = 64), unless the environment variable
``ATTENTION_CROSSVAL_SM90_OVERLAP`` says otherwise when they launch: ``baseline`` or ``0`` the
kernel without knobs, ``1`` overlap alone, ``pingpong`` overlap with ping-pong, ``default`` or
empty the default, or a comma-separated list of :data:`KNOBS` names, exactly those on
(``pingpong`` bringing ``overlap``), e.g. ``overlap,persistent``. ``persistent`` (one
CTA per SM looping over the tiles; not with ``pingpong`` nor ``smem_epilogue``) stays opt-in:
it has run only in benchmarks/bench_own_sm90.py, never under the property tests.
Benchmarks choose a variant directly with the knob arguments of :func:`launch` and
:func:`launch_full`, where a knob left out is off (no knobs: the baseline kernel).

Kernels are compiled once per variant and cached for the process, and launched through TVM-FFI
(kernel/adapters/_cute.py); B, H, Sq, Sk and all strides are dynamic, so guard-banded views go
straight to the kernel. torch and cutlass are imported
only inside calls (CI without either can still import this module).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache, partial
from typing import Any

from attention_crossval.kernel.adapters import _cute, _torch
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, Mask

NUM_CONSUMER_WG = 2  # 128-row query tiles (three, 192 rows, at D = 64 with m192)
ROWS_PER_WG = 64  # query rows per consumer warpgroup (the WGMMA M extent)
TILE_N = 128
# own-sm90-full adds lengths and window bounds to row indices in int32 (kernel/own/common/mask.py):
# every sum stays below 2 Sq + Sk, inside int32 with both lengths at most 2^29.
FULL_MAX_SEQLEN = 1 << 29
# The kernel's compile-time knobs the adapters pass through (kernel/own/sm90/fwd.py), all off in
# the kernel and in launch() unless named; each combination is compiled and cached apart.
KNOBS = ("overlap", "pingpong", "longest_first", "smem_epilogue", "persistent", "m192")
# The registered adapters' default variant: one set of knobs for every configuration, the one
# benchmarks/bench_own_sm90.py found best or close to it on each row (docs/results-h200.md).
DEFAULT_KNOBS = ("overlap", "pingpong", "longest_first", "smem_epilogue", "m192")
# The registered adapters' kernel variant (switch): value -> launch knobs; unset is "".
OVERLAP_ENV = "ATTENTION_CROSSVAL_SM90_OVERLAP"
ENV_VARIANTS: dict[str, dict[str, bool]] = {
    "": dict.fromkeys(DEFAULT_KNOBS, True),
    "default": dict.fromkeys(DEFAULT_KNOBS, True),
    "0": {},
    "baseline": {},
    "1": {"overlap": True},
    "pingpong": {"overlap": True, "pingpong": True},
}


def knobs_from_env() -> dict[str, bool]:
    """The knobs :data:`OVERLAP_ENV` asks for: one of :data:`ENV_VARIANTS` (unset or empty is
    :data:`DEFAULT_KNOBS`, ``baseline`` or ``0`` no knob), or a comma-separated list of
    :data:`KNOBS` names, exactly those turned on (``pingpong`` implies ``overlap``, as its single
    value does). Anything else is an error naming the variable and the allowed values (a typo
    must not silently test the default)."""
    value = os.environ.get(OVERLAP_ENV, "")
    if value in ENV_VARIANTS:
        return dict(ENV_VARIANTS[value])
    names = [name.strip() for name in value.split(",")]
    unknown = [name for name in names if name not in KNOBS]
    if unknown:
        raise ValueError(
            f"{OVERLAP_ENV}={value!r}: unknown {unknown}; use one of {sorted(ENV_VARIANTS)} or a "
            f"comma-separated list of {list(KNOBS)}"
        )
    knobs = dict.fromkeys(names, True)
    if knobs.get("pingpong"):
        knobs["overlap"] = True
    return knobs


def _spec() -> KernelSpec:
    """``own-sm90``: everything the kernel implements, GQA/MQA, varlen (padded rows left
    unwritten) and sliding windows included."""
    return replace(
        # tile_m: the row unit every query tile is a multiple of (128 rows, or 192 at D = 64
        # with ``m192``), so the strategies' lengths cluster on every tile edge.
        _cute.own_kernel_spec("own-sm90", tile_m=ROWS_PER_WG, tile_n=TILE_N),
        gqa=True,
        mask_kinds=frozenset({"causal", "window", "varlen"}),
        padded_rows="unwritten",
        max_seqlen=FULL_MAX_SEQLEN,
    )


def _full_spec() -> KernelSpec:
    return replace(_spec(), name="own-sm90-full")


def takes_dense_path(case: AttentionCase) -> bool:
    """Whether ``own-sm90`` runs ``case`` on the kernel's dense path (Hq == Hkv, no lengths,
    no window: no per-batch length loads), rather than the varlen path that ``own-sm90-full``
    takes for every case."""
    return case.Hq == case.Hkv and not case.mask.kinds & {"window", "varlen"}


def window_bounds(mask: Mask, Sq: int, Sk: int) -> tuple[int, int] | None:
    """The ``(left, right)`` window the kernel takes, or None without a window: None sides
    become unbounded and every side is clamped to the padded extents (right <= Sq,
    left <= Sk), which sees the same keys (reference/masks.py) and keeps the kernel's index
    sums inside int32."""
    if "window" not in mask.kinds:
        return None
    left = Sk if mask.window_left is None else min(mask.window_left, Sk)
    right = Sq if mask.window_right is None else min(mask.window_right, Sq)
    return left, right


@dataclass
class OwnSm90Adapter(_torch.GuardedOutputsAdapter):
    """Guard-banded inputs, prefilled and guard-banded ``o`` / ``lse``, one launch per call:
    the dense path where :func:`takes_dense_path`, else the varlen path."""

    spec: KernelSpec = field(default_factory=_spec)

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        if takes_dense_path(case):
            launch(
                q, k, v, out, lse, case.softmax_scale, causal=case.mask.causal, **knobs_from_env(),
            )  # fmt: skip
        else:
            _launch_varlen_path(case, q, k, v, out, lse)


@dataclass
class OwnSm90FullAdapter(_torch.GuardedOutputsAdapter):
    """``own-sm90-full``: the same kernel and declaration, every case on the varlen path (full
    lengths where the case has none), so that path meets every case the suite draws."""

    spec: KernelSpec = field(default_factory=_full_spec)

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        _launch_varlen_path(case, q, k, v, out, lse)


def _launch_varlen_path(case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
    q_lengths, k_lengths = (
        _torch.int32_tensor([length(b) for b in range(case.B)], q.device)
        for length in (case.q_length, case.k_length)
    )
    window = window_bounds(case.mask, case.Sq, case.Sk)
    launch_full(
        q, k, v, out, lse, case.softmax_scale, case.mask.causal, q_lengths, k_lengths, window,
        **knobs_from_env(),
    )  # fmt: skip


def launch(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    softmax_scale: float,
    *,
    causal: bool,
    num_sms: int | None = None,
    **knobs: bool,
) -> None:
    """Run the kernel on torch CUDA tensors (see :func:`kernel.adapters._cute.launch`);
    ``knobs`` (names from :data:`KNOBS`: ``overlap``, ``pingpong``, ``longest_first``,
    ``smem_epilogue``, ``persistent``, the kernel's knobs of those names, and ``m192``, 192-row
    query tiles at D = 64 (:func:`consumer_warpgroups`); off when left out) pick the variant
    (each compiled and cached apart). No knobs is the baseline kernel, not the
    adapters' default: a benchmark gets exactly the variant it names, and
    ``**dict.fromkeys(DEFAULT_KNOBS, True)`` (or :func:`knobs_from_env`) is what the adapters
    run. ``num_sms`` caps the persistent grid (default: the device's SM count; ignored without
    ``persistent``)."""
    _launch("own-sm90", q, k, v, out, lse, softmax_scale, causal, knobs, num_sms)


def launch_full(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    softmax_scale: float,
    causal: bool,
    q_lengths: Any,
    k_lengths: Any,
    window: tuple[int, int] | None,
    *,
    num_sms: int | None = None,
    **knobs: bool,
) -> None:
    """``own-sm90-full``'s launch: Hq a multiple of Hkv, int32 ``[B]`` CUDA lengths
    (the padded extents where a case has none), ``window`` from :func:`window_bounds`;
    the knobs and ``num_sms`` as in :func:`launch`."""
    _launch(
        "own-sm90-full", q, k, v, out, lse, softmax_scale, causal, knobs, num_sms, gqa=True,
        lengths=(q_lengths, k_lengths), window=window,
    )  # fmt: skip


def _launch(
    name: str,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    softmax_scale: float,
    causal: bool,
    knobs: dict[str, bool],
    num_sms: int | None,
    **full: Any,
) -> None:
    """What :func:`launch` and :func:`launch_full` share: the knobs checked, the output's
    alignment for ``smem_epilogue``, the persistent grid cap, one cached compile per variant;
    ``full`` holds ``own-sm90-full``'s GQA, lengths and window. Per call this is two dict
    lookups and, under ``smem_epilogue``, the stride check: a launch costs less host time than
    a short kernel runs (benchmarks/bench_launch_host.py)."""
    variant, build = _VARIANTS.get(tuple(knobs.items())) or _variant_of(knobs)
    if "smem_epilogue" in variant:
        _check_out_alignment(out)
    max_ctas = _max_ctas(q, num_sms) if "persistent" in variant else None
    _cute.launch(
        name, build, q, k, v, out, lse, softmax_scale, causal=causal, variant=variant,
        max_ctas=max_ctas, **full,
    )  # fmt: skip


# The knobs as passed (their items, in order) -> the variant (the names turned on, in
# :data:`KNOBS` order: the compile-cache key part) and its kernel factory, for this process.
_VARIANTS: dict[tuple[tuple[str, bool], ...], tuple[tuple[str, ...], Callable[..., Any]]] = {}


def _variant_of(knobs: dict[str, bool]) -> tuple[tuple[str, ...], Callable[..., Any]]:
    """The :data:`_VARIANTS` entry of ``knobs``, made on their first use: unknown names refused
    (a misspelt knob must not run the baseline kernel under a variant's name)."""
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"unknown knobs {unknown}: the kernel's are {list(KNOBS)}")
    variant = tuple(name for name in KNOBS if knobs.get(name))
    entry = _VARIANTS[tuple(knobs.items())] = (
        variant,
        partial(make_kernel, **dict.fromkeys(variant, True)),
    )
    return entry


def _check_out_alignment(out: Any) -> None:
    """``smem_epilogue`` stores O in 16-byte pieces (a TMA store, or 16-byte chunks of rows
    under varlen), which the kernel compiles assuming: ``out`` 16-byte aligned, its S, H and B
    strides multiples of 16 bytes (the TMA loads need the same of q, k and v)."""
    per_chunk = 16 // out.element_size()
    strides = out.stride()
    if out.data_ptr() % 16 or any(strides[i] % per_chunk for i in range(3)):
        raise ValueError(
            f"smem_epilogue needs out 16-byte aligned with strides in multiples of {per_chunk} "
            f"elements but for the last: data_ptr % 16 = {out.data_ptr() % 16}, strides "
            f"{tuple(strides)}"
        )


def _max_ctas(q: Any, num_sms: int | None) -> int:
    """The persistent kernel's grid cap: ``num_sms``, or the SM count of ``q``'s device (132 on
    an H100 SXM or H200)."""
    if num_sms is None:
        num_sms = _sm_count(q.device)
    if num_sms < 1:
        raise ValueError(f"num_sms={num_sms} must be >= 1")
    return int(num_sms)


@cache
def _sm_count(device: Any) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def consumer_warpgroups(head_dim: int, m192: bool) -> int:
    """The kernel's consumer warpgroups (64 query rows each): 3 at D = 64 with the ``m192``
    knob (192-row tiles, flash_attn.cute's SM90 choice there), else :data:`NUM_CONSUMER_WG`."""
    return 3 if m192 and head_dim == 64 else NUM_CONSUMER_WG


def make_kernel(
    dtype: str, head_dim: int, causal: bool, *, m192: bool = False, **knobs: bool
) -> Any:
    from attention_crossval.kernel.own.sm90.fwd import FlashAttentionForwardSm90

    return FlashAttentionForwardSm90(
        dtype,
        head_dim,
        causal,
        num_consumer_wg=consumer_warpgroups(head_dim, m192),
        tile_n=TILE_N,
        **knobs,
    )


def create() -> OwnSm90Adapter:
    return OwnSm90Adapter()


def create_full() -> OwnSm90FullAdapter:
    return OwnSm90FullAdapter()
