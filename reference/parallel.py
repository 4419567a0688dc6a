"""The CPU reference tiers of a long case, one (batch, query head) per process.

Attention rows are independent, and so are the exact tier, the streaming emulation and the
bound of every (batch, query head): each runs on a *head case* (batch b and query head h alone,
with its kv head, lengths, sink and explicit-mask slice) in a forked worker that inherits the
case, so nothing but the (b, h) index and the compact result crosses a pipe. On a 16-core host
this divides the CPU phases of a long case by up to 16 (docs/long-context.md#parallel).

Each worker runs its BLAS on one thread (``threadpoolctl``): the workers already share the
cores, and a BLAS that sizes its pool to the machine in every worker oversubscribes it. That
happens where numpy is loaded before ``OPENBLAS_NUM_THREADS=1`` can take effect (a pytest plugin
importing it first): the likely reason why the bound of a 64k prefill took 20.9 s under pytest on
the H200's 16-core host and 1.5 s in the benchmark, which sets the variable first (not yet
confirmed there).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from attention_crossval.reference.case import AttentionCase, Mask

_JOB: tuple[AttentionCase, Callable[[AttentionCase, int, int], Any]] | None = None
_LIMITS: list[Any] = []  # the worker's BLAS limit, kept for the worker's life


def _one_blas_thread() -> None:
    """Pool initializer: this worker's BLAS on one thread, whatever the parent's pool size."""
    from threadpoolctl import threadpool_limits

    _LIMITS.append(threadpool_limits(limits=1, user_api="blas"))


def head_case(case: AttentionCase, b: int, h: int) -> AttentionCase:
    """Batch ``b`` and query head ``h`` of ``case`` as a case of its own (B = Hq = Hkv = 1)."""
    mask = case.mask
    lengths = {
        name: None if getattr(mask, name) is None else (getattr(mask, name)[b],)
        for name in ("q_lengths", "k_lengths")
    }
    explicit = mask.explicit
    if explicit is not None:  # [B|1, Hq|1, Sq, Sk]: this batch's and head's plane
        eb, eh = min(b, explicit.shape[0] - 1), min(h, explicit.shape[1] - 1)
        explicit = explicit[eb : eb + 1, eh : eh + 1]
    sub_mask = Mask(
        causal=mask.causal,
        window_left=mask.window_left,
        window_right=mask.window_right,
        alignment=mask.alignment,
        explicit=explicit,
        **lengths,
    )
    kv = case.kv_head(h)
    return dataclasses.replace(  # every other field (softcap, call options) carried along
        case,
        q=case.q[b : b + 1, :, h : h + 1],
        k=case.k[b : b + 1, :, kv : kv + 1],
        v=case.v[b : b + 1, :, kv : kv + 1],
        mask=sub_mask,
        sink=None if case.sink is None else case.sink[h : h + 1],
    )


def _run(index: tuple[int, int]) -> Any:
    case, function = _JOB
    return function(head_case(case, *index), *index)


def map_heads(
    case: AttentionCase,
    function: Callable[[AttentionCase, int, int], Any],
    heads: list[tuple[int, int]],
    *,
    workers: int | None = None,
) -> list[Any]:
    """``[function(head_case(case, b, h), b, h) for (b, h) in heads]``, in forked worker
    processes when ``workers`` (None: the CPU count) and the head count allow, else here.
    ``function`` must not use CUDA (a forked child cannot)."""
    global _JOB
    count = min(len(heads), workers or os.cpu_count() or 1)
    if count <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [function(head_case(case, b, h), b, h) for b, h in heads]
    _JOB = (case, function)
    try:
        with multiprocessing.get_context("fork").Pool(count, _one_blas_thread) as pool:
            return pool.map(_run, heads, chunksize=1)
    finally:
        _JOB = None
