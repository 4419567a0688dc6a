"""The project's own SM100 kernel (kernel/own/sm100/fwd.py): compile-only checks, since no Blackwell
GPU exists anywhere this project runs.

CPU (``cutlass`` from nvidia-cutlass-dsl, no GPU): every configuration the adapter declares
compiles for sm_100a; the PTX holds the instructions of the FlashAttention-4 hardware path
(tcgen05 MMA with kind::f16, TMEM alloc/dealloc, tcgen05.ld/st, tcgen05.commit, TMA, ex2.approx,
setmaxnreg honoured through ``.minnctapersm 1``) and ptxas reports no spills. At trace time the
TMEM views are checked on coordinates: each softmax / correction thread holds exactly one query
row of S, P and O in column order, and the 16-bit P the softmax stores is where the PV MMA reads
its A operand. This is all the evidence there is: nothing here shows the kernel's numbers, its
synchronisation or its speed are right.

GPU (``blackwell`` marker): the adapter ``own-sm100`` under the defensive harness, on the
targeted cases of the SM90 kernel and on Hypothesis cases. Skipped everywhere this project has
run (H200 and CPU machines): it would be the first run of the kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.properties.kernel_suite import free_property
from attention_crossval.properties.kernels_under_test import worker
from tests.kernel.own_kernels import (
    CONFIGS,
    TARGETED,
    assert_no_spills,
    needs_cutlass,
)

PTX_MUST_HAVE = (
    "tcgen05.mma.cta_group::1.kind::f16",
    "tcgen05.alloc.cta_group::1",
    "tcgen05.dealloc.cta_group::1",
    "tcgen05.ld.sync.aligned.32x32b",
    "tcgen05.st.sync.aligned.32x32b",
    "tcgen05.commit.cta_group::1",
    "tcgen05.wait::st",
    "cp.async.bulk.tensor",
    "ex2.approx.ftz.f32",
    "setmaxnreg",
    ".minnctapersm 1",
)


# A row of 128 scores per thread makes kernel/common's constexpr loops 128 long, for which the
# DSL warns ("may be very slow to compile") inside a bare ``except`` that turns the warning, an
# error under this project's pytest settings, into a bogus "requires Python integers" error.
@pytest.mark.filterwarnings("ignore:This static loop has")
@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("dtype", "head_dim", "causal"), CONFIGS)
def test_sm100_compiles_to_tcgen05_without_spills(
    dtype: str, head_dim: int, causal: bool, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every declared configuration compiles for sm_100a without a GPU, down to the tcgen05 /
    TMA instructions (a wrong arch or a fallback would lose them), with the MMA counts of one
    KV block; for bf16 causal (fp16 differs only in the MMA kind and the conversion, non-causal
    only lacks the mask, and a ptxas report costs ~2 s) ptxas (``remarks{ptx}``) reports 0 spill
    bytes."""
    from attention_crossval.kernel.own.sm100.fwd import TILE_N, FlashAttentionForwardSm100

    check_spills = dtype == "bfloat16" and causal
    options = f"--keep-ptx --dump-dir={tmp_path}" + (" remarks{ptx}" if check_spills else "")
    ptx = FlashAttentionForwardSm100(dtype, head_dim, causal).compile(options=options)
    ptx = ptx.artifacts.PTX
    missing = [spelling for spelling in PTX_MUST_HAVE if spelling not in ptx]
    assert not missing, f"PTX lacks {missing}"
    # k16 MMAs: QK^T over D, then PV over the TILE_N keys (one KV block, loop not unrolled).
    assert ptx.count("tcgen05.mma.cta_group::1") == head_dim // 16 + TILE_N // 16
    if check_spills:
        assert_no_spills("".join(capfd.readouterr()))


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm100_tmem_views_give_one_row_per_thread(head_dim: int) -> None:
    """The kernel's TMEM views, checked on coordinates at trace time:

    * the S load gives thread ``t`` row ``t`` of S, keys in order (the mask and the
      one-row-per-thread softmax of kernel/common assume it);
    * the P store sends 32-bit value ``j`` of thread ``t`` to lane ``t``, column ``j`` from the
      P offset, i.e. 16-bit P element ``k`` to half-column ``k``; and the PV MMA's A operand
      (P from TMEM) reads element (row ``m``, key ``k``) exactly there: lane ``m``, half-column
      ``k`` from the same offset (a mismatch multiplies P by the wrong V rows);
    * the O chunks give thread ``t`` row ``t`` of O, all ``head_dim`` columns once;
    * S, P and O fit the allocation, with P inside S and O beside it.
    """
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    from attention_crossval.kernel.adapters.own_sm100 import TILE_M as ADAPTER_TILE_M
    from attention_crossval.kernel.adapters.own_sm100 import TILE_N as ADAPTER_TILE_N
    from attention_crossval.kernel.own.sm100.fwd import (
        O_COL,
        P_COL,
        S_COL,
        TILE_M,
        TILE_N,
        TMEM_COLS,
        FlashAttentionForwardSm100,
        row_view,
    )

    assert (ADAPTER_TILE_M, ADAPTER_TILE_N) == (TILE_M, TILE_N)
    kernel = FlashAttentionForwardSm100("bfloat16", head_dim, causal=True)
    threads = [0, 1, 31, 32, 63, 64, 100, 127]
    rows = (0, 1, 33, 77, TILE_M - 1)
    seen: dict[str, object] = {}

    def listed(tensor: cute.Tensor) -> list:
        return [tensor[i] for i in range(cute.size(tensor))]

    @cute.jit
    def trace() -> None:
        dtype, k_major = cutlass.BFloat16, OperandMajorMode.K
        one_cta = tcgen05.CtaGroup.ONE
        qk = sm100_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, cutlass.Float32, one_cta, (TILE_M, TILE_N)
        )
        pv = sm100_utils.make_trivial_tiled_mma(
            dtype,
            dtype,
            k_major,
            OperandMajorMode.MN,
            cutlass.Float32,
            one_cta,
            (TILE_M, head_dim),
            tcgen05.OperandSource.TMEM,
        )
        tP_layout = sm100_utils.make_smem_layout_a(pv, (TILE_M, head_dim, TILE_N), dtype, 1)
        tmem = cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem)
        tStS, tOrP, tOtO = kernel.tmem_tensors(qk, pv, tP_layout, tmem)
        cA = pv.get_slice(0).partition_A(cute.make_identity_tensor((TILE_M, TILE_N)))
        k16 = cute.size(tOrP, mode=[0, 1])  # keys per MMA K block
        seen["p_operand"] = [
            (cA[(m, kk), 0, kb], cute.crd2idx(((m, kk), 0, kb), tOrP.layout))
            for m in rows
            for kb in range(cute.size(tOrP, mode=[2]))
            for kk in range(k16)
        ]
        seen["s_offsets"] = [
            (m, n, cute.crd2idx(((m, n), 0, 0), tStS.layout))
            for m in rows
            for n in (0, 1, TILE_N - 1)
        ]
        seen["o_offsets"] = [
            (m, n, cute.crd2idx(((m, n), 0, 0), tOtO.layout))
            for m in rows
            for n in (0, 1, head_dim - 1)
        ]
        for t in threads:
            _, _, tSc = kernel.s_load_partition(qk, tStS, t)
            _, _, tPc = kernel.p_store_partition(qk, tStS, t)
            _, _, _, _, tOc = kernel.o_partitions(pv, tOtO, t)
            seen[("s", t)] = listed(row_view(tSc))
            seen[("p", t)] = listed(tPc)
            seen[("o", t)] = [listed(tOc[None, 0, 0, c]) for c in range(cute.size(tOc, mode=[3]))]

    cute.compile(trace, options="--gpu-arch=sm_100a")
    lane = 1 << 16  # TMEM address: lane in the upper 16 bits, 32-bit column in the lower
    for t in threads:
        assert seen[("s", t)] == [(t, n) for n in range(TILE_N)], f"thread {t}: S row"
        assert seen[("p", t)] == [(t, j) for j in range(TILE_N // 2)], f"thread {t}: P row"
        o_coords = [coord for chunk in seen[("o", t)] for coord in chunk]
        assert o_coords == [(t, n) for n in range(head_dim)], f"thread {t}: O row"
    # 16-bit units inside P's view: lane stride 2 * 65536, one key per half-column.
    for (m, k), offset in seen["p_operand"]:
        assert offset == m * 2 * lane + k, f"P operand ({m}, {k}) at {offset}"
    assert sorted(coord for coord, _ in seen["p_operand"]) == [
        (m, k) for m in rows for k in range(TILE_N)
    ], "P operand: every key of each sampled row once"
    for name in ("s_offsets", "o_offsets"):
        for m, n, offset in seen[name]:
            assert offset == m * lane + n, f"{name}: ({m}, {n}) at {offset}"
    assert S_COL + TILE_N <= O_COL and O_COL + head_dim <= TMEM_COLS
    assert S_COL <= P_COL and P_COL + TILE_N // 2 <= S_COL + TILE_N


@pytest.mark.gpu
@pytest.mark.blackwell
@pytest.mark.parametrize("name", list(TARGETED))
def test_own_sm100_targeted_cases(name: str) -> None:
    """The SM90 kernel's targeted cases (rescale, residue, causal, empty rows, partial tiles)
    under every harness check. Skipped everywhere so far: no Blackwell GPU."""
    case = TARGETED[name]()
    verdict = run_case(resolve("own-sm100"), case, isolated=worker("own-sm100"))
    assert verdict.skipped is None, verdict.skipped
    verdict.raise_for()


@pytest.mark.gpu
@pytest.mark.blackwell
def test_own_sm100_passes_every_check(request: pytest.FixtureRequest) -> None:
    """The generic kernel property (properties/test_kernels.py) with kernel ``own-sm100``.
    Skipped everywhere so far: no Blackwell GPU."""
    free_property("own-sm100", request.config, stream="own-kernels")
