"""The parameter objects the own kernels' roles take, so that each role function names a handful
of arguments rather than twenty: what travels together from the launch to the roles.

All are ``NamedTuple``: CuTe DSL passes a tuple as a kernel argument leaf by leaf, in field
order (``None`` fields contribute nothing), and rebuilds it inside the kernel, so grouping the
arguments of a ``@cute.kernel`` changes nothing in the generated code but the order of its
parameters, which follows the fields. The ``@cute.jit`` roles receive them as plain Python
objects at trace time; they unpack the pipeline participants and MMAs they advance or rebind
into local names, which the DSL carries through dynamic control flow.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32


class Mmas(NamedTuple):
    """The two tiled MMAs: ``S = Q K^T`` and ``O += P V``."""

    qk: cute.TiledMma
    pv: cute.TiledMma


class TmaLoads(NamedTuple):
    """Q, K and V in global memory, each as its TMA atom and the TMA view it copies from (the
    launch makes them; the kernel adds the shared-memory stages: :class:`TmaOperands`)."""

    tma_q: cute.CopyAtom
    mQ: cute.Tensor
    tma_k: cute.CopyAtom
    mK: cute.Tensor
    tma_v: cute.CopyAtom
    mV: cute.Tensor


class SmemLayouts(NamedTuple):
    """The shared-memory stage layouts of Q, K and V (static: no kernel parameter)."""

    q: cute.ComposedLayout
    k: cute.ComposedLayout
    v: cute.ComposedLayout


class TmaOperands(NamedTuple):
    """Q, K and V: each one's TMA atom, its TMA view in global memory and its shared-memory
    stages (the load warp reads all three; the MMA issuers the stages)."""

    tma_q: cute.CopyAtom
    mQ: cute.Tensor
    sQ: cute.Tensor
    tma_k: cute.CopyAtom
    mK: cute.Tensor
    sK: cute.Tensor
    tma_v: cute.CopyAtom
    mV: cute.Tensor
    sV: cute.Tensor


def tma_operands(loads: TmaLoads, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor) -> TmaOperands:
    """``loads`` with the shared-memory stages each one fills."""
    tma_q, mQ, tma_k, mK, tma_v, mV = loads
    return TmaOperands(tma_q, mQ, sQ, tma_k, mK, sK, tma_v, mV, sV)


class Output(NamedTuple):
    """Where the epilogue writes: O, the LSE, and O's TMA store atom (the SM90 kernel's
    ``smem_epilogue`` without varlen, else None)."""

    mO: cute.Tensor
    mLSE: cute.Tensor
    tma_o: cute.CopyAtom | None = None


class Participants(NamedTuple):
    """One role's side of the Q, K and V pipelines (all producers or all consumers)."""

    q: pipeline.PipelineProducer | pipeline.PipelineConsumer
    k: pipeline.PipelineProducer | pipeline.PipelineConsumer
    v: pipeline.PipelineProducer | pipeline.PipelineConsumer


class Tile(NamedTuple):
    """One query tile's work: its coordinates, its batch's lengths, the KV blocks it visits
    (:func:`~attention_crossval.kernel.own.common.mask.kv_block_range`: ``n_block_min,
    n_block_max, n_unmasked_min, n_unmasked_max``), and the key bounds the mask and the V-row
    zeroing read: ``extent_k`` the K/V rows when V rows past ``seqlen_k`` must be zeroed
    (varlen), else None; ``window`` ``(left, right)``, or ``(None, None)``."""

    m_block: Int32
    head: Int32
    batch: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    blocks: tuple[Int32, Int32, Int32, Int32]
    extent_k: Int32 | None = None
    window: tuple[Int32 | None, Int32 | None] = (None, None)
