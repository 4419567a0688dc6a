"""The project's own CuTe DSL kernels: compile-only checks on the CPU, correctness on the GPU.

CPU (``cutlass`` from nvidia-cutlass-dsl, no GPU): the SM90 kernel compiles for sm_90a in every
configuration the adapter declares, and the PTX holds the instructions that prove the hardware
path (WGMMA, TMA, ex2.approx, setmaxnreg honoured through ``.minnctapersm 1``); ptxas reports no
spills. The KV block range that decides which blocks are visited and which are masked is checked
against the one visibility predicate (reference/masks.py).

GPU: the adapter ``own-sm90`` under the defensive harness, on Hypothesis cases inside its
declaration (the test of properties/test_kernels.py) and on targeted cases (multi-block rescale,
seqlen_k residue, bottom-right causal with empty rows).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attention_crossval.kernel.harness import run_case
from attention_crossval.kernel.registry import resolve
from attention_crossval.properties.kernels_under_test import worker
from attention_crossval.properties.test_kernels import (  # noqa: F401 - autouse fixture, reused
    _close_workers,
)
from attention_crossval.properties.test_kernels import (
    test_kernel_passes_every_check as _kernel_property,
)
from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase, Mask
from attention_crossval.reference.masks import visible

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(
    not HAS_CUTLASS, reason="cutlass not importable (pip install nvidia-cutlass-dsl==4.8.1)"
)
CONFIGS = [
    (dtype, head_dim, causal)
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
    for causal in (False, True)
]
PTX_MUST_HAVE = (
    "wgmma.mma_async.sync.aligned",
    "ex2.approx.ftz.f32",
    "cp.async.bulk.tensor",
    "setmaxnreg",
    ".minnctapersm 1",
)


def _sm90(dtype: str, head_dim: int, causal: bool):
    from attention_crossval.kernel.adapters.own_sm90 import NUM_CONSUMER_WG, TILE_N
    from attention_crossval.kernel.sm90.fwd import FlashAttentionForwardSm90

    return FlashAttentionForwardSm90(
        dtype, head_dim, causal, num_consumer_wg=NUM_CONSUMER_WG, tile_n=TILE_N
    )


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("dtype", "head_dim", "causal"), CONFIGS)
def test_sm90_compiles_to_wgmma_tma_ex2(
    dtype: str, head_dim: int, causal: bool, tmp_path: Path
) -> None:
    """Every declared configuration compiles for sm_90a without a GPU, down to the hardware
    instructions (a silently wrong arch or a scalar fallback would lose them)."""
    kernel = _sm90(dtype, head_dim, causal)
    ptx = kernel.compile(options=f"--keep-ptx --dump-dir={tmp_path}").artifacts.PTX
    missing = [spelling for spelling in PTX_MUST_HAVE if spelling not in ptx]
    assert not missing, f"PTX lacks {missing}"
    mma = "bf16.bf16" if dtype == "bfloat16" else "f16.f16"
    assert f"wgmma.mma_async.sync.aligned.m64n128k16.f32.{mma}" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.{mma}" in ptx


@pytest.mark.cpu
@needs_cutlass
def test_sm90_has_no_register_spills(capfd: pytest.CaptureFixture[str]) -> None:
    """ptxas (run by the DSL with ``remarks{ptx}``) reports 0 spill bytes for the largest
    configuration (D = 128, causal: most live registers)."""
    _sm90("bfloat16", 128, True).compile(options="remarks{ptx}")
    assert_no_spills("".join(capfd.readouterr()))


def assert_no_spills(compile_output: str) -> None:
    """ptxas' ``remarks{ptx}`` report in ``compile_output`` exists and says 0 spill bytes."""
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", compile_output)]
    assert spills, f"no ptxas spill report in the compile output:\n{compile_output[-2000:]}"
    assert max(spills) == 0, f"ptxas spills: {spills}"


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_register_views_match_the_mma_layouts(head_dim: int) -> None:
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

    from attention_crossval.kernel.adapters.own_sm90 import NUM_CONSUMER_WG, TILE_N
    from attention_crossval.kernel.sm90.fwd import ROWS_PER_WG, acc_as_operand_a, acc_rows_cols

    tile_m = ROWS_PER_WG * NUM_CONSUMER_WG
    threads = [0, 1, 2, 3, 4, 5, 6, 7, 31, 32, 33, 34, 35, 97, 127, 128, 129, 130, 131, 254]
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
        atoms = (NUM_CONSUMER_WG, 1, 1)
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


@pytest.mark.cpu
@needs_cutlass
@given(
    seqlen_q=st.integers(1, 700),
    seqlen_k=st.integers(1, 700),
    causal=st.booleans(),
    data=st.data(),
)
def test_kv_block_range_covers_exactly_the_visible_keys(
    seqlen_q: int, seqlen_k: int, causal: bool, data: st.DataObject
) -> None:
    """Blocks below ``n_block_max`` hold every key some valid row of the tile sees; blocks below
    ``n_block_unmasked`` are seen whole by every valid row (so skipping their mask is exact);
    with causal, no block at or past ``n_block_max`` holds a key the tile's rows see."""
    from attention_crossval.kernel.common.mask import kv_block_range

    tile_m, tile_n = 128, 128
    m_block = data.draw(st.integers(0, (seqlen_q - 1) // tile_m), label="m_block")
    n_block_max, n_block_unmasked = kv_block_range.__wrapped__(
        m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal
    )
    q, kv = (np.zeros((1, n, 1, 1), np.float16) for n in (seqlen_q, seqlen_k))
    case = AttentionCase(q, kv, kv, mask=Mask(causal=causal))
    rows = np.arange(m_block * tile_m, min((m_block + 1) * tile_m, seqlen_q))
    seen = visible(case, 0, 0, rows=rows)  # [rows, Sk]
    block_of_key = np.arange(seqlen_k) // tile_n
    assert (block_of_key[seen.any(axis=0)] < n_block_max).all()
    assert seen[:, block_of_key < n_block_unmasked].all()
    if causal and seen.any():
        assert n_block_max == block_of_key[seen.any(axis=0)].max() + 1


@pytest.mark.cpu
@needs_cutlass
@given(seqlen_q=st.integers(1, 300), seqlen_k=st.integers(1, 300), causal=st.booleans())
def test_key_limit_is_the_visibility_predicate(seqlen_q: int, seqlen_k: int, causal: bool) -> None:
    """``apply_mask``'s per-row predicate ``j < key_limit(i)`` equals reference/masks.py for
    every row, empty rows (limit <= 0) included."""
    from attention_crossval.kernel.common.mask import key_limit

    q, kv = (np.zeros((1, n, 1, 1), np.float16) for n in (seqlen_q, seqlen_k))
    case = AttentionCase(q, kv, kv, mask=Mask(causal=causal))
    limits = np.array(
        [key_limit.__wrapped__(i, seqlen_q, seqlen_k, causal) for i in range(seqlen_q)]
    )
    np.testing.assert_array_equal(
        np.arange(seqlen_k)[None, :] < limits[:, None], visible(case, 0, 0)
    )


def _case(
    Sq: int, Sk: int, *, D: int = 128, causal: bool = False, dtype: str = "bfloat16", H: int = 2
) -> AttentionCase:
    """Keys on a ramp (every KV block raises the running max, so O must be rescaled), random
    values, one batch per call; lengths chosen by the tests around the 128 tiles."""
    rng = np.random.default_rng(Sq * 1000 + Sk)
    q = 0.5 + 0.05 * rng.standard_normal((2, Sq, H, D))
    k = np.linspace(0.0, 2.0, Sk)[None, :, None, None] + 0.1 * rng.standard_normal((2, Sk, H, D))
    v = rng.standard_normal((2, Sk, H, D))
    arrays = (a.astype(INPUT_DTYPES[dtype]) for a in (q, k, v))
    return AttentionCase(*arrays, mask=Mask(causal=causal), label=f"own-sm90 {Sq}x{Sk}")


TARGETED = {
    "rescale over 4 blocks": lambda: _case(128, 512),
    "seqlen_k residue": lambda: _case(200, 300, D=64, dtype="float16"),
    "causal Sq < Sk": lambda: _case(130, 389, causal=True),
    "causal Sq > Sk (empty rows)": lambda: _case(300, 129, causal=True, D=64),
    "causal Sq == Sk, partial tile": lambda: _case(257, 257, causal=True, dtype="float16"),
    "single key": lambda: _case(5, 1, causal=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TARGETED))
def test_own_sm90_targeted_cases(name: str) -> None:
    """Each case exercises one part of the kernel (rescale, residue mask, causal mask, empty
    rows, partial tiles) under every harness check."""
    case = TARGETED[name]()
    verdict = run_case(resolve("own-sm90"), case, isolated=worker("own-sm90"))
    assert verdict.skipped is None, verdict.skipped
    verdict.raise_for()


@pytest.mark.gpu
def test_own_sm90_passes_every_check(request: pytest.FixtureRequest) -> None:
    """The generic kernel property (properties/test_kernels.py) with kernel ``own-sm90``."""
    _kernel_property(kernel="own-sm90", request=request)
