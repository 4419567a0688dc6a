"""The CPU reference tiers of a long case, a few (batch, query head) pairs per process.

Attention rows are independent, and so are the exact tier, the streaming emulation and the
bound of every (batch, query head): each runs on a *unit case* (batch b and consecutive query
heads of one kv head, with that kv head, lengths, sink and explicit-mask slice) in a forked
worker that inherits the case, so nothing but the unit's indices and the compact results cross
a pipe. On a 16-core host this divides the CPU phases of a long case by up to 16
(docs/long-context.md#parallel). A unit holds as many heads of a GQA group as still leaves every
worker a unit: the tiers then prepare the group's K and V (128k keys: about 0.5 s of fresh
float64 pages each) once, not once per query head.

Each worker runs its BLAS on one thread (``threadpoolctl``): the workers already share the
cores, and a BLAS that sizes its pool to the machine in every worker oversubscribes it. That
happens where numpy is loaded before ``OPENBLAS_NUM_THREADS=1`` can take effect (a pytest plugin
importing it first): the bound of a 64k prefill took 20.9 s under pytest on the H200's 16-core
host before, 2.6 s with the limit (docs/results-h200.md).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from attention_crossval.reference.case import AttentionCase, Mask

_JOB: tuple[AttentionCase, Callable[[AttentionCase, int, tuple[int, ...]], list[Any]]] | None = None
_LIMITS: list[Any] = []  # the worker's BLAS limit, kept for the worker's life


def _one_blas_thread() -> None:
    """Pool initializer: this worker's BLAS on one thread, whatever the parent's pool size."""
    from threadpoolctl import threadpool_limits

    _LIMITS.append(threadpool_limits(limits=1, user_api="blas"))


def unit_case(case: AttentionCase, b: int, heads: tuple[int, ...]) -> AttentionCase:
    """Batch ``b`` and the consecutive query ``heads`` of one kv head as a case of its own
    (B = Hkv = 1, Hq = len(heads)): K and V are read, and converted by the tiers, once for
    all of them."""
    h0, h1 = heads[0], heads[-1] + 1
    if list(heads) != list(range(h0, h1)) or len({case.kv_head(h) for h in heads}) != 1:
        raise ValueError(f"heads {heads} must be consecutive query heads of one kv head")
    mask = case.mask
    lengths = {
        name: None if getattr(mask, name) is None else (getattr(mask, name)[b],)
        for name in ("q_lengths", "k_lengths")
    }
    explicit = mask.explicit
    if explicit is not None:  # [B|1, Hq|1, Sq, Sk]: this batch's and heads' planes
        eb = min(b, explicit.shape[0] - 1)
        planes = slice(0, 1) if explicit.shape[1] == 1 else slice(h0, h1)
        explicit = explicit[eb : eb + 1, planes]
    sub_mask = Mask(
        causal=mask.causal,
        window_left=mask.window_left,
        window_right=mask.window_right,
        alignment=mask.alignment,
        explicit=explicit,
        **lengths,
    )
    kv = case.kv_head(h0)
    return dataclasses.replace(  # every other field (softcap, call options) carried along
        case,
        q=case.q[b : b + 1, :, h0:h1],
        k=case.k[b : b + 1, :, kv : kv + 1],
        v=case.v[b : b + 1, :, kv : kv + 1],
        mask=sub_mask,
        sink=None if case.sink is None else case.sink[h0:h1],
        **case.unit_descales(b, kv),
    )


def work_units(
    case: AttentionCase, heads: list[tuple[int, int]], workers: int
) -> list[tuple[int, tuple[int, ...]]]:
    """``heads`` ((b, h) pairs, in order) as ``(b, query heads)`` units: runs of consecutive
    heads of one batch and kv head, each at most ``len(heads) / workers`` long, so that every
    worker still gets a unit while a GQA group's K and V are prepared once, not per head."""
    size = max(1, len(heads) // max(workers, 1))
    units: list[tuple[int, list[int]]] = []
    for b, h in heads:
        if units:
            last_b, run = units[-1]
            same_kv = case.kv_head(run[-1]) == case.kv_head(h)
            if last_b == b and run[-1] + 1 == h and same_kv and len(run) < size:
                run.append(h)
                continue
        units.append((b, [h]))
    return [(b, tuple(run)) for b, run in units]


def _run(unit: tuple[int, tuple[int, ...]]) -> list[Any]:
    case, function = _JOB
    b, heads = unit
    return function(unit_case(case, b, heads), b, heads)


def map_heads(
    case: AttentionCase,
    function: Callable[[AttentionCase, int, tuple[int, ...]], list[Any]],
    heads: list[tuple[int, int]],
    *,
    workers: int | None = None,
) -> list[Any]:
    """One result per ``(b, h)`` of ``heads``, in order: ``function(unit_case(case, b, hs), b,
    hs)`` returns the list for the heads ``hs`` of each :func:`work_units` unit. Units run in
    forked worker processes when ``workers`` (None: the CPU count) and the head count allow,
    else here. ``function`` must not use CUDA (a forked child cannot)."""
    global _JOB
    count = min(len(heads), workers or os.cpu_count() or 1)
    units = work_units(case, heads, count)
    if count <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        results = [function(unit_case(case, b, hs), b, hs) for b, hs in units]
    else:
        _JOB = (case, function)
        try:
            with multiprocessing.get_context("fork").Pool(count, _one_blas_thread) as pool:
                results = pool.map(_run, units, chunksize=1)
        finally:
            _JOB = None
    for (_, hs), found in zip(units, results, strict=True):
        if len(found) != len(hs):
            raise ValueError(f"function returned {len(found)} results for the {len(hs)} heads {hs}")
    return [result for found in results for result in found]
