"""The project's own CuTe DSL kernels: compile-only checks on the CPU, correctness on the GPU.

CPU (``cutlass`` from nvidia-cutlass-dsl, no GPU): the SM90 kernel compiles for sm_90a in every
configuration the adapters ``own-sm90`` and ``own-sm90-full`` declare, in the variant they run
(``DEFAULT_KNOBS``: overlap, pingpong, longest_first, smem_epilogue, m192) and in the baseline
without knobs, and
the PTX holds the instructions that prove the hardware path (WGMMA, TMA, ex2.approx, setmaxnreg
honoured through ``.minnctapersm 1``; for the varlen path of ``own-sm90-full`` also the proxy
fence and the named barrier that guard the zeroed V rows) and the signature of each knob (e.g. a
``wgmma.wait_group 1`` per loop for the overlap, which the baseline never has); ptxas reports no
spills. Every knob, and combinations of them, compiles the same way. The kernel's walk over the KV
blocks (which blocks a query tile visits, which it masks, which V rows it zeroes) is replayed in
NumPy from the same helpers the kernel calls, and checked against the one visibility predicate
(reference/masks.py), with GQA-free lengths, causal and windows drawn by Hypothesis.

GPU: the adapters under the defensive harness, on Hypothesis cases inside their declarations
(the test of properties/test_kernels.py) and on targeted cases (multi-block rescale, seqlen_k
residue, bottom-right causal with empty rows; for ``own-sm90-full``: GQA, NaN padding in a partial
last block, empty sequences, window edges); both adapters run ``DEFAULT_KNOBS`` unless
``ATTENTION_CROSSVAL_SM90_OVERLAP`` picks another variant.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_crossval.kernel.adapters.own_sm90 import DEFAULT_KNOBS, window_bounds
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.registry import BUILTIN, UNPROVEN, resolve
from attention_crossval.properties.kernel_suite import free_property
from attention_crossval.properties.kernels_under_test import worker
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.masks import visible
from tests.kernel.own_kernels import (
    CONFIGS,
    HAS_CUTLASS,
    TARGETED,
    assert_no_spills,
    dsl_arch_sm90a,  # noqa: F401 - a fixture, used by name
    launch_compiles,  # noqa: F401 - a fixture, used by name
    needs_cutlass,
    needs_tvm_ffi,
    ramp_case,
)

# own-sm90-full: every case goes through the varlen path; the window is a compile-time choice.
FULL_CONFIGS = [(*config, window) for config in CONFIGS for window in (False, True)]
PTX_MUST_HAVE = (
    "wgmma.mma_async.sync.aligned",
    "ex2.approx.ftz.f32",
    "cp.async.bulk.tensor",
    "setmaxnreg",
    ".minnctapersm 1",
)
# The zeroed V rows of a partial block: generic-proxy stores made visible to the WGMMA (async
# proxy), then the consumer warpgroups' named barrier (1, on all their threads).
VARLEN_FENCE = "fence.proxy.async.shared::cta"


def consumer_barrier(kernel: object) -> str:
    """The PTX of the consumer warpgroups' named barrier (1) in ``kernel``: 256 threads, or
    384 with three consumer warpgroups (``m192`` at D = 64)."""
    return f"bar.sync 1, {128 * kernel.num_consumer_wg}"


# The overlap knob's signature: wait until one WGMMA group (the PV) is left in flight, while the
# softmax works on the S the other group produced. The baseline kernel always waits for all.
OVERLAP_WAIT = "wgmma.wait_group.sync.aligned 1;"
# The overlap kernel, in each dense-path configuration, plain and through the varlen + window
# path (3 loops over the blocks), and varlen alone once (2 loops).
OVERLAP_CONFIGS = [(*config, path) for config in CONFIGS for path in ("plain", "varlen+window")]
OVERLAP_CONFIGS.append(("bfloat16", 128, True, "varlen"))
# The adapters' variant (knobs_from_env() when ATTENTION_CROSSVAL_SM90_OVERLAP is unset) and the
# kernel without knobs (=baseline).
VARIANT_KNOBS = {"default": dict.fromkeys(DEFAULT_KNOBS, True), "baseline": {}}


def _sm90(dtype: str, head_dim: int, causal: bool, **knobs: bool):
    """The kernel as the adapters build it, with the launch ``knobs`` given."""
    from attention_crossval.kernel.adapters.own_sm90 import make_kernel

    return make_kernel(dtype, head_dim, causal, **knobs)


def _ptx(compiled: object) -> str:
    """The PTX text of a compile with ``--keep-ptx`` (the DSL gives the text or its file)."""
    ptx = compiled.artifacts.PTX
    text = Path(ptx).read_text() if "\n" not in ptx and Path(ptx).is_file() else ptx
    return re.sub(r"[ \t]+", " ", text)


def _variant_ptx(kernel: object, dtype: str, head_dim: int, path: str, tmp_path: Path) -> str:
    """The PTX of ``kernel`` (:func:`_sm90` with a variant's knobs) through ``path`` ("plain",
    "varlen", "varlen+window"), compiled with ptxas' remarks (for :func:`assert_no_spills`),
    after the checks every variant must pass: the hardware path, and on the varlen path the
    guard of the zeroed V rows."""
    varlen, window = "varlen" in path, "window" in path
    options = f"--keep-ptx --dump-dir={tmp_path} remarks{{ptx}}"
    ptx = _ptx(kernel.compile(options=options, varlen=varlen, window=window))
    assert_sm90_ptx(ptx, dtype, head_dim)
    if varlen:
        missing = [s for s in (VARLEN_FENCE, consumer_barrier(kernel)) if s not in ptx]
        assert not missing, f"PTX lacks {missing}"
    assert f".reqntid {128 * (kernel.num_consumer_wg + 1)}, 1, 1" in ptx
    return ptx


def _overlap_loops(path: str) -> int:
    """The overlap kernel's loops over the blocks: masked top, unmasked middle, and with a
    window a masked bottom."""
    return 3 if "window" in path else 2


def assert_sm90_ptx(ptx: str, dtype: str, head_dim: int) -> None:
    """The hardware path is in the PTX: WGMMA of both GEMMs' shapes, TMA, ex2, setmaxnreg."""
    missing = [spelling for spelling in PTX_MUST_HAVE if spelling not in ptx]
    assert not missing, f"PTX lacks {missing}"
    mma = "bf16.bf16" if dtype == "bfloat16" else "f16.f16"
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{mma}" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.{mma}" in ptx


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize("variant", list(VARIANT_KNOBS))
@pytest.mark.parametrize(("dtype", "head_dim", "causal"), CONFIGS)
def test_sm90_compiles_to_wgmma_tma_ex2(
    dtype: str,
    head_dim: int,
    causal: bool,
    variant: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Every configuration of ``own-sm90``'s dense path compiles for sm_90a without a GPU, down
    to the hardware instructions (a silently wrong arch or a scalar fallback would lose them),
    without spills, in the variant the adapter runs (``DEFAULT_KNOBS``, each knob's signature in
    the PTX) and in the baseline (no knob's signature)."""
    kernel = _sm90(dtype, head_dim, causal, **VARIANT_KNOBS[variant])
    ptx = _variant_ptx(kernel, dtype, head_dim, "plain", tmp_path)
    assert consumer_barrier(kernel) not in ptx  # not the varlen path (zeroed V rows)
    assert_variant_ptx(ptx, variant, kernel, causal, "plain")
    assert_no_spills("".join(capfd.readouterr()))


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(
    ("dtype", "head_dim", "causal", "window", "variant"),
    [(*config, "default") for config in FULL_CONFIGS]
    + [(*config, "baseline") for config in FULL_CONFIGS if config[0] == "bfloat16" and config[3]]
    + [("float16", 64, False, False, "baseline")],
)
def test_sm90_full_compiles_without_spills(
    dtype: str,
    head_dim: int,
    causal: bool,
    window: bool,
    variant: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Every variant ``own-sm90-full`` compiles (GQA, per-batch lengths, with or without a
    window, causal or not) builds for sm_90a with the hardware path, the guard of the zeroed V
    rows, and no register spills (ptxas' report of the same compile), with ``DEFAULT_KNOBS`` (the
    adapter's variant: all 16, each knob's signature in the PTX) and as the baseline (5 of them,
    no knob's signature)."""
    path = "varlen+window" if window else "varlen"
    kernel = _sm90(dtype, head_dim, causal, **VARIANT_KNOBS[variant])
    ptx = _variant_ptx(kernel, dtype, head_dim, path, tmp_path)
    assert_variant_ptx(ptx, variant, kernel, causal, path)
    assert_no_spills("".join(capfd.readouterr()))


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("dtype", "head_dim", "causal", "path"), OVERLAP_CONFIGS)
def test_sm90_overlap_compiles_without_spills(
    dtype: str,
    head_dim: int,
    causal: bool,
    path: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The ``overlap=True`` kernel (alone: run on the H200 only in benchmarks/bench_own_sm90.py)
    builds for sm_90a with the
    hardware path and no register spills (two S-sized fragments live at once: S of the next
    block and P of the current one), and its PTX shows the overlap: per masked / unmasked loop
    over the blocks one ``wgmma.wait_group 1`` (S ready, PV still in flight) between the commit
    of both GEMMs and the final ``wait_group 0``; the WGMMA group count (two per loop iteration,
    plus the first block's S and the last block's PV) says both GEMMs are issued in the loop."""
    kernel = _sm90(dtype, head_dim, causal, overlap=True)
    ptx = _variant_ptx(kernel, dtype, head_dim, path, tmp_path)
    loops = _overlap_loops(path)
    assert ptx.count(OVERLAP_WAIT) == loops
    assert ptx.count("wgmma.commit_group.sync.aligned;") == 2 * loops + 2
    assert ptx.count("wgmma.wait_group.sync.aligned 0;") == loops + 2
    assert_no_spills("".join(capfd.readouterr()))


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(
    ("dtype", "head_dim", "causal", "path", "m192"),
    [
        ("bfloat16", 128, False, "plain", False),
        ("bfloat16", 128, True, "plain", False),
        ("float16", 64, True, "varlen+window", False),
        ("bfloat16", 128, False, "varlen", False),
        ("bfloat16", 64, False, "plain", True),
        ("float16", 64, True, "varlen+window", True),
    ],
)
def test_sm90_pingpong_compiles_without_spills(
    dtype: str,
    head_dim: int,
    causal: bool,
    path: str,
    m192: bool,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``overlap=True, pingpong=True`` (alone; with two or, ``m192`` at D = 64, three consumer
    warpgroups) builds without spills and with the warpgroups' turn-taking in the PTX
    (:func:`assert_pingpong_turns`); the overlap's waits as without ping-pong."""
    kernel = _sm90(dtype, head_dim, causal, overlap=True, pingpong=True, m192=m192)
    assert kernel.num_consumer_wg == (3 if m192 else 2)
    ptx = _variant_ptx(kernel, dtype, head_dim, path, tmp_path)
    loops = _overlap_loops(path)
    assert ptx.count(OVERLAP_WAIT) == loops
    assert_pingpong_turns(ptx, loops)
    assert_no_spills("".join(capfd.readouterr()))


def assert_pingpong_turns(ptx: str, loops: int) -> None:
    """The ping-pong in the PTX: the first warpgroup's one ``bar.arrive`` on its own barrier
    (2) before the loops (its first turn), then per loop over the blocks one ``bar.sync`` on the
    warpgroup's barrier before its GEMMs and one ``bar.arrive`` on the next warpgroup's after
    them, each on 256 threads (the waiting warpgroup and the one handing over)."""
    assert ptx.count("bar.arrive 2, 256;") == 1
    assert len(re.findall(r"bar\.sync %r\d+, 256;", ptx)) == loops
    assert len(re.findall(r"bar\.arrive %r\d+, 256;", ptx)) == loops


@pytest.mark.cpu
@needs_cutlass
def test_sm90_pingpong_needs_overlap() -> None:
    """Ping-pong exists only on top of the overlap loop, with two or more consumer
    warpgroups."""
    with pytest.raises(ValueError, match="pingpong"):
        _sm90("bfloat16", 128, False, pingpong=True)


# The longest_first knob's signature: the grid's x extent, read to reverse blockIdx.x.
LONGEST_FIRST_SREG = "%nctaid.x"


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(
    ("dtype", "head_dim", "causal", "path"),
    [
        ("bfloat16", 128, True, "plain"),
        ("float16", 64, True, "plain"),
        ("bfloat16", 128, False, "varlen+window"),
        ("float16", 64, True, "varlen"),
    ],
)
def test_sm90_longest_first_compiles_without_spills(
    dtype: str,
    head_dim: int,
    causal: bool,
    path: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``longest_first=True`` (on top of ``overlap``; part of ``DEFAULT_KNOBS``) builds
    without spills and reverses the query tiles where their work differs (causal or windowed):
    the PTX reads the grid's x extent (``%nctaid.x``) for ``m_block = nctaid.x - 1 - ctaid.x``,
    which no other one-tile variant reads."""
    kernel = _sm90(dtype, head_dim, causal, overlap=True, longest_first=True)
    ptx = _variant_ptx(kernel, dtype, head_dim, path, tmp_path)
    assert LONGEST_FIRST_SREG in ptx  # once, or copied by the compiler into branches
    assert ptx.count(OVERLAP_WAIT) == _overlap_loops(path)
    assert_no_spills("".join(capfd.readouterr()))


@pytest.mark.cpu
@needs_cutlass
def test_sm90_longest_first_leaves_uniform_tiles_alone(tmp_path: Path) -> None:
    """Without a causal mask or a window every query tile has the same work, so
    ``longest_first`` changes nothing: the PTX equals the kernel's without the knob."""
    ptxs = []
    for longest_first in (False, True):
        kernel = _sm90("bfloat16", 128, False, longest_first=longest_first)
        ptxs.append(_ptx(kernel.compile(options=f"--keep-ptx --dump-dir={tmp_path}")))
        assert_sm90_ptx(ptxs[-1], "bfloat16", 128)
    assert LONGEST_FIRST_SREG not in ptxs[0] and ptxs[0] == ptxs[1]


@pytest.mark.cpu
@needs_cutlass
def test_sm90_longest_first_order_is_a_permutation() -> None:
    """The CTA -> query tile map (:func:`tile_for_block`, on Python ints as in the kernel) is a
    permutation of the tiles, in decreasing causal work with ``longest_first``: every tile is
    computed exactly once (the block walk of each tile is the one replayed below), and the
    first CTA gets the tile with the most KV blocks."""
    from attention_crossval.kernel.own.common.mask import kv_block_range
    from attention_crossval.kernel.own.sm90.schedule import tile_for_block

    for num_m_blocks in (1, 2, 7, 32):
        for longest_first in (False, True):
            tiles = [tile_for_block(x, num_m_blocks, longest_first) for x in range(num_m_blocks)]
            assert sorted(tiles) == list(range(num_m_blocks))
        S = 128 * num_m_blocks
        work = [
            (lambda r: r[1] - r[0])(kv_block_range(m, S, S, 128, 128, True))
            for m in (tile_for_block(x, num_m_blocks, True) for x in range(num_m_blocks))
        ]
        assert work == sorted(work, reverse=True)


@pytest.mark.cpu
@needs_cutlass
def test_sm90_has_no_register_spills(capfd: pytest.CaptureFixture[str]) -> None:
    """ptxas (run by the DSL with ``remarks{ptx}``) reports 0 spill bytes for the baseline
    kernel's largest configuration (D = 128, causal: most live registers; the adapters' variant
    is checked for spills in every configuration above)."""
    _sm90("bfloat16", 128, True).compile(options="remarks{ptx}")
    assert_no_spills("".join(capfd.readouterr()))


# A masked score becomes -inf by one select (kernel/own/common/mask.py); the kernel has few others.
MASK_SELECT = re.compile(r"selp\.f32\s")
SCORES_PER_THREAD = 64  # a warpgroup's 64 x 128 scores over its 128 threads


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(
    ("dtype", "head_dim", "causal", "path"),
    [("bfloat16", 128, True, "plain"), ("float16", 64, False, "varlen+window")],
)
def test_sm90_mask_is_one_select_per_score(
    dtype: str, head_dim: int, causal: bool, path: str, tmp_path: Path
) -> None:
    """The mask costs one select of ``-inf`` per score where it runs (the first block and
    each masked loop: two to four copies in the PTX; 146 and 276 ``selp.f32`` in all in these
    two configurations), so at most six scores' worth of selects per thread. Written as an
    ``if`` per score, the mask compiled to a cascade of selects growing with the square of the
    scores (2098 in the first configuration, 996 FSEL per masked block in SASS) or to branches
    (24 selects in the second), which this count catches (both forms were seen)."""
    kernel = _sm90(dtype, head_dim, causal, **VARIANT_KNOBS["default"])
    ptx = _variant_ptx(kernel, dtype, head_dim, path, tmp_path)
    selects = len(MASK_SELECT.findall(ptx))
    assert SCORES_PER_THREAD * 2 <= selects <= SCORES_PER_THREAD * 6, selects


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("head_dim", "num_wg"), [(64, 2), (128, 2), (64, 3)])
def test_sm90_register_views_match_the_mma_layouts(head_dim: int, num_wg: int) -> None:
    """The kernel's re-views of WGMMA fragments, checked on coordinates at trace time:

    * ``acc_as_operand_a`` of the S accumulator holds, value for value, the (row, key) the PV
      WGMMA expects in its register A operand (P never leaves registers, so a wrong view would
      multiply P by the wrong V rows);
    * ``acc_rows_cols`` rows hold one query row each, the same rows in S and in O (the O
      rescale by ``alpha`` and the final ``1 / row_sum`` hit the right rows), and the four lanes
      of a quad hold every column of their rows exactly once (the 4-lane row reductions).
    """
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from attention_crossval.kernel.adapters.own_sm90 import TILE_N
    from attention_crossval.kernel.own.sm90.fwd import ROWS_PER_WG, acc_as_operand_a, acc_rows_cols

    tile_m = ROWS_PER_WG * num_wg  # num_wg consumer warpgroups: 128 or (m192) 192 rows
    threads = [0, 1, 2, 3, 4, 5, 6, 7, 31, 32, 33, 34, 35, 97, 127, 128, 129, 130, 131, 254]
    threads += [256, 257, 290, 383] if num_wg == 3 else []
    seen: dict[str, dict[int, object]] = {"a": {}, "p": {}, "s_rows": {}, "o_rows": {}}

    def coords(tensor: cute.Tensor) -> list:
        return [tensor[i] for i in range(cute.size(tensor))]

    def rows_cols(tensor: cute.Tensor) -> list[list]:
        view = acc_rows_cols(tensor)
        return [
            [view[r, c] for c in range(cute.size(view, mode=[1]))]
            for r in range(cute.size(view, mode=[0]))
        ]

    @cute.jit
    def trace() -> None:
        dtype, k_major = cutlass.BFloat16, OperandMajorMode.K
        atoms = (num_wg, 1, 1)
        qk = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, cutlass.Float32, atoms, (ROWS_PER_WG, TILE_N)
        )
        pv = sm90_utils.make_trivial_tiled_mma(
            dtype,
            dtype,
            k_major,
            OperandMajorMode.MN,
            cutlass.Float32,
            atoms,
            (ROWS_PER_WG, head_dim),
            warpgroup.OperandSource.RMEM,
        )
        for t in threads:
            cS = qk.get_slice(t).partition_C(cute.make_identity_tensor((tile_m, TILE_N)))
            cA = pv.get_slice(t).partition_A(cute.make_identity_tensor((tile_m, TILE_N)))
            cO = pv.get_slice(t).partition_C(cute.make_identity_tensor((tile_m, head_dim)))
            seen["a"][t], seen["p"][t] = coords(cA), coords(acc_as_operand_a(cS))
            seen["s_rows"][t], seen["o_rows"][t] = rows_cols(cS), rows_cols(cO)

    cute.compile(trace, options="--gpu-arch=sm_90a")
    for t in threads:
        assert seen["p"][t] == seen["a"][t], f"thread {t}: P view != PV A operand"
        s_rows = [{row for row, _ in line} for line in seen["s_rows"][t]]
        o_rows = [{row for row, _ in line} for line in seen["o_rows"][t]]
        assert all(len(rows) == 1 for rows in s_rows), f"thread {t}: a view row mixes rows"
        assert s_rows == o_rows, f"thread {t}: S rows {s_rows} != O rows {o_rows}"
    for quad in (0, 4, 32, 128):
        for r in range(len(seen["s_rows"][quad])):
            cols = sorted(col for t in range(quad, quad + 4) for _, col in seen["s_rows"][t][r])
            assert cols == list(range(TILE_N)), f"quad at lane {quad}, row {r}: columns {cols}"


# smem_epilogue: O into shared memory by stmatrix, the generic-proxy writes fenced for the TMA
# unit, the consumer warpgroups' epilogue barrier (4); then a TMA store (global <- shared) whose
# reads the issuing thread waits for, or under varlen 16-byte chunks through registers.
SMEM_EPILOGUE_FENCE = "fence.proxy.async.shared::cta"
STMATRIX = "stmatrix.sync.aligned.m8n8.x4.shared.b16"
TMA_STORE = "cp.async.bulk.tensor.4d.global.shared::cta"
TMA_STORE_READ_WAIT = "cp.async.bulk.wait_group.read 0;"
SMEM_EPILOGUE_CONFIGS = [
    ("bfloat16", 128, True, "plain", ("overlap", "longest_first")),
    ("float16", 128, False, "plain", ("overlap",)),
    ("bfloat16", 64, True, "plain", ()),
    ("float16", 64, False, "plain", ("overlap", "longest_first")),
    ("bfloat16", 128, True, "varlen+window", ("overlap", "longest_first")),
    ("float16", 64, False, "varlen", ()),
    ("bfloat16", 64, True, "plain", ("overlap", "m192")),
    ("float16", 64, False, "varlen", ("m192",)),
]


def epilogue_barrier(kernel: object) -> str:
    """The PTX of the consumer warpgroups' epilogue barrier (5) in ``kernel``."""
    return f"bar.sync 5, {128 * kernel.num_consumer_wg};"


def assert_variant_ptx(ptx: str, variant: str, kernel: object, causal: bool, path: str) -> None:
    """Each knob of ``variant`` (:data:`VARIANT_KNOBS`) leaves its signature in the PTX, and the
    baseline none: the overlap's ``wait_group 1`` per loop over the blocks; the ping-pong's
    turns (:func:`assert_pingpong_turns`); longest-first's read of ``%nctaid.x`` where query
    tiles differ in work (causal or a window; otherwise the knob compiles to nothing); the
    shared-memory epilogue's ``stmatrix`` and no 2-byte global store, then without varlen its
    TMA store, where the baseline stores O element by element; ``m192``'s three consumer
    warpgroups at D = 64 (two at D = 128, and in the baseline), which :func:`_variant_ptx`
    finds in the PTX's thread count."""
    assert set(DEFAULT_KNOBS) == {"overlap", "pingpong", "longest_first", "smem_epilogue", "m192"}
    head_dim = kernel.head_dim
    if variant == "baseline":
        assert OVERLAP_WAIT not in ptx and LONGEST_FIRST_SREG not in ptx
        assert STMATRIX not in ptx and TMA_STORE not in ptx and "st.global.b16" in ptx
        assert "bar.arrive" not in ptx and kernel.num_consumer_wg == 2
        return
    loops = _overlap_loops(path)
    assert ptx.count(OVERLAP_WAIT) == loops
    assert_pingpong_turns(ptx, loops)
    # present where tiles differ in work (the compiler may copy the read into branches)
    assert (LONGEST_FIRST_SREG in ptx) == (causal or "window" in path)
    assert ptx.count(STMATRIX) == head_dim // 16 and "st.global.b16" not in ptx
    assert ptx.count(TMA_STORE) == (0 if "varlen" in path else head_dim // 64)
    assert kernel.num_consumer_wg == (3 if head_dim == 64 else 2)


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("dtype", "head_dim", "causal", "path", "knobs"), SMEM_EPILOGUE_CONFIGS)
def test_sm90_smem_epilogue_compiles_without_spills(
    dtype: str,
    head_dim: int,
    causal: bool,
    path: str,
    knobs: tuple[str, ...],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``smem_epilogue=True`` (alone or with the other knobs; part of ``DEFAULT_KNOBS``)
    builds without spills, and O leaves in wide stores only: ``D / 16`` ``stmatrix.x4`` per
    thread into the Q buffer, the proxy fence and the epilogue barrier, then without varlen one
    TMA store per 64-column box (``D / 64``) and the wait for its reads, with varlen ``D / 16``
    16-byte shared loads and 16-byte global stores per thread; no 2-byte global store (the
    baseline epilogue's per-element ``st.global.b16``) is left."""
    kernel = _sm90(dtype, head_dim, causal, smem_epilogue=True, **dict.fromkeys(knobs, True))
    ptx = _variant_ptx(kernel, dtype, head_dim, path, tmp_path)
    missing = [x for x in (SMEM_EPILOGUE_FENCE, epilogue_barrier(kernel)) if x not in ptx]
    assert not missing, f"PTX lacks {missing}"
    assert ptx.count(STMATRIX) == head_dim // 16
    assert "st.global.b16" not in ptx
    if "varlen" in path:
        assert TMA_STORE not in ptx
        assert ptx.count("ld.shared.v4.b32") == ptx.count("st.global.v4.b32") == head_dim // 16
    else:
        assert ptx.count(TMA_STORE) == head_dim // 64
        assert ptx.count(TMA_STORE_READ_WAIT) == 1
        assert "st.global.v4" not in ptx
    assert_no_spills("".join(capfd.readouterr()))


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("head_dim", "num_wg"), [(64, 2), (128, 2), (64, 3)])
def test_sm90_smem_epilogue_copies_match_the_mma_layout(head_dim: int, num_wg: int) -> None:
    """The ``smem_epilogue`` copies, checked on coordinates at trace time, over all 256
    consumer threads (384 with three consumer warpgroups, ``m192`` at D = 64):

    * the ``stmatrix`` copy takes each thread's O registers (re-viewed by ``retile``) as the
      (row, col) values the PV accumulator holds there, and its destinations cover the
      ``tile_m x D`` tile exactly once (every O value lands at its own place in ``sO``);
    * the varlen chunk copy (:meth:`store_rows_from_smem`) gives each thread 8 consecutive
      columns of one row per chunk and covers the tile exactly once.
    """
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    from attention_crossval.kernel.own.sm90.fwd import ROWS_PER_WG, WG_THREADS

    tile_m, threads = ROWS_PER_WG * num_wg, WG_THREADS * num_wg
    thread_ids = list(range(threads))
    sources: list[tuple[list, list]] = []
    written: list = []
    chunks: list = []

    def coords(tensor: cute.Tensor) -> list:
        return [tensor[i] for i in range(cute.size(tensor))]

    @cute.jit
    def trace() -> None:
        dtype = cutlass.BFloat16
        pv = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32,
            (num_wg, 1, 1), (ROWS_PER_WG, head_dim), warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dtype, cutlass.Float32)
        stsm = cute.make_tiled_copy_C(atom, pv)
        tile = cute.make_identity_tensor((tile_m, head_dim))
        chunks_per_row = head_dim // 8
        rows = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
            cute.make_ordered_layout((threads // chunks_per_row, chunks_per_row), order=(1, 0)),
            cute.make_layout((1, 8)),
        )
        for t in thread_ids:  # a Python list: a trace-time loop, no DSL range
            thr = stsm.get_slice(t)  # (no `if` here: the DSL would trace both branches)
            sources.append(
                (
                    coords(thr.retile(pv.get_slice(t).partition_C(tile))),
                    coords(thr.partition_S(tile)),
                )
            )
            written.extend(coords(thr.partition_D(tile)))
            part = rows.get_slice(t).partition_S(tile)
            for m in cutlass.range_constexpr(cute.size(part, mode=[1])):
                chunks.append(coords(part[None, m, None]))

    cute.compile(trace, options="--gpu-arch=sm_90a")
    everything = sorted((r, c) for r in range(tile_m) for c in range(head_dim))
    mismatched = [t for t, (held, taken) in enumerate(sources) if held != taken]
    assert len(sources) == threads and not mismatched, (
        f"stmatrix sources differ from the accumulator at threads {mismatched}"
    )
    assert sorted(tuple(x) for x in written) == everything
    assert all(
        [tuple(x) for x in chunk] == [(chunk[0][0], chunk[0][1] + j) for j in range(8)]
        and chunk[0][1] % 8 == 0
        for chunk in chunks
    )
    assert sorted(tuple(x) for chunk in chunks for x in chunk) == everything


# persistent: each role loops over the tiles with stride gridDim.x (one %nctaid.x read per role:
# the producer warp's loop and the consumers'), the consumers release the Q stage once per tile
# (Q's empty barriers sit 16 bytes into the barrier storage, after its two full barriers), and
# no pipeline wait has a literal phase: every stage's phase is carried from tile to tile (the
# one-tile kernel's first waits use the constant initial phase).
PERSISTENT_Q_RELEASE = re.compile(r"mbarrier\.arrive\.shared\.b64 %rd\d+, \[%r\d+\+16\]")
LITERAL_PHASE_WAIT = re.compile(r"mbarrier\.try_wait\.parity\.shared\.b64 P1, \[[^\]]*\], \d+,")
# Shared memory of the persistent kernel (two Q stages), against the 227 KB an H100/H200 CTA
# may use: 197632 bytes at D = 128 (164864 without the knob), 99328 at D = 64 (82944).
PERSISTENT_SMEM = {64: 99328, 128: 197632}
SM90_SMEM_LIMIT = 227 * 1024
PERSISTENT_CONFIGS = [
    ("bfloat16", 128, True, "plain", ("overlap",)),
    ("float16", 128, False, "plain", ("overlap",)),
    ("bfloat16", 64, True, "plain", ()),
    ("float16", 64, False, "plain", ()),
    ("bfloat16", 128, True, "varlen+window", ("overlap",)),
    ("float16", 128, True, "varlen+window", ()),
    ("bfloat16", 64, False, "varlen+window", ("overlap",)),
    ("float16", 64, True, "varlen", ()),
    ("bfloat16", 128, False, "varlen", ("overlap",)),
]


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("dtype", "head_dim", "causal", "path", "knobs"), PERSISTENT_CONFIGS)
def test_sm90_persistent_compiles_without_spills(
    dtype: str,
    head_dim: int,
    causal: bool,
    path: str,
    knobs: tuple[str, ...],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``persistent=True`` (with or without ``overlap``; run on the H200 only in the benchmark)
    builds without spills in shared memory an SM90 CTA has, and its PTX shows the tile loop:
    both roles read ``%nctaid.x`` (the loop stride), the consumers release the Q stage once per
    tile, and no pipeline wait uses a literal phase (the states continue across tiles; a state
    restarted per tile would wait on the initial phase again, the hang or the stale read the
    persistent kernel must not have). The overlap loops keep their ``wait_group 1``."""
    kernel = _sm90(dtype, head_dim, causal, persistent=True, **dict.fromkeys(knobs, True))
    ptx = _variant_ptx(kernel, dtype, head_dim, path, tmp_path)
    assert ptx.count(LONGEST_FIRST_SREG) == 2
    assert len(PERSISTENT_Q_RELEASE.findall(ptx)) == 1
    assert not LITERAL_PHASE_WAIT.search(ptx)
    if "overlap" in knobs:
        assert ptx.count(OVERLAP_WAIT) == _overlap_loops(path)
    else:
        assert OVERLAP_WAIT not in ptx
    size = kernel.shared_storage.size_in_bytes()
    assert size == PERSISTENT_SMEM[head_dim] and size <= SM90_SMEM_LIMIT
    assert_no_spills("".join(capfd.readouterr()))


@pytest.mark.cpu
@needs_cutlass
def test_sm90_one_tile_kernel_waits_on_literal_phases(tmp_path: Path) -> None:
    """The control of the literal-phase check above: the one-tile baseline kernel's first waits
    use the constant initial phase, and it reads no ``%nctaid.x`` nor releases Q."""
    ptx = _ptx(_sm90("bfloat16", 128, True).compile(options=f"--keep-ptx --dump-dir={tmp_path}"))
    assert LITERAL_PHASE_WAIT.search(ptx)
    assert LONGEST_FIRST_SREG not in ptx and not PERSISTENT_Q_RELEASE.search(ptx)


@pytest.mark.cpu
@needs_cutlass
def test_sm90_persistent_implies_longest_first(tmp_path: Path) -> None:
    """The persistent kernel orders causal tiles longest-first by itself: with or without the
    ``longest_first`` knob it compiles to the same PTX."""
    ptxs = [
        _ptx(
            _sm90("bfloat16", 128, True, overlap=True, persistent=True, longest_first=lf).compile(
                options=f"--keep-ptx --dump-dir={tmp_path}"
            )
        )
        for lf in (False, True)
    ]
    assert ptxs[0] == ptxs[1]


@pytest.mark.cpu
@needs_cutlass
def test_sm90_persistent_forbidden_combinations() -> None:
    """``persistent`` with ``pingpong`` (its pending arrive would pile up once per tile) or
    with ``smem_epilogue`` (O in Q's buffer would race the next tile's Q load) is refused,
    naming both knobs."""
    for other in ("pingpong", "smem_epilogue"):
        with pytest.raises(ValueError, match=f"persistent.*{other}"):
            _sm90("bfloat16", 128, True, overlap=True, persistent=True, **{other: True})


@pytest.mark.cpu
@needs_cutlass
def test_sm90_persistent_tile_walk_visits_every_tile_once() -> None:
    """The persistent tile walk, replayed on Python ints with the kernel's own helpers: CTA
    ``c`` of a grid of ``G`` takes tiles ``c, c + G, ...`` below the tile count, decoded by
    :func:`persistent_tile`. For several shapes and grid sizes (1, a few, 132, exactly the
    tile count, more than it: CTAs with no tile) every (m_block, head, batch) is visited exactly
    once; in longest-first order (causal, windowed) each L2 section of (batch, head) pairs is
    walked in non-increasing causal work, its pairs' K and V within :data:`LPT_L2_BYTES`; in the
    natural order consecutive tiles walk m_block first, as the one-tile grid does."""
    from attention_crossval.kernel.own.common.mask import kv_block_range
    from attention_crossval.kernel.own.sm90.schedule import (
        LPT_L2_BYTES,
        lpt_section,
        persistent_tile,
    )

    for num_m, H, B, Sk in ((8, 16, 16, 1024), (32, 16, 4, 4096), (3, 5, 7, 300), (1, 1, 1, 5)):
        num_hb, tiles = H * B, num_m * H * B
        for lpt in (False, True):
            section = lpt_section(Sk, 128, 2) if lpt else num_hb
            assert not lpt or section == 1 or section * Sk * 2 * 128 * 2 <= LPT_L2_BYTES
            order = [persistent_tile(t, num_m, H, num_hb, section, lpt) for t in range(tiles)]
            every = {(m, h, b) for m in range(num_m) for h in range(H) for b in range(B)}
            assert len(set(order)) == tiles and set(order) == every
            for grid in (1, 3, 132, tiles, tiles + 5):
                walks = [range(c, tiles, grid) for c in range(grid)]
                visited = [order[t] for walk in walks for t in walk]
                assert sorted(visited) == sorted(every), (num_m, H, B, lpt, grid)
            S = 128 * num_m
            work = [
                (lambda r: r[1] - r[0])(kv_block_range(m, S, S, 128, 128, True)) for m, *_ in order
            ]
            if lpt:
                per_section = section * num_m
                for start in range(0, tiles, per_section):
                    part = work[start : start + per_section]
                    assert part == sorted(part, reverse=True), (num_m, H, B, start)
                assert order[0][0] == num_m - 1
            else:
                assert [m for m, *_ in order[:num_m]] == list(range(num_m))


def _near_multiples(unit: int, low: int) -> st.SearchStrategy[int]:
    """Lengths and window sides where the block arithmetic turns: within 2 of a multiple of
    ``unit`` (up to 5 of them), or anywhere up to 5 units."""
    edges = st.builds(lambda t, d: max(low, unit * t + d), st.integers(0, 5), st.integers(-2, 2))
    return st.one_of(edges, st.integers(low, 5 * unit))


@pytest.mark.cpu
@needs_cutlass
@settings(max_examples=400)  # cheap (no compile), and the only check before a GPU run
@given(
    tiles=st.sampled_from([(128, 128), (8, 8), (16, 8), (8, 16)]),
    causal=st.booleans(),
    data=st.data(),
)
def test_kernel_block_walk_sees_exactly_the_visible_keys(
    tiles: tuple[int, int], causal: bool, data: st.DataObject
) -> None:
    """The SM90 kernel's walk over the KV blocks, replayed on Python ints with the helpers it
    calls (kernel/own/common/mask.py) and the adapter's window clamp, for every query tile:

    * it visits exactly the KV blocks holding a key some valid row of the tile sees (none for a
      tile past ``q_length``: varlen padding, nor past ``k_length``), so skipping the others at
      both ends of the loop loses nothing;
    * blocks it does not mask are seen whole by every valid row of the tile, and with the mask
      on the others, the keys each valid row weights are exactly those reference/masks.py makes
      visible;
    * in a visited block, the rows past ``k_length`` inside the tensor (NaN padding under the
      harness) are exactly the V rows it zeroes.

    The kernel's 128 x 128 tiles, and small ones with the same arithmetic, where a few hundred
    examples reach every alignment of lengths and window sides to the tile edges.
    """
    from attention_crossval.kernel.own.common.mask import (
        block_needs_mask,
        key_range,
        kv_block_range,
        padded_key_rows,
        split_by_mask,
    )

    tile_m, tile_n = tiles
    unit = max(tiles)
    Sq, Sk = (data.draw(_near_multiples(unit, 1), label=name) for name in ("Sq", "Sk"))
    q_lengths = data.draw(st.none() | st.tuples(st.integers(0, Sq)), label="q_lengths")
    k_lengths = data.draw(st.none() | st.tuples(st.integers(0, Sk)), label="k_lengths")
    left, right = (
        data.draw(st.one_of(st.none(), _near_multiples(unit, 0), st.just(2**31 - 1)), label=side)
        for side in ("window_left", "window_right")
    )
    mask = Mask(causal, left, right, q_lengths=q_lengths, k_lengths=k_lengths)
    q, kv = (np.zeros((1, n, 1, 1), np.float16) for n in (Sq, Sk))
    case = AttentionCase(q, kv, kv, mask=mask)
    q_len, k_len = case.q_length(0), case.k_length(0)
    window = window_bounds(mask, Sq, Sk) or (None, None)
    seen = visible(case, 0, 0)  # [Sq, Sk]
    weighted = np.zeros_like(seen)
    for m_block in range((Sq + tile_m - 1) // tile_m):
        n_min, n_max, unmasked_min, unmasked_max = kv_block_range(
            m_block, q_len, k_len, tile_m, tile_n, causal, *window
        )
        rows = np.arange(m_block * tile_m, min((m_block + 1) * tile_m, q_len))
        keys_seen = np.flatnonzero(seen[rows].any(axis=0))
        assert list(range(n_min, n_max)) == sorted(set(keys_seen // tile_n)), m_block
        # The overlap kernel's walk: the first block, then three loops (masked, unmasked,
        # masked) over the rest, together the same blocks in the same (descending) order, and
        # no block that needs the mask in the unmasked loop.
        windowed = window[0] is not None
        hi = max(n_max - 1, n_min)
        mid_lo, top_lo = split_by_mask(n_min, hi, unmasked_min, unmasked_max, windowed)
        first = [n_max - 1] if n_max > n_min else []
        walk = first + [*range(hi - 1, top_lo - 1, -1), *range(top_lo - 1, n_min - 1, -1)]
        assert walk == list(range(n_max - 1, n_min - 1, -1)), m_block
        assert n_min <= mid_lo <= top_lo <= hi and (windowed or mid_lo == n_min)
        unmasked = range(mid_lo, top_lo)
        assert not any(block_needs_mask(n, unmasked_min, unmasked_max, windowed) for n in unmasked)
        ranges = [key_range(r, q_len, k_len, causal, *window) for r in rows]
        for n_block in range(n_min, n_max):
            cols = np.arange(n_block * tile_n, min((n_block + 1) * tile_n, Sk))
            if block_needs_mask(n_block, unmasked_min, unmasked_max, window[0] is not None):
                for row, (start, limit) in zip(rows, ranges, strict=True):
                    weighted[row, cols] = (cols >= start) & (cols < limit)
            else:
                weighted[np.ix_(rows, cols)] = True
            zeroed = range(*padded_key_rows(n_block, k_len, Sk, tile_n))
            assert list(zeroed) == [c - n_block * tile_n for c in cols if c >= k_len]
    np.testing.assert_array_equal(weighted[:q_len], seen[:q_len])


@pytest.mark.cpu
def test_own_sm90_declarations() -> None:
    """``own-sm90`` and ``own-sm90-full`` declare the same surface, GQA, varlen (padded rows
    unwritten) and windows included; both are among the default kernels since their suites
    passed on the H200 (none in ``UNPROVEN``)."""
    from attention_crossval.kernel.adapters import _cute
    from attention_crossval.kernel.adapters.own_sm90 import FULL_MAX_SEQLEN

    spec, full = resolve("own-sm90").spec, resolve("own-sm90-full").spec
    base = _cute.own_kernel_spec("own-sm90", tile_m=64, tile_n=128)  # 64: every tile's unit
    assert spec.gqa and spec.mask_kinds == {"causal", "window", "varlen"}
    assert (spec.padded_rows, spec.max_seqlen) == ("unwritten", FULL_MAX_SEQLEN)
    surface = ("gqa", "mask_kinds", "padded_rows", "max_seqlen")
    assert dataclasses.replace(spec, **{name: getattr(base, name) for name in surface}) == base
    assert full == dataclasses.replace(spec, name="own-sm90-full")
    assert BUILTIN["own-sm90-full"][1] == BUILTIN["own-sm90"][1]
    assert "own-sm90" not in UNPROVEN and "own-sm90-full" not in UNPROVEN


@pytest.mark.cpu
def test_own_kernels_are_available_only_with_cutlass_and_tvm_ffi() -> None:
    """The own kernels compile with CuTe DSL and launch through TVM-FFI: the registry offers
    them only where both import (with one missing they would fail every case, not skip)."""
    from attention_crossval.kernel.harness import registry

    for name in ("own-sm90", "own-sm90-full", "own-sm100"):
        assert registry.BUILTIN[name][1] == ("cutlass", "tvm_ffi"), name
    assert registry._importable(("numpy", "pytest")) and registry._importable("numpy")
    assert not registry._importable(("numpy", "attention_crossval_no_such_module"))
    has_both = importlib.util.find_spec("tvm_ffi") is not None and HAS_CUTLASS
    assert ("own-sm90" in registry.available()) == has_both


@pytest.mark.cpu
def test_own_sm90_runs_plain_cases_dense_and_the_rest_on_the_varlen_path(monkeypatch) -> None:
    """``own-sm90`` sends a case with GQA, lengths or a window to the varlen path (the dense
    path would ignore them: wrong rows, not an error) and a plain one to the dense path;
    ``own-sm90-full`` sends everything to the varlen path."""
    from attention_crossval.kernel.adapters import own_sm90

    calls = []
    monkeypatch.setattr(own_sm90, "launch", lambda *a, **k: calls.append("dense"))
    monkeypatch.setattr(own_sm90, "_launch_varlen_path", lambda *a: calls.append("varlen"))
    cases = {
        "plain": ramp_case(40, 40),
        "causal": ramp_case(40, 60, causal=True),
        "gqa": ramp_case(40, 40, H=4, Hkv=2),
        "window": ramp_case(40, 40, window_left=8),
        "varlen": ramp_case(40, 40, q_lengths=(40, 3), k_lengths=(40, 5)),
    }
    expected = {"plain": "dense", "causal": "dense"}
    for adapter in (own_sm90.OwnSm90Adapter(), own_sm90.OwnSm90FullAdapter()):
        for name, case in cases.items():
            calls.clear()
            adapter.launch(case, None, None, None, None, None)
            dense = isinstance(adapter, own_sm90.OwnSm90Adapter) and name in expected
            assert calls == ["dense" if dense else "varlen"], (adapter.spec.name, name)


@pytest.mark.cpu
def test_own_sm90_overlap_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variant switch: unset, empty or ``default``, ``ATTENTION_CROSSVAL_SM90_OVERLAP``
    makes the registered adapters run ``DEFAULT_KNOBS`` (overlap, pingpong, longest_first,
    smem_epilogue, m192: the fastest variant measured on the H200); ``baseline`` or ``0`` the
    kernel without knobs, ``1`` overlap alone, ``pingpong`` overlap + ping-pong, a
    comma-separated list of knob names exactly those knobs (``pingpong`` bringing
    ``overlap``); anything else fails loudly, naming the variable and the allowed values (a
    typo must not pass off the default kernel's results as a variant's)."""
    from attention_crossval.kernel.adapters.own_sm90 import KNOBS, OVERLAP_ENV, knobs_from_env

    default = dict.fromkeys(("overlap", "pingpong", "longest_first", "smem_epilogue", "m192"), True)
    assert dict.fromkeys(DEFAULT_KNOBS, True) == default
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert knobs_from_env() == default
    knobs_from_env()["pingpong"] = True  # a copy: the next call is still the default
    assert knobs_from_env() == default
    pingpong = {"overlap": True, "pingpong": True}
    lf = {"overlap": True, "longest_first": True}
    for value, expected in (
        ("", default), ("default", default), ("0", {}), ("baseline", {}),
        ("1", {"overlap": True}), ("pingpong", pingpong),
        ("overlap,longest_first", lf), ("longest_first, overlap", lf),
        ("overlap,pingpong,longest_first,smem_epilogue,m192", default),
        ("pingpong,longest_first", {**pingpong, "longest_first": True}),
        (",".join(KNOBS), dict.fromkeys(KNOBS, True)),
        ("overlap,persistent", {"overlap": True, "persistent": True}),
    ):  # fmt: skip
        monkeypatch.setenv(OVERLAP_ENV, value)
        assert knobs_from_env() == expected, value
    for bad in ("yes", "overlap,typo", "overlap,,longest_first", "overlap,1", "baseline,overlap"):
        monkeypatch.setenv(OVERLAP_ENV, bad)
        with pytest.raises(ValueError, match=OVERLAP_ENV) as error:
            knobs_from_env()
        assert "longest_first" in str(error.value) and "baseline" in str(error.value)


@pytest.mark.cpu
@needs_cutlass
@needs_tvm_ffi
@pytest.mark.usefixtures("dsl_arch_sm90a")
@pytest.mark.parametrize("path", ["dense, default knobs", "varlen + window, persistent"])
def test_own_sm90_launch_calls_tvm_ffi_with_the_tensors_as_given(
    launch_compiles: list[tuple],  # noqa: F811 - the fixture
    path: str,
) -> None:
    """The launch path itself, on the CPU: ``launch`` / ``launch_full`` compile their variant
    for sm_90a with TVM-FFI once (the second call reuses it) and hand the arrays to the
    compiled function as they are, every parameter filled (TVM-FFI counts them: a short call
    is a TypeError), and the function checks them in C++: host arrays are refused with a
    ValueError naming argument #0, where the kernel needs CUDA tensors, so the call got past
    the Python part to the compiled launcher. The dense path's default knobs include
    ``smem_epilogue``, whose alignment check reads torch's tensor methods: torch CPU tensors
    there (skipped without torch); numpy float16 arrays through DLPack on the varlen path."""
    from attention_crossval.kernel.adapters import _cute, own_sm90

    compiles = launch_compiles
    if path.startswith("dense"):
        torch = pytest.importorskip("torch")
        q, k, v, out = (torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16) for _ in range(4))
        lse = torch.zeros(2, 4, 256)
        call = lambda: own_sm90.launch(  # noqa: E731
            q, k, v, out, lse, 0.125, causal=True, **dict.fromkeys(DEFAULT_KNOBS, True)
        )
    else:
        q, k, v, out = (np.zeros((2, 256, 4, 64), np.float16) for _ in range(4))
        lse = np.zeros((2, 4, 256), np.float32)
        lengths = np.full(2, 256, np.int32)
        call = lambda: own_sm90.launch_full(  # noqa: E731
            q, k, v, out, lse, 0.125, False, lengths, lengths, (16, 0),
            overlap=True, persistent=True, num_sms=132,
        )  # fmt: skip
    for _ in range(2):
        with pytest.raises(ValueError, match=r"argument #0(.|\n)*expected device_type=cuda"):
            call()
    assert len(compiles) == 1, compiles
    function, padding = _cute._COMPILED[compiles[0]]
    # q, k, v, o, lse, scale_log2, five optional and the FP8 kernel's three descales (None
    # here): not the stream
    assert len(padding) == 14
    with pytest.raises(TypeError, match="14 parameters"):
        function(q, k, v, out, lse, 0.125)


@pytest.mark.cpu
@needs_cutlass
@needs_tvm_ffi
@pytest.mark.usefixtures("dsl_arch_sm90a")
def test_own_sm90_launch_build_runs_the_ptx_the_cpu_tests_inspect(tmp_path: Path) -> None:
    """The launch's TVM-FFI build (``compile_on_fake_tensors(..., tvm_ffi=True)``, what
    ``_cute.compiled`` calls) differs from the compile-only build the other tests inspect in
    its host entry only: the device code, the PTX, is the same text (the adapters' variant,
    causal, D = 128)."""
    from attention_crossval.kernel.own.common.host import compile_on_fake_tensors

    kernel = _sm90("bfloat16", 128, True, **dict.fromkeys(DEFAULT_KNOBS, True))
    tested_dir, launch_dir = tmp_path / "tested", tmp_path / "launch"
    tested_dir.mkdir(), launch_dir.mkdir()
    tested = _ptx(kernel.compile(options=f"--keep-ptx --dump-dir={tested_dir}"))
    options = f"--keep-ptx --dump-dir={launch_dir}"
    launched = _ptx(compile_on_fake_tensors(kernel, kernel.dtype, None, options, tvm_ffi=True))
    assert "wgmma.mma_async" in tested and launched == tested


@pytest.mark.cpu
def test_own_sm90_launch_refuses_unknown_knobs() -> None:
    """Both launches take the knobs by name and refuse any other before touching a tensor (a
    misspelt knob must not run the baseline kernel under a variant's name)."""
    from attention_crossval.kernel.adapters.own_sm90 import launch, launch_full

    with pytest.raises(TypeError, match="overlapp.*longest_first"):
        launch(None, None, None, None, None, 1.0, causal=True, overlapp=True)
    with pytest.raises(TypeError, match="smem.*persistent"):
        launch_full(None, None, None, None, None, 1.0, True, None, None, None, smem=True)


class _Out:
    """The three ``torch.Tensor`` methods the launch's alignment check reads."""

    def __init__(self, ptr: int, stride: tuple[int, ...]) -> None:
        self.ptr, self.strides = ptr, stride

    def element_size(self) -> int:
        return 2

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, ...]:
        return self.strides


def _recorded_launch(monkeypatch: pytest.MonkeyPatch, out: object, **knobs: bool) -> dict:
    """``own_sm90.launch`` on stand-in tensors with ``_cute.launch`` recording its keywords
    instead of compiling: what the adapter's Python part hands the shared launcher."""
    from attention_crossval.kernel.adapters import _cute
    from attention_crossval.kernel.adapters.own_sm90 import launch

    recorded: dict = {}
    monkeypatch.setattr(_cute, "launch", lambda *args, **kwargs: recorded.update(kwargs))
    launch(None, None, None, out, None, 1.0, causal=False, **knobs)
    return recorded


@pytest.mark.cpu
def test_own_sm90_persistent_grid_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapters' persistent grid cap: ``num_sms`` when given (no device query), None
    without ``persistent`` (the kernel then takes no cap), an error below 1; the variant key
    names the knobs turned on, in :data:`KNOBS` order, whatever order they came in."""
    out = _Out(4096, (2048 * 128, 1024, 128, 1))
    persistent = _recorded_launch(monkeypatch, out, persistent=True, overlap=True, num_sms=132)
    assert (persistent["max_ctas"], persistent["variant"]) == (132, ("overlap", "persistent"))
    plain = _recorded_launch(monkeypatch, out, overlap=True, persistent=False, num_sms=132)
    assert (plain["max_ctas"], plain["variant"]) == (None, ("overlap",))
    with pytest.raises(ValueError, match="num_sms"):
        _recorded_launch(monkeypatch, out, persistent=True, num_sms=0)


@pytest.mark.cpu
def test_own_sm90_smem_epilogue_checks_out_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch refuses ``smem_epilogue`` on an ``out`` the kernel's 16-byte O stores would
    misalign (an offset base or a stride not a multiple of 16 bytes), before any compile; the
    other variants never look."""
    _recorded_launch(monkeypatch, _Out(4096, (2048 * 128, 1024, 128, 1)), smem_epilogue=True)
    _recorded_launch(monkeypatch, _Out(4098, (8, 8, 1, 1)), overlap=True)
    for bad in (
        _Out(4098, (2048 * 128, 1024, 128, 1)),
        _Out(4096, (2048 * 128, 1028, 128, 1)),
        _Out(4096, (2048 * 128 + 4, 1024, 128, 1)),
        _Out(4096, (2048 * 128, 1024, 132, 1)),
    ):
        with pytest.raises(ValueError, match="smem_epilogue"):
            _recorded_launch(monkeypatch, bad, smem_epilogue=True)


# own-sm90-full: one feature per case, then all together.
TARGETED_FULL = {
    "GQA 4:2 over 3 blocks": lambda: ramp_case(200, 300, H=4, Hkv=2),
    "MQA causal": lambda: ramp_case(130, 389, H=4, Hkv=1, causal=True, dtype="float16"),
    "varlen, NaN padding in the last partial block": lambda: ramp_case(
        256, 384, q_lengths=(200, 37), k_lengths=(300, 129)
    ),
    "varlen empty sequences": lambda: ramp_case(
        130, 260, D=64, causal=True, q_lengths=(0, 130), k_lengths=(200, 0)
    ),
    "window edges inside tiles": lambda: ramp_case(300, 500, window_left=100, window_right=30),
    "causal window, Sq < Sk": lambda: ramp_case(257, 600, causal=True, window_left=129),
    "window right only, fp16 D 64": lambda: ramp_case(
        200, 450, D=64, dtype="float16", window_right=0
    ),
    "GQA, varlen, causal window, fp16": lambda: ramp_case(
        300,
        520,
        H=4,
        Hkv=2,
        dtype="float16",
        causal=True,
        window_left=200,
        q_lengths=(300, 129),
        k_lengths=(520, 333),
    ),  # fmt: skip
}
TARGETED_PAIRS = [("own-sm90", name) for name in TARGETED] + [
    ("own-sm90-full", name) for name in TARGETED_FULL
]


@pytest.mark.gpu
@pytest.mark.parametrize(("kernel", "name"), TARGETED_PAIRS)
def test_own_sm90_targeted_cases(kernel: str, name: str) -> None:
    """Each case exercises one part of the kernel (rescale, residue mask, causal mask, empty
    rows, partial tiles; GQA, lengths, NaN padding, windows) under every harness check."""
    case = (TARGETED if kernel == "own-sm90" else TARGETED_FULL)[name]()
    verdict = run_case(resolve(kernel), case, isolated=worker(kernel))
    assert verdict.skipped is None, verdict.skipped
    verdict.raise_for()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["own-sm90", "own-sm90-full"])
def test_own_sm90_passes_every_check(kernel: str, request: pytest.FixtureRequest) -> None:
    """The generic kernel property (properties/test_kernels.py) with each SM90 adapter."""
    free_property(kernel, request.config, stream="own-kernels")
