"""The project's own SM90 (Hopper) FlashAttention forward kernel, in CuTe DSL.

Structure (one CTA per ``tile_m`` query rows of one (batch, head)):

* warpgroup 0, warp 0 (:meth:`~FlashAttentionForwardSm90.load`): TMA loads of the Q tile, then
  K and V blocks through two ``PipelineTmaAsync`` rings (``kv_stages`` deep), last KV block
  first;
* warpgroups 1..``num_consumer_wg`` (:meth:`~FlashAttentionForwardSm90.consume`), 64 query rows
  each: ``S = Q K^T`` by WGMMA with both operands in SMEM (SS), the mask
  (kernel/own/common/mask.py) on blocks that need it, the online softmax with exp2
  (kernel/own/common/softmax.py), ``O *= alpha``, ``P`` converted to the input dtype in registers
  and ``O += P V`` by WGMMA with A from registers (RS);
* epilogue: ``O * (1 / row_sum)`` (0 for empty rows), stored with a ``row < seqlen_q``
  predicate, and the natural-log LSE (``-inf`` for empty rows).

Which tile a CTA computes and which KV blocks it visits is kernel/own/sm90/schedule.py's.

The WGMMA operand descriptors of Q, K and V come from the MMA sliced by the warpgroup's first
thread (warp-uniform), not by ``tidx``, so they live in uniform registers: sliced by ``tidx``,
every k-block's descriptor takes vector arithmetic and ``R2UR`` moves inside the loop.

Without knobs (the baseline) the kernel is kept simple rather than fast: each WGMMA is waited
for (``wait_group(0)``) before the next step, so the softmax never overlaps tensor-core work;
O is stored from registers; one CTA per tile. Each knob below is a compile-time choice that
changes one of these, off unless passed. The registered adapters run
``DEFAULT_KNOBS`` (kernel/adapters/own_sm90.py); docs/own-kernels.md says what each knob is
for, docs/results-h200.md what each measured.

* ``overlap``: FlashAttention 3's intra-warpgroup pipeline (:meth:`kv_loop_overlap`). After the
  first block's softmax, each step issues ``S = Q K^T`` of the next block and ``O += P V`` of
  the current one, waits for the first group only (``wait_group(1)``), masks and softmaxes the
  new S while the PV may still run, then waits for the PV, releases its V stage, rescales O by
  the new block's ``alpha`` and turns the new S into P; the last block's PV runs after the
  loop. Masked and unmasked blocks run in separate loops (:func:`split_by_mask`), so no branch
  sits between the two waits (ptxas would hoist the second wait above the softmax). P's
  conversion has to follow the second wait: P's registers are read by the PV in flight, and
  writing a second P buffer while a WGMMA stage is open makes ptxas serialize every WGMMA
  (its warning C7513).
* ``pingpong`` (needs ``overlap`` and 2 or 3 consumer warpgroups): FlashAttention 3's
  turn-taking. In each loop step a warpgroup waits on its named barrier (``SCHEDULER_BARRIER +
  wg``) before issuing its two GEMMs and, once they are issued, arrives on the next
  warpgroup's, so one warpgroup's GEMMs run while the others do their softmax. The first
  warpgroup's barrier gets one arrive before the loops (its first turn), so one arrive stays
  pending at exit, as in FlashAttention. Every warpgroup walks the same blocks, so their turns
  chain up; the varlen V-row zeroing, which syncs all consumer warpgroups, runs before a
  warpgroup waits for its turn, never inside it.
* ``num_consumer_wg=3`` (the adapters' ``m192``, D = 64 only): 192-row query tiles,
  FlashAttention's SM90 tile at D = 64; the consumers get 160 registers each and the producer
  32 (:data:`CONSUMER_REGISTERS`), which hold S, P and O at D = 64 only.
* ``longest_first``: causal or windowed kernels map CTA ``blockIdx.x`` to query tile
  ``gridDim.x - 1 - blockIdx.x`` (:func:`tile_for_block`), so the hardware, which launches CTAs
  in index order, starts the tiles with the most KV blocks first and fills the tail of the grid
  with short ones (FlashAttention's LPT order, without its L2 swizzle of heads). Without causal
  or a window every tile has the same work and the knob compiles to nothing.
* ``smem_epilogue``: instead of per-element predicated 2-byte global stores, O (normalized and
  converted) goes by ``stmatrix`` into the Q buffer, whose layout (128-byte swizzle) is the O
  tile's, so no shared memory is added (:meth:`epilogue_smem`); then, without varlen, one TMA
  store of the tile (clipped by the TMA unit at the tensor's padded ``S``, which is then
  ``seqlen_q``), and with varlen (rows past ``seqused_q`` must stay unwritten, which a box
  clipped at ``S`` would not honour) 16-byte row chunks with a row predicate. It needs ``o``
  16-byte aligned with S, H and B strides in multiples of 16 bytes (the adapters' launch
  checks).
* ``persistent``: ``min(num_tiles, max_ctas)`` CTAs (at least 1; ``max_ctas`` is a host
  ``Int32``, the adapters pass the SM count) walk the ``m_blocks * H * B`` query tiles
  (:meth:`run_persistent`, decoded by :func:`persistent_tile`: m_block fastest without causal
  or a window, longest-first inside L2-sized sections of (batch, head) pairs with them). Per
  tile the producer runs :meth:`load` and the consumers :meth:`consume` exactly as the one-tile
  kernel does; Q has 2 stages, so the next tile's Q load overlaps this tile's tail, and the
  consumers release a Q stage after the tile's KV loop. The static round-robin leaves the
  causal imbalance of the last wave(s). Not with ``pingpong`` (its pending arrive would pile up
  once per tile) nor with ``smem_epilogue`` (O in Q's buffer would race the next tile's Q
  load): both raise ValueError.

Why every wait of the persistent kernel has its arrive, on every path:

* both roles compute the same tile sequence and per tile the same block range (the same
  :func:`tile_work`), so the producer's sequence of Q, K and V stage fills is exactly the
  consumers' sequence of waits; the pipeline states (stage, phase) continue across tiles in
  both roles (:meth:`load`, :meth:`consume` and :meth:`kv_loop_overlap` return the participants
  and the loops rebind them, so the DSL carries them; the CPU tests check no wait in the PTX
  has a literal phase);
* K/V: every consumer wait is followed, on the same path, by its release, so each producer
  acquire waits for a release the consumers reach without waiting on anything the producer has
  not issued yet;
* Q: the producer fills Q for every tile, even one with no KV block, and the consumers wait
  for it and release it after the KV loop on every tile (an empty tile runs no WGMMA and still
  writes O = 0, LSE = -inf below ``seqlen_q``); the Q acquire for tile ``j`` waits for the
  release of tile ``j - 2``, which needs only fills issued before it;
* the consumer warpgroups' named barrier (the varlen V-row zeroing) is met by every consumer
  warpgroup the same number of times per tile;
* a CTA with no tile (only when ``num_tiles`` is 0: the grid is 1 then) runs zero iterations
  in both roles; after its last tile the producer warp exits with its last loads in flight,
  which the consumers wait for (no cluster, so no producer tail is needed).

Layouts: q, k, v, o ``[B, S, H, D]`` with unit stride on D (any other strides, e.g.
guard-banded views), lse ``[B, H, Sq]`` float32; B, H, Sq, Sk dynamic; D static (64 or 128);
bottom-right causal or no mask. Query head ``h`` reads kv head ``h // (Hq // Hkv)`` (GQA/MQA;
Hq a multiple of Hkv).

Optional trailing arguments, each a compile-time choice by being None or not (``own-sm90``
passes them for the cases that need them; ``own-sm90-full`` always passes the lengths, and the
window bounds when a case has a window):

* ``seqused_q`` / ``seqused_k`` (int32 ``[B]``, both or neither): each batch's valid lengths
  in the padded layout. Rows past ``seqused_q`` are not written (O nor LSE); a query tile past
  it visits no KV block; keys past ``seqused_k`` are masked, KV blocks past it are not loaded,
  and the V rows of the last partial block that lie past it (and inside the tensor: rows past
  the tensor are zero-filled by the TMA unit) are overwritten with zeros in shared memory
  before the ``P V`` WGMMA: ``P = 0`` times a NaN in padding would be NaN. The K rows need no
  such care, since their scores are replaced by ``-inf``.
* ``window_left`` / ``window_right`` (``Int32``, both or neither, clamped by the caller as
  kernel/own/common/mask.py says): a sliding window around the bottom-right diagonal; with causal
  only ``window_left`` matters. KV blocks outside the band of every row of the tile are skipped
  at both ends of the loop.

Blocks inside every row's band and below ``seqlen_k`` skip the mask (the unmasked fast path);
the diagonal, window-edge and last partial blocks are masked.

FP8 inputs (``float8_e4m3fn`` / ``float8_e5m2``; docs/own-kernels.md#own-sm90-fp8-the-fp8-forward):
both GEMMs are FP8 WGMMAs (k32), so V comes keys-contiguous (unit stride along S, K-major in
shared memory) and in the key order of :func:`fp8_p_layouts`
(kernel/own/sm90/fp8_layout.py), which the launcher writes; O is bf16; the optional float32
``[B, Hkv]`` descales fold ``q_descale * k_descale`` into the tile's ``scale_log2`` and
``v_descale`` into ``1 / row_sum``; ``max_offset_log2`` and ``rescale_threshold_log2`` go to the
online softmax (kernel/own/common/softmax.py). Dense path only, without ``smem_epilogue`` or
``persistent``.

:meth:`FlashAttentionForwardSm90.compile` builds the kernel for sm_90a on fake tensors, so a
CPU-only machine can compile it and inspect the PTX (tests/kernel/test_own_kernels.py). The knobs
``num_consumer_wg=1`` and ``tile_n=64`` compile too, but only the adapters' tiles are tested.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from attention_crossval.kernel.own.common.host import attention_views, compile_on_fake_tensors
from attention_crossval.kernel.own.common.mask import (
    apply_mask,
    block_needs_mask,
    padded_key_rows,
    split_by_mask,
)
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
from attention_crossval.kernel.own.common.softmax import OnlineSoftmax, rescale_rows
from attention_crossval.kernel.own.sm90.schedule import (
    Limits,
    persistent_grid,
    persistent_tile,
    tile_for_block,
    tile_work,
)

DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
HEAD_DIMS = (64, 128)
WG_THREADS = 128
ROWS_PER_WG = 64  # the WGMMA M extent
CONSUMER_BARRIER = 1  # named barrier of the consumer warpgroups (0 is __syncthreads)
# pingpong: consumer warpgroup w waits on named barrier SCHEDULER_BARRIER + w for its turn
# (2, 3 and with three consumer warpgroups 4).
SCHEDULER_BARRIER = 2
# smem_epilogue: the consumer warpgroups meet here once O is in shared memory (after 2 to 4).
EPILOGUE_BARRIER = 5
# setmaxnreg per consumer warpgroup count: (producer, consumer) registers per thread, the
# producer giving its share to the consumers (65536 per SM, one CTA; multiples of 8).
CONSUMER_REGISTERS = {1: (24, 256), 2: (24, 240), 3: (32, 160)}


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """``(rows, cols)`` view of a WGMMA accumulator fragment ``((2, 2, V), MMA_M, MMA_N)``.

    Per 8 columns a thread holds 2 adjacent columns of 2 rows 8 apart: value mode 0 is the
    column pair, mode 1 the row, mode 2 the 8-column group (PTX wgmma accumulator fragment).
    """
    shape, stride = acc.layout.shape, acc.layout.stride
    layout = cute.make_layout(
        ((shape[0][1], shape[1]), ((shape[0][0], shape[0][2]), shape[2])),
        stride=((stride[0][1], stride[1]), ((stride[0][0], stride[0][2]), stride[2])),
    )
    return cute.make_tensor(acc.iterator, layout)


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """The accumulator fragment of ``S`` (after conversion to 16 bits) re-viewed as the A
    fragment ``((2, 2, 2), MMA_M, MMA_K)`` of the PV WGMMA, k16 blocks along the columns.

    The A fragment of a k16 block holds, in order, the values of two consecutive 8-column
    accumulator groups, so the view only regroups mode 2 of the accumulator in pairs.
    """
    shape, stride = acc.layout.shape, acc.layout.stride
    layout = cute.make_layout(
        ((shape[0][0], shape[0][1], 2), shape[1], (shape[0][2] // 2, shape[2])),
        stride=(
            (stride[0][0], stride[0][1], stride[0][2]),
            stride[1],
            (stride[0][2] * 2, stride[2]),
        ),
    )
    return cute.make_tensor(acc.iterator, layout)


def fp8_p_layouts(acc_shape: tuple) -> tuple[cute.Layout, cute.Layout]:
    """FP8 P's registers, indexed two ways: ``(as S, as A)``. ``as S`` maps S's accumulator
    coordinate ``((2, 2, (2, 2, V // 4)), MMA_M, MMA_N)`` (its 8-key groups split into group
    within a pair, pair, k32 block) to a byte of P, ``as A`` is the PV WGMMA's A fragment
    ``((4, 2, 2), MMA_M, MMA_K)``, compact.

    CuTe DSL's RS WGMMA takes A's 4 registers per k32 block from the fragment's bytes in
    storage order, whatever view of them it is handed (tests/kernel/test_own_sm90_fp8.py reads
    it in the PTX), so P's bytes must be stored in A's order. PTX
    ISA, wgmma ``m64nNk32``: A register ``r``, byte ``b`` of lane ``l`` is row ``l // 4 +
    8 (r % 2)``, key ``4 (l % 4) + b + 16 (r // 2)``; accumulator element ``i`` is row
    ``l // 4 + 8 ((i // 2) % 2)``, key ``2 (l % 4) + i % 2 + 8 (i // 4)``. So the lanes of a
    quad hold different keys in the two. Rather than exchanging values between lanes, the
    kernel relabels keys: the A register of row ``r`` and half ``h`` of a k32 block takes that
    row's converted pairs of S's groups ``2h`` and ``2h + 1``, so A position ``j`` holds key
    ``fp8_key_order(...)[j]`` (kernel/own/sm90/fp8_layout.py), and the launcher stores V's keys
    in that order. Each converted pair (``cvt ... x2``, 16 bits) is one half of an A register:
    no shuffle and no byte permute."""
    (cols, rows, groups), mma_m, mma_n = acc_shape
    if (cols, rows) != (2, 2) or groups % 4:
        raise ValueError(f"FP8 P needs a (2, 2, 4k) accumulator value mode, got {acc_shape}")
    blocks = groups // 4
    as_a = cute.make_layout(((4, 2, 2), mma_m, (blocks, mma_n)))
    as_s = cute.make_layout(
        ((2, 2, (2, 2, blocks)), mma_m, mma_n),
        stride=((1, 4, (2, 8, 16 * mma_m)), 16, 16 * mma_m * blocks),
    )
    return as_s, as_a


class Descales(NamedTuple):
    """FP8's float32 ``[B, Hkv]`` descales of q, k and v."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor


class Problem(NamedTuple):
    """The launch's runtime values besides the tensors: the score scale ``scale_log2``, the
    optional lengths and window (:class:`Limits`) and FP8's descales (or None)."""

    scale_log2: Float32
    limits: Limits
    descales: Descales | None


class Scales(NamedTuple):
    """One tile's scales: ``log2`` multiplies the scores in the exp2 domain (with FP8 q's and
    k's descales folded in), ``v`` O at the normalization (FP8's v descale, else None)."""

    log2: Float32
    v: Float32 | None


class ThreadIndex(NamedTuple):
    """The thread's index in the CTA, and its warp's and warpgroup's (warp-uniform)."""

    tidx: Int32
    warp: Int32
    warpgroup: Int32


class OverlapFragments(NamedTuple):
    """The operands and accumulators :meth:`FlashAttentionForwardSm90.kv_loop_overlap` keeps
    across its loop: the WGMMA views of Q (its stage), K and V stages, the S and O accumulators,
    the score coordinates (``cS_mn`` of :meth:`FlashAttentionForwardSm90.mask_and_softmax`) and
    the V stages themselves (the varlen path zeroes padded rows in them)."""

    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrV: cute.Tensor
    acc_S: cute.Tensor
    acc_O: cute.Tensor
    cS_mn: tuple[cute.Tensor, tuple[Int32, Int32]]
    sV: cute.Tensor


class FlashAttentionForwardSm90:
    """Static knobs in ``__init__``; ``__call__`` is the host launch (a ``cute.jit`` function)."""

    def __init__(
        self,
        dtype: str,
        head_dim: int,
        causal: bool,
        *,
        num_consumer_wg: int = 2,
        tile_n: int = 128,
        kv_stages: int = 2,
        overlap: bool = False,
        pingpong: bool = False,
        longest_first: bool = False,
        smem_epilogue: bool = False,
        persistent: bool = False,
        max_offset_log2: float = 0.0,
        rescale_threshold_log2: float = 0.0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim={head_dim!r} must be one of {HEAD_DIMS}")
        if num_consumer_wg not in CONSUMER_REGISTERS:
            raise ValueError(f"num_consumer_wg={num_consumer_wg!r} must be 1, 2 or 3")
        if num_consumer_wg == 3 and head_dim != 64:
            # 160 registers per consumer thread hold S, P and O at D = 64 only.
            raise ValueError(f"num_consumer_wg=3 needs head_dim=64 (got {head_dim!r})")
        if tile_n not in (64, 128):
            raise ValueError(f"tile_n={tile_n!r} must be 64 or 128")
        if kv_stages < 1:
            raise ValueError(f"kv_stages={kv_stages!r} must be >= 1")
        if pingpong and not (overlap and num_consumer_wg >= 2):
            raise ValueError("pingpong needs overlap=True and num_consumer_wg >= 2")
        if persistent and pingpong:
            # The first warpgroup's extra arrive before the loops, left pending at exit, would
            # pile up once per tile and let a warpgroup past its turn in the next tile.
            raise ValueError("persistent=True and pingpong=True cannot be combined")
        if persistent and smem_epilogue:
            # smem_epilogue writes O into Q's buffer, which the producer refills with the next
            # tile's Q as soon as the consumers release it.
            raise ValueError("persistent=True and smem_epilogue=True cannot be combined")
        if dtype in FP8_DTYPES and (smem_epilogue or persistent):
            # O (bf16) is twice Q's bytes: it does not fit Q's buffer; persistent is untested.
            raise ValueError(f"dtype={dtype!r} (FP8) takes neither smem_epilogue nor persistent")
        for name, value in (
            ("max_offset_log2", max_offset_log2),
            ("rescale_threshold_log2", rescale_threshold_log2),
        ):
            if not (isinstance(value, (int, float)) and 0.0 <= value < 64.0):
                raise ValueError(f"{name}={value!r} must be a float in [0, 64)")
        self.dtype = DTYPES[dtype]
        self.fp8 = dtype in FP8_DTYPES
        # FP8 inputs write bf16 (FP8 outputs are not supported); 16-bit ones their own dtype.
        self.out_dtype = cutlass.BFloat16 if self.fp8 else self.dtype
        self.max_offset_log2 = float(max_offset_log2)
        self.rescale_threshold_log2 = float(rescale_threshold_log2)
        self.head_dim = head_dim
        self.causal = causal
        self.num_consumer_wg = num_consumer_wg
        self.tile_m = ROWS_PER_WG * num_consumer_wg
        self.tile_n = tile_n
        self.kv_stages = kv_stages
        self.overlap = overlap
        self.pingpong = pingpong
        self.longest_first = longest_first
        self.smem_epilogue = smem_epilogue
        self.persistent = persistent
        # persistent: two Q stages, so the next tile's Q load overlaps this tile's tail.
        self.q_stages = 2 if persistent else 1
        self.num_threads = WG_THREADS * (1 + num_consumer_wg)
        self.regs_load, self.regs_consumer = CONSUMER_REGISTERS[num_consumer_wg]

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
        seqused_q: cute.Tensor | None = None,
        seqused_k: cute.Tensor | None = None,
        window_left: Int32 | None = None,
        window_right: Int32 | None = None,
        max_ctas: Int32 | None = None,
        q_descale: cute.Tensor | None = None,
        k_descale: cute.Tensor | None = None,
        v_descale: cute.Tensor | None = None,
    ) -> None:
        """Launch on ``[B, S, H, D]`` q/k/v/o and ``[B, H, Sq]`` lse; ``scale_log2`` is
        ``softmax_scale * log2(e)``; the optional arguments as the module docstring says;
        ``max_ctas`` (``persistent`` only, and needed there) caps the persistent grid, e.g. at
        the GPU's SM count. FP8 (module docstring): v K-major (unit stride along S) with its
        keys in :func:`fp8_key_order`, o bfloat16, and the descales float32 ``[B, Hkv]`` (all
        three or none)."""
        if cutlass.const_expr(self.persistent != (max_ctas is not None)):
            raise ValueError("max_ctas is given exactly when persistent=True")
        if cutlass.const_expr((seqused_q is None) != (seqused_k is None)):
            raise ValueError("seqused_q and seqused_k go together (both or neither)")
        if cutlass.const_expr((window_left is None) != (window_right is None)):
            raise ValueError("window_left and window_right go together (both or neither)")
        descales = (q_descale, k_descale, v_descale)
        if cutlass.const_expr(len({d is None for d in descales}) != 1):
            raise ValueError("q_descale, k_descale and v_descale go together (all or none)")
        if cutlass.const_expr(q_descale is not None and not self.fp8):
            raise ValueError("descales are for FP8 inputs only")
        if cutlass.const_expr(self.fp8 and seqused_q is not None):
            # The varlen path zeroes V rows by key index, which the FP8 key order relabels.
            raise ValueError("FP8 inputs run the dense path only (no seqused_q / seqused_k)")
        mQ, mK, mV, mO, mLSE = attention_views(q, k, v, o, lse)

        dtype = self.dtype
        qk_tiler = (ROWS_PER_WG, self.tile_n, self.head_dim)
        pv_tiler = (ROWS_PER_WG, self.head_dim, self.tile_n)
        cta_qk_tiler = (self.tile_m, self.tile_n, self.head_dim)
        cta_pv_tiler = (self.tile_m, self.head_dim, self.tile_n)
        atoms = (self.num_consumer_wg, 1, 1)
        k_major = cute.nvgpu.OperandMajorMode.K
        v_layout = LayoutEnum.from_tensor(mV)
        if cutlass.const_expr(self.fp8 and v_layout != LayoutEnum.ROW_MAJOR):
            # FP8 WGMMA reads both shared-memory operands K-major: V's keys must be contiguous.
            raise ValueError("FP8 v must have unit stride along S (transposed by the launcher)")
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, Float32, atoms, qk_tiler[:2]
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dtype,
            dtype,
            k_major,
            v_layout.sm90_mma_major_mode(),
            Float32,
            atoms,
            pv_tiler[:2],
            warpgroup.OperandSource.RMEM,
        )
        row_major = LayoutEnum.ROW_MAJOR
        sQ_layout = sm90_utils.make_smem_layout_a(row_major, cta_qk_tiler, dtype, self.q_stages)
        sK_layout = sm90_utils.make_smem_layout_b(row_major, cta_qk_tiler, dtype, self.kv_stages)
        sV_layout = sm90_utils.make_smem_layout_b(v_layout, cta_pv_tiler, dtype, self.kv_stages)

        load_op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load_op, mQ, cute.slice_(sQ_layout, (None, None, 0)), (self.tile_m, self.head_dim)
        )
        tma_k, mK_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load_op, mK, cute.slice_(sK_layout, (None, None, 0)), (self.tile_n, self.head_dim)
        )
        tma_v, mV_tma = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load_op, mV, cute.slice_(sV_layout, (None, None, 0)), (self.head_dim, self.tile_n)
        )
        # smem_epilogue (not varlen): O goes out by a TMA store from the Q buffer, whose layout
        # (tile_m x D, 128-byte swizzle, row-major) is the O tile's too.
        tma_o = None
        if cutlass.const_expr(self.smem_epilogue and seqused_q is None):
            tma_o, mO = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                mO,
                cute.slice_(sQ_layout, (None, None, 0)),
                (self.tile_m, self.head_dim),
            )
        if cutlass.const_expr(self.smem_epilogue and seqused_q is not None):
            # Varlen: O rows go out in 16-byte chunks, so the row, head and batch strides of o
            # must be multiples of 16 bytes (as the TMA loads need of q, k, v); the adapter's
            # launch checks it (kernel/adapters/own_sm90.py).
            per_chunk = 128 // dtype.width
            strides = tuple(
                st if i == 1 else cute.assume(st, divby=per_chunk)
                for i, st in enumerate(mO.layout.stride)
            )
            mO = cute.make_tensor(mO.iterator, cute.make_layout(mO.layout.shape, stride=strides))
        self.q_bytes = cute.size_in_bytes(dtype, cute.slice_(sQ_layout, (None, None, 0)))
        self.kv_bytes = cute.size_in_bytes(dtype, cute.slice_(sK_layout, (None, None, 0)))

        stages = self.kv_stages

        @cute.struct
        class SharedStorage:
            q_bar: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            k_bar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            v_bar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(mQ.shape[0], self.tile_m), mQ.shape[2], mQ.shape[3])
        if cutlass.const_expr(self.persistent):
            # One CTA per SM at most (max_ctas), never more than the tiles; at least 1, which
            # with no tile at all runs zero loop iterations and exits (kernel docstring).
            num_tiles = grid[0] * grid[1] * grid[2]
            grid = (cutlass.max(cutlass.min(num_tiles, max_ctas), 1), 1, 1)
        limits = Limits(seqused_q, seqused_k, (window_left, window_right))
        fp8_descales = None
        if cutlass.const_expr(q_descale is not None):
            fp8_descales = Descales(q_descale, k_descale, v_descale)
        self.kernel(
            Mmas(qk_mma, pv_mma),
            TmaLoads(tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma),
            Output(mO, mLSE, tma_o),
            Problem(scale_log2, limits, fp8_descales),
            SmemLayouts(sQ_layout, sK_layout, sV_layout),
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
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
        problem: Problem,
        layouts: SmemLayouts,
    ) -> None:
        """One CTA: its query tile (or, ``persistent``, its walk over tiles), the load warp and
        the consumer warpgroups."""
        tidx, _, _ = cute.arch.thread_idx()
        block_x, head, batch = cute.arch.block_idx()
        # The query tile: blockIdx.x, or reversed (longest_first, only where the tiles' work
        # differs: causal or windowed). Every later use of the tile reads this one m_block.
        m_block = block_x
        limits = problem.limits
        lpt = self.longest_first and (self.causal or limits.window[0] is not None)
        if cutlass.const_expr(lpt and not self.persistent):
            m_block = tile_for_block(block_x, cute.arch.grid_dim()[0], True)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // WG_THREADS)

        storage = SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(layouts.q.outer, swizzle=layouts.q.inner)
        sK = storage.sK.get_tensor(layouts.k.outer, swizzle=layouts.k.inner)
        sV = storage.sV.get_tensor(layouts.v.outer, swizzle=layouts.v.inner)

        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_group = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_consumer_wg * (WG_THREADS // 32)
        )

        def tma_pipeline(barriers, num_stages: int, tx_count: int):  # -> (producer, consumer)
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers.data_ptr(),
                num_stages=num_stages,
                producer_group=producer_group,
                consumer_group=consumer_group,
                tx_count=tx_count,
                defer_sync=True,
            ).make_participants()

        q_load, q_use = tma_pipeline(storage.q_bar, self.q_stages, self.q_bytes)
        k_load, k_use = tma_pipeline(storage.k_bar, self.kv_stages, self.kv_bytes)
        v_load, v_use = tma_pipeline(storage.v_bar, self.kv_stages, self.kv_bytes)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        ops = tma_operands(tma, sQ, sK, sV)
        producers = Participants(q_load, k_load, v_load)
        consumers = Participants(q_use, k_use, v_use)
        if cutlass.const_expr(self.persistent):
            self.run_persistent(
                mmas, ops, out, problem, producers, consumers, ThreadIndex(tidx, warp_idx, wg_idx)
            )
        else:
            mQ, mK = ops.mQ, ops.mK
            tile = tile_work(
                m_block, head, batch, mQ, mK, limits, (self.tile_m, self.tile_n), self.causal
            )
            kv_head = head // (mQ.shape[2] // mK.shape[2])
            scales = Scales(problem.scale_log2, None)
            if cutlass.const_expr(problem.descales is not None):
                # FP8: S of the raw values takes q's and k's descales in its scale; O takes
                # v's at the normalization (per batch and kv head).
                descale_q, descale_k, descale_v = problem.descales
                scales = Scales(
                    problem.scale_log2 * (descale_q[batch, kv_head] * descale_k[batch, kv_head]),
                    descale_v[batch, kv_head],
                )

            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(self.regs_load)
                if warp_idx == 0:
                    self.load(ops, producers, tile, kv_head)
            else:
                cute.arch.setmaxregister_increase(self.regs_consumer)
                self.consume(mmas, ops, consumers, out, scales, tidx - WG_THREADS, tile)

    @cute.jit
    def run_persistent(
        self,
        mmas: Mmas,
        ops: TmaOperands,
        out: Output,
        problem: Problem,
        producers: Participants,
        consumers: Participants,
        thread: ThreadIndex,
    ) -> None:
        """``persistent``: the producer warp and every consumer thread walk the same linear
        tiles ``blockIdx.x, blockIdx.x + gridDim.x, ...`` below ``num_tiles`` (none at all when
        ``blockIdx.x >= num_tiles``), decoded by :func:`persistent_tile`; per tile the producer
        runs :meth:`load` and the consumers :meth:`consume` (fresh softmax state, O and masks;
        they release the Q stage at its end), exactly as the one-tile kernel does.
        ``producers`` and ``consumers`` are the Q, K and V pipeline participants of each role,
        rebound from each call, so the DSL carries their states (stage index, phase) from one
        tile to the next (module docstring: why every wait has its arrive)."""
        tidx, warp_idx, wg_idx = thread
        limits = problem.limits
        scales = Scales(problem.scale_log2, None)  # no FP8 here: no descales
        mQ, mK = ops.mQ, ops.mK
        # Longest-first wherever the tiles' work differs (causal or windowed), with or without
        # the longest_first knob; uniform tiles keep the grid's natural order.
        grid = persistent_grid(
            mQ, mK, self.tile_m, self.head_dim, self.dtype.width // 8,
            self.causal or limits.window[0] is not None,
        )  # fmt: skip
        first_tile = cute.arch.block_idx()[0]
        num_ctas = cute.arch.grid_dim()[0]
        group = grid.num_heads // mK.shape[2]  # query heads per kv head
        tile_shape = (self.tile_m, self.tile_n)
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.regs_load)
            if warp_idx == 0:
                for linear in cutlass.range(first_tile, grid.num_tiles, num_ctas, unroll=1):
                    m_block, head, batch = persistent_tile(
                        linear, grid.num_m_blocks, grid.num_heads, grid.num_hb, grid.section,
                        grid.longest_first,
                    )  # fmt: skip
                    tile = tile_work(m_block, head, batch, mQ, mK, limits, tile_shape, self.causal)
                    producers = self.load(ops, producers, tile, head // group)
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            for linear in cutlass.range(first_tile, grid.num_tiles, num_ctas, unroll=1):
                m_block, head, batch = persistent_tile(
                    linear, grid.num_m_blocks, grid.num_heads, grid.num_hb, grid.section,
                    grid.longest_first,
                )  # fmt: skip
                tile = tile_work(m_block, head, batch, mQ, mK, limits, tile_shape, self.causal)
                consumers = self.consume(mmas, ops, consumers, out, scales, tidx - WG_THREADS, tile)

    @cute.jit
    def load(
        self, ops: TmaOperands, producers: Participants, tile: Tile, kv_head: Int32
    ) -> Participants:
        """Producer warp: Q once (even for an empty tile, the consumers wait for it), then K and
        V of kv head ``kv_head``, blocks ``n_block_max - 1`` down to ``n_block_min``, in the
        order the consumers wait for them: ``K_j, V_j`` per block, or with ``overlap`` (whose
        step issues ``Q K_{j+1}^T`` before ``P_j V_j``) ``K_{j+1}`` before ``V_j``, so a K
        stage is refilled without first waiting for the V release of the step before. Rows past
        the tensor's end are zero-filled by the TMA unit (the box is clipped to its extent).
        Returns the three producers (advanced), for the persistent loop to carry."""
        q_load, k_load, v_load = producers
        tma_q, mQ, sQ, tma_k, mK, sK, tma_v, mV, sV = ops
        m_block, head, batch = tile.m_block, tile.head, tile.batch
        n_block_min, n_block_max = tile.blocks[0], tile.blocks[1]
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
        gK = cute.local_tile(
            mK[None, None, kv_head, batch], (self.tile_n, self.head_dim), (None, 0)
        )
        gV = cute.local_tile(
            mV[None, None, kv_head, batch], (self.head_dim, self.tile_n), (0, None)
        )
        no_mcast = cute.make_layout(1)
        tQsQ, tQgQ = cute.nvgpu.cpasync.tma_partition(
            tma_q, 0, no_mcast, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cute.nvgpu.cpasync.tma_partition(
            tma_k, 0, no_mcast, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cute.nvgpu.cpasync.tma_partition(
            tma_v, 0, no_mcast, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        handle = q_load.acquire_and_advance()
        cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, handle.index], tma_bar_ptr=handle.barrier)

        num_blocks = n_block_max - n_block_min
        if cutlass.const_expr(self.overlap):  # K one block ahead of V
            for i in cutlass.range(num_blocks + 1, unroll=1):
                if i < num_blocks:
                    k_load = self.load_block(tma_k, tKgK, tKsK, k_load, n_block_max - 1 - i)
                if i > 0:
                    v_load = self.load_block(tma_v, tVgV, tVsV, v_load, n_block_max - i)
        else:
            for i in cutlass.range(num_blocks, unroll=1):
                k_load = self.load_block(tma_k, tKgK, tKsK, k_load, n_block_max - 1 - i)
                v_load = self.load_block(tma_v, tVgV, tVsV, v_load, n_block_max - 1 - i)
        return Participants(q_load, k_load, v_load)

    @cute.jit
    def load_block(
        self,
        tma: cute.CopyAtom,
        blocks_in_gmem: cute.Tensor,
        stages_in_smem: cute.Tensor,
        producer: pipeline.PipelineProducer,
        n_block: Int32,
    ) -> pipeline.PipelineProducer:
        """TMA load of block ``n_block`` into the next free stage of ``producer``'s ring;
        returns ``producer`` (advanced), for the caller to rebind so that the DSL carries its
        state through dynamic control flow."""
        handle = producer.acquire_and_advance()
        cute.copy(
            tma,
            blocks_in_gmem[None, n_block],
            stages_in_smem[None, handle.index],
            tma_bar_ptr=handle.barrier,
        )
        return producer

    @cute.jit
    def consume(
        self,
        mmas: Mmas,
        ops: TmaOperands,
        consumers: Participants,
        out: Output,
        scales: Scales,
        tidx: Int32,
        tile: Tile,
    ) -> Participants:
        """Consumer warpgroups: the KV loop (QK^T, mask, online softmax, rescale, PV), then
        (``persistent``) the release of the Q stage, then the epilogue; returns the three
        consumers (advanced), for the persistent loop to carry. ``tidx`` counts from the first
        consumer thread."""
        qk_mma, pv_mma = mmas
        q_use, k_use, v_use = consumers
        sQ, sK, sV = ops.sQ, ops.sK, ops.sV
        n_block_min, n_block_max = tile.blocks[0], tile.blocks[1]
        qk_thr = qk_mma.get_slice(tidx)
        pv_thr = pv_mma.get_slice(tidx)
        # The shared-memory operands (WGMMA descriptors) depend only on the warpgroup: sliced
        # by its first thread, a warp-uniform value, they live in uniform registers (sliced by
        # tidx, every k-block's descriptor took vector arithmetic and R2UR moves in the loop).
        wg_first = cute.arch.make_warp_uniform(tidx // WG_THREADS) * WG_THREADS
        qk_wg, pv_wg = qk_mma.get_slice(wg_first), pv_mma.get_slice(wg_first)
        tSrQ = qk_wg.make_fragment_A(qk_wg.partition_A(sQ))
        tSrK = qk_wg.make_fragment_B(qk_wg.partition_B(sK))
        tOrV = pv_wg.make_fragment_B(pv_wg.partition_B(sV))
        acc_S_shape = qk_thr.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.tile_m, self.head_dim)))
        acc_O.fill(0.0)
        acc_O_mn = acc_rows_cols(acc_O)
        # (row, col) of each score inside the tile, viewed like the scores, as thread 0's
        # coordinate of the same fragment element (trace-time constants) plus this thread's
        # offset (the accumulator layout shifts every element of a thread alike): the mask then
        # compares against immediates, rather than keeping a coordinate per score live across
        # the loop (24 registers that 192-row tiles at D = 64 do not have).
        identity = cute.make_identity_tensor((self.tile_m, self.tile_n))
        cS0 = acc_rows_cols(qk_mma.get_slice(0).partition_C(identity))
        own = acc_rows_cols(qk_thr.partition_C(identity))[0, 0]
        cS_mn = (cS0, (own[0] - cS0[0, 0][0], own[1] - cS0[0, 0][1]))
        num_rows = cute.size(acc_O_mn, mode=[0])
        softmax = OnlineSoftmax(
            num_rows, 4, scales.log2, max_offset_log2=self.max_offset_log2,
            rescale_threshold_log2=self.rescale_threshold_log2,
        )  # fmt: skip
        alpha = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)

        q_handle = q_use.wait_and_advance()
        if cutlass.const_expr(self.overlap):
            fragments = OverlapFragments(
                tSrQ[None, None, None, q_handle.index],
                tSrK,
                tOrV,
                qk_thr.make_fragment_C(acc_S_shape),
                acc_O,
                cS_mn,
                sV,
            )
            k_use, v_use = self.kv_loop_overlap(
                mmas, fragments, (k_use, v_use), softmax, alpha, tidx, tile
            )
        else:
            for i in cutlass.range(n_block_max - n_block_min, unroll=1):
                n_block = n_block_max - 1 - i
                acc_S = qk_thr.make_fragment_C(acc_S_shape)
                k_handle = k_use.wait_and_advance()
                qk_mma = self.qk_gemm(
                    qk_mma, acc_S, tSrQ[None, None, None, q_handle.index], tSrK, k_handle.index
                )
                warpgroup.wait_group(0)
                k_handle.release()

                self.mask_and_softmax(acc_S, cS_mn, softmax, alpha, n_block, tile)
                rescale_rows(acc_O_mn, alpha)
                rP, tOrP = self.p_fragments(acc_S)
                self.store_p(rP, tOrP, acc_S)

                v_handle = v_use.wait_and_advance()
                self.guard_v_padding(sV, v_handle.index, n_block, tile, tidx)
                pv_mma = self.pv_gemm(pv_mma, acc_O, tOrP, tOrV, v_handle.index)
                warpgroup.wait_group(0)
                v_handle.release()

        if cutlass.const_expr(self.persistent):
            # Every WGMMA that reads this Q stage is complete: the plain loop waits for each QK^T
            # (wait_group 0), the overlap loop ends on wait_group 0 after the last PV, and an
            # empty tile issued none. The producer may now load a later tile's Q into it.
            q_handle.release()
        if cutlass.const_expr(self.smem_epilogue):
            self.epilogue_smem(softmax, acc_O, pv_mma, sQ[None, None, 0], out, tidx, tile)
        else:
            self.epilogue(softmax, acc_O, pv_thr, out, tidx, tile, scales.v)
        return Participants(q_use, k_use, v_use)

    @cute.jit
    def kv_loop_overlap(
        self,
        mmas: Mmas,
        fragments: OverlapFragments,
        kv_uses: tuple[pipeline.PipelineConsumer, pipeline.PipelineConsumer],
        softmax: OnlineSoftmax,
        alpha: cute.Tensor,
        tidx: Int32,
        tile: Tile,
    ) -> tuple[pipeline.PipelineConsumer, pipeline.PipelineConsumer]:
        """The KV loop with intra-warpgroup overlap (``overlap=True``): the softmax of block
        ``j + 1`` runs while the tensor cores do ``O += P_j V_j``.

        * prologue (first block ``n_block_max - 1``): ``S`` by WGMMA, wait, mask, softmax,
          ``P`` to the input dtype (O is still 0: no rescale);
        * each further block ``j + 1`` (``j`` the block before it in the walk): issue
          ``S = Q K_{j+1}^T``, then ``O += P_j V_j``, ``wait_group(1)`` (S is ready, the PV may
          still run), release ``K_{j+1}``, mask and softmax of ``S`` (giving ``alpha_{j+1}``),
          ``wait_group(0)`` (the PV has read ``P_j`` and accumulated into O), release ``V_j``,
          ``O *= alpha_{j+1}``, ``P_{j+1}`` from ``S``;
        * epilogue: the last ``O += P V``.

        So O is rescaled by ``alpha_{j+1}`` only after ``P_j V_j`` is in it, as the plain loop
        does. One ``S`` fragment and one ``P`` fragment live across the loop. An empty block
        range runs none of it (O = 0, row sums 0: the epilogue writes O = 0, LSE = -inf).
        Pipeline waits stay in this function's own regions, so the DSL carries their states
        through the dynamic ``if`` and ``for``. With ``pingpong`` each step waits for K and V
        (and zeroes V padding) first, then takes its turn to issue both GEMMs (module
        docstring). ``kv_uses`` are the K and V consumers; returns them as this function's
        regions left them (the DSL rebinds the names here, not the caller's objects), for the
        persistent loop."""
        qk_mma, pv_mma = mmas
        k_use, v_use = kv_uses
        tSrQ, tSrK, tOrV, acc_S, acc_O, cS_mn, sV = fragments
        n_block_min, n_block_max, n_unmasked_min, n_unmasked_max = tile.blocks
        window = tile.window
        acc_O_mn = acc_rows_cols(acc_O)
        rP, tOrP = self.p_fragments(acc_S)
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)  # consumer warpgroup, 0, 1 (, 2)
        next_wg = (wg + 1) % self.num_consumer_wg  # whose turn follows this one's
        if cutlass.const_expr(self.pingpong):
            if wg == 0:  # the first warpgroup has the first turn
                cute.arch.barrier_arrive(
                    barrier_id=SCHEDULER_BARRIER, number_of_threads=2 * WG_THREADS
                )
        if n_block_max > n_block_min:
            k_handle = k_use.wait_and_advance()
            qk_mma = self.qk_gemm(qk_mma, acc_S, tSrQ, tSrK, k_handle.index)
            warpgroup.wait_group(0)
            k_handle.release()
            self.mask_and_softmax(acc_S, cS_mn, softmax, alpha, n_block_max - 1, tile)
            self.store_p(rP, tOrP, acc_S)
        # The other blocks, hi - 1 down to n_block_min, in three loops so that no branch on the
        # mask sits between wait_group(1) and wait_group(0) (ptxas schedules the wait to the
        # head of the block after such a branch, before the softmax, losing the overlap).
        hi = cutlass.max(n_block_max - 1, n_block_min)
        mid_lo, top_lo = split_by_mask(
            n_block_min, hi, n_unmasked_min, n_unmasked_max, window[0] is not None
        )
        segments = [(top_lo, hi, True), (mid_lo, top_lo, False)]
        if cutlass.const_expr(window[0] is not None):
            segments.append((n_block_min, mid_lo, True))
        for s in cutlass.range_constexpr(len(segments)):
            seg_lo, seg_hi, masked = segments[s]
            for i in cutlass.range(seg_hi - seg_lo, unroll=1):
                n_block = seg_hi - 1 - i  # S of this block, PV of n_block + 1
                k_handle = k_use.wait_and_advance()
                if cutlass.const_expr(not self.pingpong):
                    qk_mma = self.qk_gemm(qk_mma, acc_S, tSrQ, tSrK, k_handle.index)
                v_handle = v_use.wait_and_advance()
                self.guard_v_padding(sV, v_handle.index, n_block + 1, tile, tidx)
                if cutlass.const_expr(self.pingpong):
                    # This warpgroup's turn to issue (the other one is in its softmax); the
                    # zeroed V rows' barrier above stays outside the turn (both groups meet it).
                    cute.arch.barrier(
                        barrier_id=SCHEDULER_BARRIER + wg, number_of_threads=2 * WG_THREADS
                    )
                    qk_mma = self.qk_gemm(qk_mma, acc_S, tSrQ, tSrK, k_handle.index)
                pv_mma = self.pv_gemm(pv_mma, acc_O, tOrP, tOrV, v_handle.index)
                if cutlass.const_expr(self.pingpong):  # the other warpgroup's turn
                    cute.arch.barrier_arrive(
                        barrier_id=SCHEDULER_BARRIER + next_wg, number_of_threads=2 * WG_THREADS
                    )
                warpgroup.wait_group(1)
                k_handle.release()
                self.mask_and_softmax(acc_S, cS_mn, softmax, alpha, n_block, tile, masked)
                warpgroup.wait_group(0)
                v_handle.release()
                rescale_rows(acc_O_mn, alpha)
                self.store_p(rP, tOrP, acc_S)
        if n_block_max > n_block_min:
            v_handle = v_use.wait_and_advance()
            self.guard_v_padding(sV, v_handle.index, n_block_min, tile, tidx)
            pv_mma = self.pv_gemm(pv_mma, acc_O, tOrP, tOrV, v_handle.index)
            warpgroup.wait_group(0)
            v_handle.release()
        return k_use, v_use

    def p_fragments(self, acc_S: cute.Tensor) -> tuple[cute.Tensor, cute.Tensor]:
        """P's registers in the input dtype: ``rP`` laid out as S's accumulator (which S is
        converted into) and ``tOrP``, the PV WGMMA's A operand: for 16 bits a view of ``rP``
        (:func:`acc_as_operand_a`), for FP8 registers of their own (:func:`fp8_p_layouts`)
        that :meth:`store_p` moves P into."""
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        if cutlass.const_expr(self.fp8):
            return rP, cute.make_rmem_tensor(fp8_p_layouts(acc_S.layout.shape)[1], self.dtype)
        return rP, acc_as_operand_a(rP)

    def store_p(self, rP: cute.Tensor, tOrP: cute.Tensor, acc_S: cute.Tensor) -> None:
        """P (fp32 in ``acc_S``) converted to the input dtype into ``rP`` (:meth:`p_fragments`);
        FP8 then moves each converted pair (16 bits) to its place in ``tOrP``."""
        rP.store(acc_S.load().to(self.dtype))
        if cutlass.const_expr(self.fp8):
            as_s = fp8_p_layouts(acc_S.layout.shape)[0]
            pairs = cute.recast_tensor(rP, cutlass.Int16)
            a_pairs = cute.recast_tensor(tOrP, cutlass.Int16)
            for i in range(cute.size(pairs)):  # trace time: one move per pair
                a_pairs[as_s(2 * i) // 2] = pairs[i]

    @cute.jit
    def qk_gemm(
        self,
        qk_mma: cute.TiledMma,
        acc_S: cute.Tensor,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        k_stage: Int32,
    ) -> cute.TiledMma:
        """Issue ``S = Q K^T`` (both operands in shared memory, K from stage ``k_stage``) and
        commit it as one WGMMA group; the caller waits. Returns ``qk_mma`` (its accumulate
        field was set here), for the caller to rebind: the DSL then carries it through dynamic
        control flow."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(qk_mma, acc_S, tSrQ[None, None, kb], tSrK[None, None, kb, k_stage], acc_S)
        warpgroup.commit_group()
        return qk_mma

    @cute.jit
    def pv_gemm(
        self,
        pv_mma: cute.TiledMma,
        acc_O: cute.Tensor,
        tOrP: cute.Tensor,
        tOrV: cute.Tensor,
        v_stage: Int32,
    ) -> cute.TiledMma:
        """Issue ``O += P V`` (P from registers, V from stage ``v_stage``) and commit it as one
        WGMMA group; the caller waits. Returns ``pv_mma``, as :meth:`qk_gemm` does."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            cute.gemm(pv_mma, acc_O, tOrP[None, None, kb], tOrV[None, None, kb, v_stage], acc_O)
        warpgroup.commit_group()
        return pv_mma

    @cute.jit
    def mask_and_softmax(
        self,
        acc_S: cute.Tensor,
        cS_mn: tuple[cute.Tensor, tuple[Int32, Int32]],
        softmax: OnlineSoftmax,
        alpha: cute.Tensor,
        n_block: Int32,
        tile: Tile,
        masked: cutlass.Constexpr[bool | None] = None,
    ) -> None:
        """The mask on block ``n_block`` when it needs one, then the online softmax: ``S``
        becomes ``P`` (fp32) in place and ``alpha`` the rows' O rescale factors. ``cS_mn`` is
        ``(thread 0's score coordinates, this thread's (row, col) offset from them)``.
        ``masked`` None decides at run time (:func:`block_needs_mask`, a branch); True or False
        is the caller's compile-time choice (:func:`split_by_mask`)."""
        acc_S_mn = acc_rows_cols(acc_S)
        window = tile.window
        needs_mask = masked
        if cutlass.const_expr(masked is None):
            needs_mask = block_needs_mask(
                n_block, tile.blocks[2], tile.blocks[3], window[0] is not None
            )
        if needs_mask:
            coords, (row_shift, col_shift) = cS_mn
            apply_mask(
                acc_S_mn,
                coords,
                tile.m_block * self.tile_m + row_shift,
                n_block * self.tile_n + col_shift,
                tile.seqlen_q,
                tile.seqlen_k,
                self.causal,
                *window,
            )
        softmax.update(acc_S_mn, alpha)

    @cute.jit
    def guard_v_padding(
        self,
        sV: cute.Tensor,
        v_stage: Int32,
        n_block: Int32,
        tile: Tile,
        tidx: Int32,
    ) -> None:
        """Varlen only (``tile.extent_k`` given): zero the V rows of block ``n_block`` (in stage
        ``v_stage``) past the tile's ``seqlen_k`` and inside the tensor, before a PV WGMMA reads
        them: NaN padding must not meet ``P = 0``."""
        if cutlass.const_expr(tile.extent_k is not None):
            pad_start, pad_end = padded_key_rows(n_block, tile.seqlen_k, tile.extent_k, self.tile_n)
            if pad_start < pad_end:
                self.zero_rows(sV[None, None, v_stage], pad_start, pad_end, tidx)

    @cute.jit
    def zero_rows(self, sV: cute.Tensor, start: Int32, end: Int32, tidx: Int32) -> None:
        """Zero the key rows ``start .. end - 1`` of one V stage ``(D, tile_n)`` in shared
        memory, all consumer threads together, then make the writes visible to the WGMMA (async
        proxy) of every consumer warpgroup before any of them reads the stage."""
        num_threads = WG_THREADS * self.num_consumer_wg
        for idx in cutlass.range(tidx, (end - start) * self.head_dim, num_threads, unroll=1):
            sV[idx % self.head_dim, start + idx // self.head_dim] = self.dtype(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=num_threads)

    @cute.jit
    def epilogue(
        self,
        softmax: OnlineSoftmax,
        acc_O: cute.Tensor,
        pv_thr: cute.core.ThrMma,
        out: Output,
        tidx: Int32,
        tile: Tile,
        v_scale: Float32 | None = None,
    ) -> None:
        """``O / row_sum`` (times ``v_scale`` when given: FP8's v descale) to global memory in
        the output dtype, and the LSE, rows below ``seqlen_q`` only."""
        mO, mLSE = out.mO, out.mLSE
        m_block, head, batch, seqlen_q = tile.m_block, tile.head, tile.batch, tile.seqlen_q
        acc_O_mn = acc_rows_cols(acc_O)
        num_rows = cute.size(acc_O_mn, mode=[0])
        inv_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        lse = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        softmax.finalize(inv_sum, lse)
        if cutlass.const_expr(v_scale is not None):
            for r in cutlass.range_constexpr(num_rows):
                inv_sum[r] = inv_sum[r] * v_scale
        rescale_rows(acc_O_mn, inv_sum)
        rO = cute.make_rmem_tensor_like(acc_O, self.out_dtype)
        rO.store(acc_O.load().to(self.out_dtype))

        row0 = m_block * self.tile_m
        gO = cute.local_tile(
            mO[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0)
        )
        tOgO = pv_thr.partition_C(gO)
        cO = pv_thr.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        for i in cutlass.range(cute.size(rO), unroll_full=True):
            if row0 + cO[i][0] < seqlen_q:
                tOgO[i] = rO[i]

        self.store_lse(lse, acc_rows_cols(cO), mLSE, tile, tidx)

    @cute.jit
    def store_lse(
        self, lse: cute.Tensor, cO_mn: cute.Tensor, mLSE: cute.Tensor, tile: Tile, tidx: Int32
    ) -> None:
        """The thread's rows of ``lse`` (``cO_mn``: the coordinates of its O fragment, rows by
        columns) to ``mLSE``, by the first lane of each row's quad, rows below ``seqlen_q``."""
        gLSE = mLSE[None, tile.head, tile.batch]
        row0 = tile.m_block * self.tile_m
        if tidx % 4 == 0:  # the first lane of each row's quad
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = row0 + cO_mn[r, 0][0]
                if row < tile.seqlen_q:
                    gLSE[row] = lse[r]

    @cute.jit
    def epilogue_smem(
        self,
        softmax: OnlineSoftmax,
        acc_O: cute.Tensor,
        pv_mma: cute.TiledMma,
        sO: cute.Tensor,
        out: Output,
        tidx: Int32,
        tile: Tile,
    ) -> None:
        """``smem_epilogue``: ``O / row_sum`` in the input dtype into the Q buffer ``sO`` by
        ``stmatrix`` (16-byte rows of 8 x 8 blocks; the 128-byte swizzle puts a block's 8 rows
        in 8 different bank groups), the two warpgroups meet, then

        * ``out.tma_o`` given (not varlen): the first consumer thread issues one TMA store of the
          whole ``tile_m x D`` tile, clipped by the TMA unit at the tensor's row extent (the
          padded ``S``, which is ``seqlen_q`` here), and waits until the TMA unit has read the
          buffer (the CTA must not exit before);
        * ``out.tma_o`` None (varlen: rows past ``seqused_q`` must stay unwritten, which a TMA box
          clipped at ``S`` would not honour): every consumer thread copies 16-byte chunks from
          ``sO`` to global memory, one row per chunk, only rows below ``seqlen_q``.

        The LSE as :meth:`epilogue` writes it. Reusing Q's buffer is safe without waiting for
        the other warpgroup: a warpgroup's QK^T WGMMAs read only its own 64 rows of ``sQ`` (both
        MMAs tile M by warpgroup), all of them are complete (``wait_group(0)``) before its
        epilogue, and it writes only its own 64 rows of ``sO``. The generic-proxy writes are
        fenced for the async proxy (the TMA store) before the barrier."""
        mO, mLSE, tma_o = out
        m_block, head, batch, seqlen_q = tile.m_block, tile.head, tile.batch, tile.seqlen_q
        acc_O_mn = acc_rows_cols(acc_O)
        num_rows = cute.size(acc_O_mn, mode=[0])
        inv_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        lse = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
        softmax.finalize(inv_sum, lse)
        rescale_rows(acc_O_mn, inv_sum)
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))

        store_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32)
        smem_copy = cute.make_tiled_copy_C(store_atom, pv_mma).get_slice(tidx)
        cute.copy(smem_copy, smem_copy.retile(rO), smem_copy.partition_D(sO))
        cute.arch.fence_proxy("async.shared", space="cta")
        num_threads = WG_THREADS * self.num_consumer_wg
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=num_threads)
        row0 = m_block * self.tile_m
        gO = cute.local_tile(
            mO[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0)
        )
        if cutlass.const_expr(tma_o is not None):
            if tidx == 0:
                tOsO, tOgO = cute.nvgpu.cpasync.tma_partition(
                    tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                    cute.group_modes(gO, 0, 2),
                )  # fmt: skip
                cute.copy(tma_o, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            self.store_rows_from_smem(sO, gO, tidx, seqlen_q - row0)

        cO = pv_mma.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.tile_m, self.head_dim))
        )
        self.store_lse(lse, acc_rows_cols(cO), mLSE, tile, tidx)

    @cute.jit
    def store_rows_from_smem(
        self, sO: cute.Tensor, gO: cute.Tensor, tidx: Int32, valid_rows: Int32
    ) -> None:
        """Copy the ``tile_m x D`` tile ``sO`` to ``gO`` in 16-byte chunks (8 elements of a row;
        consecutive threads take consecutive chunks of a row), only rows ``< valid_rows``."""
        chunk = 128 // self.dtype.width
        chunks_per_row = self.head_dim // chunk
        num_threads = WG_THREADS * self.num_consumer_wg
        copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_ordered_layout((num_threads // chunks_per_row, chunks_per_row), order=(1, 0)),
            cute.make_layout((1, chunk)),
        )
        thr = copy.get_slice(tidx)
        tOsO = thr.partition_S(sO)
        tOgO = thr.partition_D(gO)
        tOcO = thr.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            if tOcO[0, m, 0][0] < valid_rows:
                cute.copy(copy, tOrO[None, m, None], tOgO[None, m, None])

    # ------------------------------------------------------------------ compile-only

    def compile(
        self, *, options: str = "", varlen: bool = False, window: bool = False, max_ctas: int = 132
    ) -> object:
        """The CPU-only check: compile for sm_90a on fake tensors (no GPU touched), with the
        varlen lengths and the window bounds as arguments when asked, and ``max_ctas`` (a
        runtime ``Int32``, its value irrelevant to the code) when ``persistent``."""
        return compile_on_fake_tensors(
            self, self.dtype, "sm_90a", options, varlen=varlen, window=window,
            max_ctas=max_ctas if self.persistent else None, fp8=self.fp8,
        )  # fmt: skip
