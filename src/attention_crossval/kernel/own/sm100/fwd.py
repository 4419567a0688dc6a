"""The project's own SM100 (Blackwell) FlashAttention forward kernel, in CuTe DSL.

NEVER RUN: no Blackwell GPU is available to this project. The kernel is only compiled for
sm_100a on a CPU-only machine and its PTX inspected (tests/kernel/test_own_sm100.py); its
numerical results, its synchronisation (no hang, no race) and its speed are unverified.

FlashAttention-4 structure, 1-CTA, one 128-row Q tile per CTA (q_stage 1), 12 warps:

* warps 0-3, ``softmax``: one query row per thread. Per KV block: ``tcgen05.ld`` of the row of
  ``S`` from TMEM, the mask (kernel/own/common/mask.py) on blocks that need it, the online softmax
  with exp2 and the folded ``scale_log2`` (kernel/own/common/softmax.py, the code the H200 runs in
  the SM90 kernel), ``P`` converted to the input dtype and ``tcgen05.st`` back into TMEM where
  it aliases the upper half of ``S``; the O rescale factor goes to the correction warps
  through SMEM; at the end ``1 / row_sum`` (0 for an empty row) and the natural-log LSE;
* warps 4-7, ``correction``: one row of ``O`` per thread, rescaled in TMEM (``tcgen05.ld``,
  multiply, ``tcgen05.st``) between two PV MMAs when the row max moved; then ``epilogue``:
  ``O / row_sum`` from TMEM to global memory with a ``row < seqlen_q`` predicate, and the LSE;
  warp 4 allocates and frees the TMEM;
* warp 8, ``mma``: ``S = Q K^T`` (both operands in SMEM) and ``O += P V`` (P from TMEM, "TS")
  by ``tcgen05.mma``, completion signalled by ``tcgen05.commit``;
* warp 9, ``load``: TMA loads of Q once, then K and V blocks, last KV block first;
* warps 10-11 idle (setmaxnreg works per warpgroup). Registers (setmaxnreg, entry 168 for
  384 threads at one CTA per SM): softmax 240 (ptxas spills ~570 bytes at 192), correction
  128, MMA / load / idle 56.

TMEM (256 columns of 32 bits x 128 lanes; lane = query row): S in columns 0-127, P (16-bit,
two per column) in columns 64-127, O in columns 128-(128 + D). One S buffer: the QK MMA of block
j + 1 is issued after the PV MMA of block j, and tcgen05 MMAs of one thread run in issue order,
so P is read before S is overwritten. Kept simple rather than fast: no second S buffer (softmax
and the next QK MMA do not overlap), no second Q tile, no conditional rescale threshold, no TMA
store. Layouts as the SM90 kernel: q, k, v, o ``[B, S, H, D]`` with unit stride on D, lse
``[B, H, Sq]`` float32; B, H, Sq, Sk dynamic; D static (64 or 128); Hq == Hkv; bottom-right
causal or no mask.

Unverified (it needs hardware): every synchronisation (mbarrier phases, tcgen05.commit arrivals,
TMEM alloc/free), the in-order execution of tcgen05 MMAs this kernel relies on, the TMA
descriptors, and all numbers. What the CPU checks do show: it compiles for sm_100a to the
instructions above with 0 spill bytes, and the TMEM views give each thread one row of S, P and
O in column order, with P where the PV MMA reads it.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.tensor_utils import LayoutEnum

from attention_crossval.kernel.own.common.host import attention_views, compile_on_fake_tensors
from attention_crossval.kernel.own.common.mask import apply_mask, kv_block_range
from attention_crossval.kernel.own.common.params import (
    Mmas,
    Output,
    Participants,
    SmemLayouts,
    Tile,
    TmaLoads,
    TmaOperands,
    tma_operands,
)
from attention_crossval.kernel.own.common.softmax import OnlineSoftmax

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
HEAD_DIMS = (64, 128)
TILE_M = 128  # one query row per TMEM lane and per softmax / correction thread
TILE_N = 128
WG_THREADS = 128
# Warp roles.
SOFTMAX_WG, CORRECTION_WG = 0, 1
MMA_WARP, LOAD_WARP = 8, 9
NUM_THREADS = 3 * WG_THREADS
# TMEM columns (32-bit each).
S_COL = 0
P_COL = TILE_N // 2  # 16-bit P of TILE_N keys fills TILE_N / 2 columns: the upper half of S
O_COL = TILE_N
TMEM_COLS = 256
O_CHUNK = 32  # O columns per tcgen05.ld / tcgen05.st in the correction warps
# Named barriers (0 is __syncthreads).
TMEM_ALLOC_BARRIER, TMEM_FREE_BARRIER = 1, 2


def row_view(fragment: cute.Tensor) -> cute.Tensor:
    """``(1, n)`` ``(rows, cols)`` view of one thread's row fragment (register values or their
    coordinates), in the fragment's own element order: the shape kernel/common expects.
    Checked at trace time on CPU only (no SM100 GPU to run it)."""
    n = cute.size(fragment)
    layout = cute.composition(fragment.layout, cute.make_layout((1, n), stride=(0, 1)))
    return cute.make_tensor(fragment.iterator, layout)


class TmemTensors(NamedTuple):
    """The one TMEM allocation's views: ``S`` (fp32 accumulator), ``P`` (the 16-bit PV A
    operand aliasing S's upper half) and ``O`` (fp32 accumulator)."""

    tStS: cute.Tensor
    tOrP: cute.Tensor
    tOtO: cute.Tensor


class Handoffs(NamedTuple):
    """The pipelines between the warp roles, both sides of each: ``s_*`` MMA warp -> softmax (S
    is in TMEM; the softmax frees it once loaded), ``pv_*`` softmax and correction -> MMA warp
    (P is in TMEM and O rescaled; the PV MMA's commit says P is consumed and O up to date),
    ``stats_*`` softmax -> correction (per block the O rescale factor, at the end
    ``1 / row_sum`` and the LSE, through ``sStats``)."""

    s_mma: pipeline.PipelineProducer
    s_softmax: pipeline.PipelineConsumer
    pv_ready: pipeline.PipelineProducer
    pv_mma_use: pipeline.PipelineConsumer
    stats_put: pipeline.PipelineProducer
    stats_get: pipeline.PipelineConsumer
    sStats: cute.Tensor


class FlashAttentionForwardSm100:
    """Static knobs in ``__init__``; ``__call__`` is the host launch (a ``cute.jit`` function).

    Compile-only: no Blackwell GPU exists here, so nothing built from this class has ever run.
    """

    def __init__(self, dtype: str, head_dim: int, causal: bool, *, kv_stages: int = 2) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim={head_dim!r} must be one of {HEAD_DIMS}")
        if kv_stages < 1:
            raise ValueError(f"kv_stages={kv_stages!r} must be >= 1")
        self.dtype = DTYPES[dtype]
        self.head_dim = head_dim
        self.causal = causal
        self.kv_stages = kv_stages
        # setmaxnreg (per warpgroup): 384 threads start with at most 168 registers each.
        self.regs_softmax = 240  # a 128-value row of S and its P: ptxas spills at 192
        self.regs_correction = 128
        self.regs_other = 56

    # ------------------------------------------------------------------ host side

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        o: cute.Tensor,
        lse: cute.Tensor,
        scale_log2: Float32,
        stream: cuda.CUstream,
    ) -> None:
        """Launch on ``[B, S, H, D]`` q/k/v/o and ``[B, H, Sq]`` lse; ``scale_log2`` is
        ``softmax_scale * log2(e)``. Never launched: no SM100 GPU exists here."""
        mQ, mK, mV, mO, mLSE = attention_views(q, k, v, o, lse)

        dtype = self.dtype
        qk_tiler = (TILE_M, TILE_N, self.head_dim)
        pv_tiler = (TILE_M, self.head_dim, TILE_N)
        one_cta = tcgen05.CtaGroup.ONE
        k_major = cute.nvgpu.OperandMajorMode.K
        qk_mma = sm100_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, Float32, one_cta, qk_tiler[:2]
        )
        pv_mma = sm100_utils.make_trivial_tiled_mma(
            dtype,
            dtype,
            k_major,
            LayoutEnum.from_tensor(mV).mma_major_mode(),
            Float32,
            one_cta,
            pv_tiler[:2],
            tcgen05.OperandSource.TMEM,
        )
        sQ_layout = sm100_utils.make_smem_layout_a(qk_mma, qk_tiler, dtype, 1)
        sK_layout = sm100_utils.make_smem_layout_b(qk_mma, qk_tiler, dtype, self.kv_stages)
        sV_layout = sm100_utils.make_smem_layout_b(pv_mma, pv_tiler, dtype, self.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(pv_mma, pv_tiler, dtype, 1)

        load_op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(one_cta)
        one_stage = [0, 1, 2]
        tma_q, mQ_tma = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, mQ, cute.select(sQ_layout, mode=one_stage), qk_tiler, qk_mma
        )
        tma_k, mK_tma = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mK, cute.select(sK_layout, mode=one_stage), qk_tiler, qk_mma
        )
        tma_v, mV_tma = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, mV, cute.select(sV_layout, mode=one_stage), pv_tiler, pv_mma
        )
        self.q_bytes = cute.size_in_bytes(dtype, cute.select(sQ_layout, mode=one_stage))
        self.kv_bytes = cute.size_in_bytes(dtype, cute.select(sK_layout, mode=one_stage))

        stages = self.kv_stages

        @cute.struct
        class SharedStorage:
            q_bar: cute.struct.MemRange[cutlass.Int64, 2]
            k_bar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            v_bar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            s_bar: cute.struct.MemRange[cutlass.Int64, 2]
            pv_bar: cute.struct.MemRange[cutlass.Int64, 2]
            stats_bar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_base: Int32
            # per row: the O rescale factor of the current block, or 1 / row_sum and the LSE
            stats: cute.struct.MemRange[Float32, 2 * TILE_M]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(mQ.shape[0], TILE_M), mQ.shape[2], mQ.shape[3])
        self.kernel(
            Mmas(qk_mma, pv_mma),
            TmaLoads(tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma),
            Output(mO, mLSE),
            scale_log2,
            SmemLayouts(sQ_layout, sK_layout, sV_layout),
            tP_layout,
        ).launch(
            grid=grid,
            block=[NUM_THREADS, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,  # known entry register count, so setmaxnreg is honoured
        )

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(
        self,
        mmas: Mmas,
        tma: TmaLoads,
        out: Output,
        scale_log2: Float32,
        layouts: SmemLayouts,
        tP_layout: cute.ComposedLayout,
    ) -> None:
        """One CTA, one query tile: the warp roles of the module docstring."""
        qk_mma, pv_mma = mmas
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        row = tidx % WG_THREADS  # the query row (TMEM lane) of a softmax / correction thread

        storage = SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(layouts.q.outer, swizzle=layouts.q.inner)
        sK = storage.sK.get_tensor(layouts.k.outer, swizzle=layouts.k.inner)
        sV = storage.sV.get_tensor(layouts.v.outer, swizzle=layouts.v.inner)
        sStats = storage.stats.get_tensor(cute.make_layout(2 * TILE_M))

        def threads(n: int) -> pipeline.CooperativeGroup:
            return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)

        def tma_pipeline(barriers, num_stages: int, tx_count: int):  # load warp -> MMA warp
            return pipeline.PipelineTmaUmma.create(
                barrier_storage=barriers.data_ptr(),
                num_stages=num_stages,
                producer_group=threads(1),
                consumer_group=threads(1),
                tx_count=tx_count,
                defer_sync=True,
            ).make_participants()

        q_load, q_use = tma_pipeline(storage.q_bar, 1, self.q_bytes)
        k_load, k_use = tma_pipeline(storage.k_bar, self.kv_stages, self.kv_bytes)
        v_load, v_use = tma_pipeline(storage.v_bar, self.kv_stages, self.kv_bytes)
        # S full (tcgen05.commit after the QK MMA) -> softmax; softmax frees S once loaded.
        s_mma, s_softmax = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.s_bar.data_ptr(),
            num_stages=1,
            producer_group=threads(1),
            consumer_group=threads(WG_THREADS),
            defer_sync=True,
        ).make_participants()
        # PV may start once P is in TMEM (softmax) and O is rescaled (correction); the MMA's
        # tcgen05.commit after the PV MMA tells both that P is consumed and O is up to date.
        pv_ready, pv_mma_use = pipeline.PipelineAsyncUmma.create(
            barrier_storage=storage.pv_bar.data_ptr(),
            num_stages=1,
            producer_group=threads(2 * WG_THREADS),
            consumer_group=threads(1),
            defer_sync=True,
        ).make_participants()
        # softmax -> correction: per block the O rescale factor, at the end 1 / row_sum and LSE.
        stats_put, stats_get = pipeline.PipelineAsync.create(
            barrier_storage=storage.stats_bar.data_ptr(),
            num_stages=1,
            producer_group=threads(WG_THREADS),
            consumer_group=threads(WG_THREADS),
            defer_sync=True,
        ).make_participants()
        tmem = TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=TMEM_ALLOC_BARRIER, num_threads=2 * WG_THREADS + 32
            ),
            allocator_warp_id=CORRECTION_WG * 4,  # the last TMEM user frees it
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        ops = tma_operands(tma, sQ, sK, sV)
        handoffs = Handoffs(s_mma, s_softmax, pv_ready, pv_mma_use, stats_put, stats_get, sStats)
        seqlen_q = ops.mQ.shape[0]
        seqlen_k = ops.mK.shape[0]
        blocks = kv_block_range(m_block, seqlen_q, seqlen_k, TILE_M, TILE_N, self.causal)
        tile = Tile(m_block, head, batch, seqlen_q, seqlen_k, blocks)

        if wg_idx == SOFTMAX_WG:
            cute.arch.setmaxregister_increase(self.regs_softmax)
            tmem.wait_for_alloc()
            tmem_views = self.tmem_tensors(qk_mma, pv_mma, tP_layout, tmem.retrieve_ptr(Float32))
            self.softmax(qk_mma, tmem_views.tStS, handoffs, scale_log2, row, tile)
        if wg_idx == CORRECTION_WG:
            cute.arch.setmaxregister_decrease(self.regs_correction)
            tmem.allocate(TMEM_COLS)
            tmem.relinquish_alloc_permit()
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            tOtO = self.tmem_tensors(qk_mma, pv_mma, tP_layout, tmem_ptr).tOtO
            self.correction(pv_mma, tOtO, handoffs, row, tile.blocks[1])
            self.epilogue(pv_mma, tOtO, handoffs, out, row, tile)
            # Every TMEM access is over: the last PV MMA completed (pv_ready acquired in the
            # epilogue) and this warpgroup's loads of O are done.
            pipeline.NamedBarrier(
                barrier_id=TMEM_FREE_BARRIER, num_threads=WG_THREADS
            ).arrive_and_wait()
            tmem.free(tmem_ptr)
        if wg_idx == 2:
            cute.arch.setmaxregister_decrease(self.regs_other)
            if warp_idx == MMA_WARP:
                tmem.wait_for_alloc()
                tmem_views = self.tmem_tensors(
                    qk_mma, pv_mma, tP_layout, tmem.retrieve_ptr(Float32)
                )
                self.mma(
                    mmas, ops, tmem_views, Participants(q_use, k_use, v_use), handoffs,
                    tile.blocks[1],
                )  # fmt: skip
            if warp_idx == LOAD_WARP:
                self.load(mmas, ops, Participants(q_load, k_load, v_load), tile)

    @cute.jit
    def tmem_tensors(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tP_layout: cute.ComposedLayout,
        tmem_ptr: cute.Pointer,
    ) -> TmemTensors:
        """``S`` (fp32 accumulator), ``P`` (16-bit PV A operand aliasing S's upper half) and
        ``O`` (fp32 accumulator) in the one TMEM allocation starting at ``tmem_ptr``. Their
        layouts are checked at trace time on CPU; never run (no SM100 GPU)."""
        qk_thr, pv_thr = qk_mma.get_slice(0), pv_mma.get_slice(0)
        s_layout = qk_thr.make_fragment_C(qk_thr.partition_shape_C((TILE_M, TILE_N))).layout
        o_layout = pv_thr.make_fragment_C(pv_thr.partition_shape_C((TILE_M, self.head_dim))).layout
        tStS = cute.make_tensor(tmem_ptr + S_COL, s_layout)
        tOtO = cute.make_tensor(tmem_ptr + O_COL, o_layout)
        p_layout = pv_thr.make_fragment_A(cute.make_tensor(tStS.iterator, tP_layout.outer))[
            None, None, None, 0
        ].layout
        tOrP = cute.make_tensor(cute.recast_ptr(tmem_ptr + P_COL, dtype=self.dtype), p_layout)
        return TmemTensors(tStS, tOrP, tOtO)

    @cute.jit
    def load(self, mmas: Mmas, ops: TmaOperands, producers: Participants, tile: Tile) -> None:
        """TMA warp: Q once (only when the tile has a block: the MMA warp waits for it only
        then), then K and V of blocks ``n_block_max - 1`` down to 0. Rows past a sequence end
        are zero-filled by the TMA unit. Never run (no SM100 GPU)."""
        tma_q, mQ, sQ, tma_k, mK, sK, tma_v, mV, sV = ops
        q_load, k_load, v_load = producers
        m_block, head, batch, n_block_max = tile.m_block, tile.head, tile.batch, tile.blocks[1]
        qk_thr, pv_thr = mmas.qk.get_slice(0), mmas.pv.get_slice(0)
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, self.head_dim), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head, batch], (TILE_N, self.head_dim), (None, 0))
        gV = cute.local_tile(mV[None, None, head, batch], (self.head_dim, TILE_N), (0, None))
        no_mcast = cute.make_layout(1)
        tQsQ, tQgQ = cute.nvgpu.cpasync.tma_partition(
            tma_q,
            0,
            no_mcast,
            cute.group_modes(sQ, 0, 3),
            cute.group_modes(qk_thr.partition_A(gQ), 0, 3),
        )
        tKsK, tKgK = cute.nvgpu.cpasync.tma_partition(
            tma_k,
            0,
            no_mcast,
            cute.group_modes(sK, 0, 3),
            cute.group_modes(qk_thr.partition_B(gK), 0, 3),
        )
        tVsV, tVgV = cute.nvgpu.cpasync.tma_partition(
            tma_v,
            0,
            no_mcast,
            cute.group_modes(sV, 0, 3),
            cute.group_modes(pv_thr.partition_B(gV), 0, 3),
        )
        if n_block_max > 0:
            handle = q_load.acquire_and_advance()
            cute.copy(tma_q, tQgQ, tQsQ[None, handle.index], tma_bar_ptr=handle.barrier)
        for i in cutlass.range(n_block_max, unroll=1):
            n_block = n_block_max - 1 - i
            handle = k_load.acquire_and_advance()
            cute.copy(
                tma_k, tKgK[None, n_block], tKsK[None, handle.index], tma_bar_ptr=handle.barrier
            )
            handle = v_load.acquire_and_advance()
            cute.copy(
                tma_v, tVgV[None, n_block], tVsV[None, handle.index], tma_bar_ptr=handle.barrier
            )

    @cute.jit
    def mma(
        self,
        mmas: Mmas,
        ops: TmaOperands,
        tmem_views: TmemTensors,
        consumers: Participants,
        handoffs: Handoffs,
        n_block_max: Int32,
    ) -> None:
        """MMA warp: per block ``S = Q K^T`` into TMEM, then, once softmax and correction are
        done with the block, ``O += P V`` (O overwritten by the first block). Never run (no
        SM100 GPU): the in-order execution of one thread's tcgen05 MMAs, which keeps the next
        QK MMA from overwriting P before the PV MMA read it, is assumed, not observed."""
        qk_mma, pv_mma = mmas
        sQ, sK, sV = ops.sQ, ops.sK, ops.sV
        tStS, tOrP, tOtO = tmem_views
        q_use, k_use, v_use = consumers
        s_mma, pv_mma_use = handoffs.s_mma, handoffs.pv_mma_use
        tSrQ = qk_mma.make_fragment_A(sQ)
        tSrK = qk_mma.make_fragment_B(sK)
        tOrV = pv_mma.make_fragment_B(sV)
        if n_block_max > 0:
            q_handle = q_use.wait_and_advance()
            for i in cutlass.range(n_block_max, unroll=1):
                k_handle = k_use.wait_and_advance()
                s_handle = s_mma.acquire_and_advance()
                for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                    cute.gemm(
                        qk_mma,
                        tStS,
                        tSrQ[None, None, kb, q_handle.index],
                        tSrK[None, None, kb, k_handle.index],
                        tStS,
                    )
                s_handle.commit()
                k_handle.release()

                v_handle = v_use.wait_and_advance()
                pv_handle = pv_mma_use.wait_and_advance()
                for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    pv_mma.set(tcgen05.Field.ACCUMULATE, (i > 0) if kb == 0 else True)
                    cute.gemm(
                        pv_mma,
                        tOtO,
                        tOrP[None, None, kb],
                        tOrV[None, None, kb, v_handle.index],
                        tOtO,
                    )
                pv_handle.release()
                v_handle.release()
            q_handle.release()

    @cute.jit
    def softmax(
        self,
        qk_mma: cute.TiledMma,
        tStS: cute.Tensor,
        handoffs: Handoffs,
        scale_log2: Float32,
        row: Int32,
        tile: Tile,
    ) -> None:
        """Softmax warpgroup, thread ``row`` owns query row ``row`` of the tile. The mask and
        softmax code is the one the SM90 kernel runs on the H200; the TMEM traffic around it
        never ran (no SM100 GPU)."""
        s_softmax, pv_ready, stats_put = handoffs.s_softmax, handoffs.pv_ready, handoffs.stats_put
        sStats = handoffs.sStats
        m_block, seqlen_q, seqlen_k = tile.m_block, tile.seqlen_q, tile.seqlen_k
        n_block_max, n_block_unmasked = tile.blocks[1], tile.blocks[3]
        s_load, tSt, tSc = self.s_load_partition(qk_mma, tStS, row)
        p_store, tPt, tPc = self.p_store_partition(qk_mma, tStS, row)
        softmax = OnlineSoftmax(1, 1, scale_log2)  # one row per thread, no lane reduction
        alpha = cute.make_rmem_tensor(cute.make_layout(1), Float32)
        coords = row_view(tSc)
        for i in cutlass.range(n_block_max, unroll=1):
            n_block = n_block_max - 1 - i
            s_handle = s_softmax.wait_and_advance()
            rS = cute.make_rmem_tensor(tSc.shape, Float32)
            cute.copy(s_load, tSt, rS)
            cute.arch.fence_view_async_tmem_load()
            s_handle.release()

            scores = row_view(rS)
            if n_block >= n_block_unmasked:
                apply_mask(
                    scores,
                    coords,
                    m_block * TILE_M,
                    n_block * TILE_N,
                    seqlen_q,
                    seqlen_k,
                    self.causal,
                )
            softmax.update(scores, alpha)
            rP = cute.make_rmem_tensor(tPc.shape, Float32)  # 16-bit P, two per 32-bit value
            rP_16 = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype), rS.layout)
            rP_16.store(rS.load().to(self.dtype))

            pv_handle = pv_ready.acquire_and_advance()
            cute.copy(p_store, rP, tPt)
            cute.arch.fence_view_async_tmem_store()
            stats_handle = stats_put.acquire_and_advance()
            sStats[row] = alpha[0]
            stats_handle.commit()
            pv_handle.commit()

        inv_sum = cute.make_rmem_tensor(cute.make_layout(1), Float32)
        lse = cute.make_rmem_tensor(cute.make_layout(1), Float32)
        softmax.finalize(inv_sum, lse)
        stats_handle = stats_put.acquire_and_advance()
        sStats[row] = inv_sum[0]
        sStats[TILE_M + row] = lse[0]
        stats_handle.commit()

    @cute.jit
    def correction(
        self,
        pv_mma: cute.TiledMma,
        tOtO: cute.Tensor,
        handoffs: Handoffs,
        row: Int32,
        n_block_max: Int32,
    ) -> None:
        """Correction warpgroup: before the PV MMA of every block but the first, ``O *= alpha``
        in TMEM for its row (skipped when no row of the warp changed its max: multiplying by
        exactly 1 changes nothing). Never run (no SM100 GPU)."""
        pv_ready, stats_get, sStats = handoffs.pv_ready, handoffs.stats_get, handoffs.sStats
        o_load, o_store, tOt_load, tOt_store, tOc = self.o_partitions(pv_mma, tOtO, row)
        for i in cutlass.range(n_block_max, unroll=1):
            stats_handle = stats_get.wait_and_advance()
            alpha = sStats[row]
            stats_handle.release()
            pv_handle = pv_ready.acquire_and_advance()  # the previous PV MMA is complete
            if i > 0:
                if cute.arch.vote_ballot_sync(alpha != Float32(1.0)) != 0:
                    for c in cutlass.range_constexpr(self.head_dim // O_CHUNK):
                        rO = cute.make_rmem_tensor(tOc[None, 0, 0, c].shape, Float32)
                        cute.copy(o_load, tOt_load[None, 0, 0, c], rO)
                        for j in cutlass.range_constexpr(cute.size(rO)):
                            rO[j] = rO[j] * alpha
                        cute.copy(o_store, rO, tOt_store[None, 0, 0, c])
                    cute.arch.fence_view_async_tmem_store()
            pv_handle.commit()

    @cute.jit
    def epilogue(
        self,
        pv_mma: cute.TiledMma,
        tOtO: cute.Tensor,
        handoffs: Handoffs,
        out: Output,
        row: Int32,
        tile: Tile,
    ) -> None:
        """``O / row_sum`` (deferred normalization; 0 for empty rows, also when the tile had
        no block and TMEM holds garbage) to global memory, and the LSE, rows below
        ``seqlen_q`` only. Never run (no SM100 GPU)."""
        pv_ready, stats_get, sStats = handoffs.pv_ready, handoffs.stats_get, handoffs.sStats
        mO, mLSE = out.mO, out.mLSE
        m_block, head, batch, seqlen_q = tile.m_block, tile.head, tile.batch, tile.seqlen_q
        n_block_max = tile.blocks[1]
        o_load, _, tOt_load, _, tOc = self.o_partitions(pv_mma, tOtO, row)
        stats_handle = stats_get.wait_and_advance()
        inv_sum = sStats[row]
        lse = sStats[TILE_M + row]
        stats_handle.release()
        pv_ready.acquire_and_advance()  # the last PV MMA is complete

        gO = cute.local_tile(mO[None, None, head, batch], (TILE_M, self.head_dim), (m_block, 0))
        tOg = cute.logical_divide(
            pv_mma.get_slice(0).partition_C(gO), cute.make_layout((TILE_M, O_CHUNK))
        )
        tOg_row = o_load.get_slice(row).partition_D(tOg[(None, None), None])
        global_row = m_block * TILE_M + row
        for c in cutlass.range_constexpr(self.head_dim // O_CHUNK):
            rO = cute.make_rmem_tensor(tOc[None, 0, 0, c].shape, Float32)
            rO.fill(0.0)
            if n_block_max > 0:
                cute.copy(o_load, tOt_load[None, 0, 0, c], rO)
                for j in cutlass.range_constexpr(cute.size(rO)):
                    rO[j] = rO[j] * inv_sum
            rO_out = cute.make_rmem_tensor(rO.shape, self.dtype)
            rO_out.store(rO.load().to(self.dtype))
            if global_row < seqlen_q:
                cute.autovec_copy(rO_out, tOg_row[None, 0, 0, c])
        if global_row < seqlen_q:
            mLSE[global_row, head, batch] = lse
        cute.arch.fence_view_async_tmem_load()  # before the TMEM is freed

    # ------------------------------------------------------------------ TMEM copy partitions

    @cute.jit
    def s_load_partition(
        self, qk_mma: cute.TiledMma, tStS: cute.Tensor, row: Int32
    ) -> tuple[cute.TiledCopy, cute.Tensor, cute.Tensor]:
        """``tcgen05.ld.32x32b`` of row ``row`` of S: the tiled copy, the thread's TMEM source
        and the ``(row, key)`` coordinates its registers receive, in register order. Checked
        at trace time on CPU only (no SM100 GPU)."""
        atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        copy = tcgen05.make_tmem_copy(atom, tStS)
        thr = copy.get_slice(row)
        cS = qk_mma.get_slice(0).partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        return copy, thr.partition_S(tStS), thr.partition_D(cS)

    @cute.jit
    def p_store_partition(
        self, qk_mma: cute.TiledMma, tStS: cute.Tensor, row: Int32
    ) -> tuple[cute.TiledCopy, cute.Tensor, cute.Tensor]:
        """``tcgen05.st.32x32b`` of row ``row`` of P (16-bit pairs as 32-bit values) into S's
        upper half: the tiled copy, the TMEM destination and the ``(row, column)`` coordinates
        (32-bit columns from ``P_COL``) of the registers it sends. Checked at trace time on
        CPU only (no SM100 GPU)."""
        p_cols = TILE_N * self.dtype.width // 32
        narrow = cute.make_layout((TILE_M, p_cols))
        tStP = cute.make_tensor(tStS.iterator + P_COL, cute.composition(tStS.layout, narrow))
        cS = qk_mma.get_slice(0).partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        cP = cute.make_tensor(cS.iterator, cute.composition(cS.layout, narrow))
        atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        copy = tcgen05.make_tmem_copy(atom, tStP)
        thr = copy.get_slice(row)
        return copy, thr.partition_D(tStP), thr.partition_S(cP)

    @cute.jit
    def o_partitions(
        self, pv_mma: cute.TiledMma, tOtO: cute.Tensor, row: Int32
    ) -> tuple[cute.TiledCopy, cute.TiledCopy, cute.Tensor, cute.Tensor, cute.Tensor]:
        """``tcgen05.ld`` / ``tcgen05.st`` of row ``row`` of O in ``O_CHUNK``-column chunks:
        both tiled copies, the TMEM source and destination per chunk, and the ``(row, column)``
        coordinates per chunk (mode 3 indexes the chunk). Checked at trace time on CPU only
        (no SM100 GPU)."""
        chunk = cute.make_layout((TILE_M, O_CHUNK))
        tOt = cute.logical_divide(tOtO, chunk)
        cO = pv_mma.get_slice(0).partition_C(cute.make_identity_tensor((TILE_M, self.head_dim)))
        cO = cute.logical_divide(cO, chunk)
        load_atom = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32
        )
        store_atom = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32
        )
        load = tcgen05.make_tmem_copy(load_atom, tOt[(None, None), 0])
        store = tcgen05.make_tmem_copy(store_atom, tOt[(None, None), 0])
        load_thr, store_thr = load.get_slice(row), store.get_slice(row)
        return (
            load,
            store,
            load_thr.partition_S(tOt[(None, None), None]),
            store_thr.partition_D(tOt[(None, None), None]),
            load_thr.partition_D(cO[(None, None), None]),
        )

    # ------------------------------------------------------------------ compile-only

    def compile(self, *, options: str = "") -> object:
        """Compile for sm_100a on fake tensors: the only check this kernel has, since there is
        no Blackwell GPU to run it on."""
        return compile_on_fake_tensors(self, self.dtype, "sm_100a", options)
