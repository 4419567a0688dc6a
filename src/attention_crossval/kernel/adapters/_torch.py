"""Moving cases to torch and back, with the defensive buffers the harness relies on.

Imported only by torch adapters, and torch itself only inside functions, so the package stays
importable on a CPU-only machine without torch.

Guard layout: every device tensor of shape ``[B, S, H, X]`` is a view ``buf[:, G:G + S]`` into
a buffer ``[B, G + S + G, H, X]``; for ``lse [B, H, S]`` the guard is on the last axis. Inputs'
guards hold NaN (a kernel that reads past a sequence end gets NaN into its output); outputs
are prefilled (NaN or zero) and their guards hold a NaN with a recognisable bit pattern, so any
write outside the view shows up bitwise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_crossval.reference.case import (
    BIT_VIEWED,
    FP8_DTYPES,
    INPUT_DTYPES,
    AttentionCase,
    AttentionResult,
    as_bits,
)

GUARD = 128  # rows of guard band on each side of every sequence (>= any tile_m)
# Guard fill bit patterns: quiet NaNs with a payload no arithmetic is likely to produce.
_GUARD_BITS = {"float16": 0x7E5A, "bfloat16": 0x7FDA, "float32": 0x7FC0A5A5}
_INT_VIEW = {"float16": "int16", "bfloat16": "int16", "float32": "int32"}


# FP8 buffers are filled with a NaN byte (0x7F: a NaN in both formats).
_FP8_NAN = 0x7F


def torch_dtype(name: str) -> Any:
    import torch

    if name not in INPUT_DTYPES:
        raise ValueError(f"dtype={name!r} has no torch dtype here")
    return getattr(torch, name)


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def to_device(array: np.ndarray, device: str = "cuda", *, guard: int = GUARD) -> Any:
    """Copy a ``[B, S, H, X]`` input to ``device`` inside a NaN guard band along S."""
    import torch

    name = array.dtype.name
    # torch.from_numpy refuses ml_dtypes arrays: their bits cross, viewed as torch's dtype
    host = np.ascontiguousarray(as_bits(array) if name in BIT_VIEWED else array)
    with warnings.catch_warnings():  # a read-only case array: copy_ below only reads it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        source = torch.from_numpy(host)  # no host copy: a 4 GiB K is copied once, to the device
    if name in BIT_VIEWED:
        source = source.view(torch_dtype(name))
    B, S, H, X = array.shape
    shape = (B, S + 2 * guard, H, X)
    if name in FP8_DTYPES:  # NaN through the bits: no fill kernel for FP8 needed
        buf = torch.full(shape, _FP8_NAN, dtype=torch.uint8, device=device).view(source.dtype)
    else:
        buf = torch.full(shape, float("nan"), dtype=source.dtype, device=device)
    view = buf[:, guard : guard + S]
    view.copy_(source)
    return view


@dataclass
class GuardedOutput:
    """An output view inside a guard-banded buffer; :meth:`guard_writes` lists violations."""

    buf: Any
    view: Any
    axis: int  # the guarded axis of ``buf``
    guard: int

    @classmethod
    def allocate(
        cls,
        shape: tuple[int, ...],
        dtype: str,
        *,
        axis: int,
        prefill: str,
        device: str = "cuda",
        guard: int = GUARD,
    ) -> GuardedOutput:
        """Allocate with ``prefill`` ("nan" or "zero") inside and the guard pattern outside."""
        import torch

        if prefill not in ("nan", "zero"):
            raise ValueError(f"prefill={prefill!r} must be 'nan' or 'zero'")
        padded = list(shape)
        padded[axis] += 2 * guard
        buf = torch.empty(padded, dtype=torch_dtype(dtype), device=device)
        buf.view(getattr(torch, _INT_VIEW[dtype])).fill_(_signed(_GUARD_BITS[dtype], dtype))
        view = buf.narrow(axis, guard, shape[axis])
        view.fill_(float("nan") if prefill == "nan" else 0.0)
        return cls(buf, view, axis, guard)

    def guard_writes(self, name: str) -> list[str]:
        """Descriptions of guard elements that no longer hold the guard pattern."""
        import torch

        dtype = _dtype_name(self.buf)
        bits = self.buf.view(getattr(torch, _INT_VIEW[dtype]))
        size = self.buf.shape[self.axis]
        changed = []
        for start, label in ((0, "before"), (size - self.guard, "after")):
            band = bits.narrow(self.axis, start, self.guard)
            bad = band != _signed(_GUARD_BITS[dtype], dtype)
            if bool(bad.any()):
                first = [int(i) for i in torch.nonzero(bad)[0]]
                offset = (
                    first[self.axis] - self.guard if label == "before" else first[self.axis] + 1
                )
                first[self.axis] = offset
                changed.append(
                    f"{name}: {int(bad.sum())} guard elements written {label} the valid range "
                    f"(first at guarded axis offset {offset}, index {first})"
                )
        return changed


def _signed(bits: int, dtype: str) -> int:
    width = 32 if dtype == "float32" else 16
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def to_host(tensor: Any) -> np.ndarray:
    """float64 NumPy copy of a device tensor (exact for 16-bit and fp32 values)."""
    return tensor.detach().to("cpu", dtype=tensor.dtype).double().numpy()


# Harness checks (kernel.contract.checks.ADAPTER_CHECKS) a guarded adapter supports: prefilled
# outputs give
# ``unwritten``, their guard bands ``output-guard``; NaN input guard bands make reads past a
# tensor's end show up as ``nonfinite``; padding may be poisoned (``padding-read``).
GUARDED_CHECKS = frozenset(
    {"output-guard", "unwritten", "padding-read", "determinism", "nonfinite"}
)


def int32_tensor(values: Any, device: str = "cuda") -> Any:
    """An int32 device tensor (offsets, lengths, a page table)."""
    import torch

    return torch.as_tensor(np.asarray(values, dtype=np.int32), device=device)


def float32_tensor(values: Any, device: str = "cuda") -> Any:
    """A float32 device tensor (e.g. a learnable sink per head)."""
    import torch

    return torch.as_tensor(np.asarray(values, dtype=np.float32), device=device)


def call_tensors(case: AttentionCase, device: str = "cuda") -> tuple[Any, Any, Any, dict]:
    """``(q, k, v, options)`` on ``device`` in the layout the case's call options ask for
    (:mod:`kernel.contract.call_options`): padded ``[B, S, H, X]`` views, or packed ``[total, H,
    X]``
    views (NaN guard bands along the rows either way), or K/V pages ``[num_pages, page_size,
    H, X]`` (NaN-poisoned unused pages, no guard band). ``options`` holds what the layout adds,
    named as flash_attn.cute names them: ``cu_seqlens_q/k`` and ``max_seqlen_q/k`` (packed),
    ``page_table`` and ``seqused_k`` (paged); empty for a plain case."""
    from attention_crossval.kernel.contract.call_options import packed_layout, paged_layout

    packed, paged = packed_layout(case), paged_layout(case)
    options: dict[str, Any] = {}
    if packed is None:
        q = to_device(case.q, device)
    else:
        q = to_device(packed.q[None], device)[0]
        options |= {"cu_seqlens_q": int32_tensor(packed.cu_seqlens_q, device)}
        options |= {"max_seqlen_q": packed.max_seqlen_q}
    if paged is not None:
        k, v = (to_device(pages, device, guard=0) for pages in (paged.k_pages, paged.v_pages))
        options |= {"page_table": int32_tensor(paged.page_table, device)}
        options |= {"seqused_k": int32_tensor(paged.k_lengths, device)}
    elif packed is not None:
        k, v = (to_device(x[None], device)[0] for x in (packed.k, packed.v))
        options |= {"cu_seqlens_k": int32_tensor(packed.cu_seqlens_k, device)}
        options |= {"max_seqlen_k": packed.max_seqlen_k}
    else:
        k, v = to_device(case.k, device), to_device(case.v, device)
    return q, k, v, options


class GuardedOutputsAdapter:
    """Base for adapters whose kernel writes into caller-allocated ``o`` / ``lse``.

    That is what lets the harness prefill the outputs (NaN or zero) and surround them and the
    inputs with guard bands (:data:`GUARDED_CHECKS`). Subclasses provide ``spec`` and
    :meth:`launch`; the device transfers, guards and synchronisation live here, once. A case
    with call options (declared by the spec) is handed over in their layout
    (:func:`call_tensors`), its outputs packed ``o [total_q, Hq, Dv]`` / ``lse [Hq, total_q]``
    for ``layout="packed"``, and ``launch`` gets the layout's tensors as keywords.
    """

    checks: frozenset[str] = GUARDED_CHECKS
    device: str = "cuda"  # "cpu" runs a Triton kernel under TRITON_INTERPRET=1 (tests)

    def launch(
        self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any, **layout: Any
    ) -> None:
        """Run the kernel on guarded device views ``q, k, v``, writing ``out`` and ``lse``;
        ``layout`` holds the call options' tensors (:func:`call_tensors`)."""
        raise NotImplementedError

    def __call__(self, case: AttentionCase) -> AttentionResult:
        return self.run_guarded(case, prefill="zero")[0]

    def run_guarded(
        self, case: AttentionCase, *, prefill: str
    ) -> tuple[AttentionResult, tuple[str, ...]]:
        """One launch with ``prefill``ed outputs; returns the result and any guard writes."""
        import torch

        from attention_crossval.reference.varlen import unpack_result

        device = self.device
        q, k, v, layout = call_tensors(case, device)
        if case.layout == "packed":
            total_q = q.shape[0]
            out = GuardedOutput.allocate(
                (total_q, case.Hq, case.Dv), case.out_dtype, axis=0, prefill=prefill, device=device
            )
            lse = GuardedOutput.allocate(
                (case.Hq, total_q), "float32", axis=1, prefill=prefill, device=device
            )
        else:
            out = GuardedOutput.allocate(
                (case.B, case.Sq, case.Hq, case.Dv),
                case.out_dtype,
                axis=1,
                prefill=prefill,
                device=device,
            )
            lse = GuardedOutput.allocate(
                (case.B, case.Hq, case.Sq), "float32", axis=2, prefill=prefill, device=device
            )
        self.launch(case, q, k, v, out.view, lse.view, **layout)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        writes = tuple(out.guard_writes("o") + lse.guard_writes("lse"))
        o_host, lse_host = to_host(out.view), to_host(lse.view)
        if case.layout == "packed":
            return unpack_result(case, o_host, lse_host), writes
        return AttentionResult(o=o_host, lse=lse_host), writes
