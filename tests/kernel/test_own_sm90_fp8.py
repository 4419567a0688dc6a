"""The own SM90 kernel's FP8 forward (``own-sm90-fp8``): compile-only checks on the CPU.

* The key order: the S accumulator's value the kernel stores in each A slot of the FP8 PV
  WGMMA (``fp8_p_layouts``) is, value for value, the (row, key) the WGMMA reads there once V's
  keys are stored in ``fp8_key_order``: on CuTe DSL's layouts at trace time, and on the
  compiled PTX against the PTX ISA's fragment layouts (issue 24's fault: P's bytes in S's order
  mixed rows g and g + 8 in every A register). The launcher's reordered V holds that order.
* Every FP8 configuration the adapter runs (e4m3 / e5m2, D = 64 / 128, causal or not, with the
  fixed and FA4's constants) compiles for sm_90a: FP8 WGMMAs of both GEMMs, the satfinite
  conversion of P, no byte permutes or shuffles for P, no local memory, no spills; the lazy
  rescale's compare only where the threshold is not 0.
* The kernel refuses what its FP8 path does not do, with a ValueError naming it.

Skipped with a reason where CuTe DSL (or, for the reordered V, torch) is not installed. The GPU
run is scripts/gpu/own_sm90_fp8_check.py and ``pytest -m gpu --kernel own-sm90-fp8``.
"""

from __future__ import annotations

import re
import struct
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from attention_crossval.kernel.own.sm90.fp8_layout import fp8_key_order, padded_keys
from tests.kernel.own_kernels import (
    dsl_arch_sm90a,  # noqa: F401 - a fixture, used by name
    launch_compiles,  # noqa: F401 - a fixture, used by name
    needs_cutlass,
    needs_tvm_ffi,
)

FP8 = ("float8_e4m3fn", "float8_e5m2")
PTX_NAME = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
# (max_offset_log2, rescale_threshold_log2): own-sm90-fp8's per format, and FA4's
CONSTANTS = {"fixed-e4m3": (8.0, 0.0), "fixed-e5m2": (8.0, 4.0), "fa4": (8.0, 4.0)}


@pytest.mark.cpu
def test_fp8_key_order_permutes_each_32_key_block() -> None:
    """Each 32-key block of the order is a permutation of its own keys (V's reorder moves no
    key across a k32 WGMMA block), and bad sizes are refused by name."""
    order = fp8_key_order(128)
    for start in range(0, 128, 32):
        assert sorted(order[start : start + 32]) == list(range(start, start + 32))
    assert [padded_keys(n) for n in (1, 31, 32, 33, 200)] == [32, 32, 32, 64, 224]
    with pytest.raises(ValueError, match="num_keys=33"):
        fp8_key_order(33)


def _p_layout_mismatches(order: np.ndarray, storage: str, num_wg: int) -> dict[int, int]:
    """Trace the FP8 MMAs and count, per sampled thread, the S values that land in an A slot
    ``(row, j)`` of the PV WGMMA holding anything but S's ``(row, order[j])``. ``storage``:
    "kernel" stores P's bytes as :func:`fp8_p_layouts` says (A's order), "s_order" keeps
    them in S's accumulator order (issue 24's bug: the WGMMA reads bytes in storage order)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from attention_crossval.kernel.adapters.own_sm90 import TILE_N
    from attention_crossval.kernel.own.sm90.fwd import ROWS_PER_WG, fp8_p_layouts

    tile_m = ROWS_PER_WG * num_wg
    threads = [0, 1, 2, 3, 4, 5, 7, 31, 32, 35, 97, 127, 128, 131, 254, 255]
    threads += [256, 290, 383] if num_wg == 3 else []
    seen: dict[int, tuple[list, list]] = {}

    @cute.jit
    def trace() -> None:
        dtype, k_major = cutlass.Float8E4M3FN, OperandMajorMode.K
        atoms = (num_wg, 1, 1)
        qk = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, cutlass.Float32, atoms, (ROWS_PER_WG, TILE_N)
        )
        pv = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, cutlass.Float32, atoms, (ROWS_PER_WG, 128),
            warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        identity = cute.make_identity_tensor((tile_m, TILE_N))
        for t in threads:
            cS = qk.get_slice(t).partition_C(identity)
            cA = pv.get_slice(t).partition_A(identity)
            as_s = fp8_p_layouts(cS.layout.shape)[0]
            slots = [as_s(i) if storage == "kernel" else i for i in range(cute.size(cS))]
            seen[t] = (
                [cS[i] for i in range(cute.size(cS))],
                [cA[slot] for slot in slots],
            )

    cute.compile(trace, options="--gpu-arch=sm_90a")
    mismatches = {}
    for t, (p_coords, a_coords) in seen.items():
        assert len(p_coords) == len(a_coords) == 2 * TILE_N // 4  # 2 rows, a quad's share
        mismatches[t] = sum(
            (row, key) != (a_row, int(order[j]))
            for (row, key), (a_row, j) in zip(p_coords, a_coords, strict=True)
        )
    return mismatches


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize("num_wg", [2, 3])
def test_fp8_p_layouts_feed_the_pv_wgmma_the_relabelled_keys(num_wg: int) -> None:
    """P never leaves its lanes: the S value the kernel stores in A slot ``(row, j)`` of the
    FP8 PV WGMMA (:func:`fp8_p_layouts`) is S's ``(row, fp8_key_order[j])``, the V row the
    launcher stores at ``j``, in every sampled thread of two or three consumer warpgroups
    (CuTe DSL's own fragment layouts). The check catches a wrong layout: P left in S's order,
    or V in plain key order, mismatch on every thread."""
    order = fp8_key_order(128)
    right = _p_layout_mismatches(order, "kernel", num_wg)
    assert right and set(right.values()) == {0}, right
    for wrong in (_p_layout_mismatches(np.arange(128), "kernel", num_wg),
                  _p_layout_mismatches(order, "s_order", num_wg)):  # fmt: skip
        assert all(bad > 0 for bad in wrong.values()), wrong


def _ptx_accumulator_coord(lane: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray]:
    """PTX ISA, wgmma ``.f32`` accumulator D: (row in the warp's 16, column) of element
    ``index`` of each lane."""
    return lane // 4 + 8 * ((index // 2) % 2), 2 * (lane % 4) + index % 2 + 8 * (index // 4)


def _ptx_fp8_a_coord(lane: np.ndarray, reg: int, byte: int) -> tuple[np.ndarray, np.ndarray]:
    """PTX ISA, wgmma ``m64nNk32`` A from registers (``.e4m3`` / ``.e5m2``): (row in the
    warp's 16, k) of byte ``byte`` (0 the lowest) of A register ``reg`` of each lane."""
    return lane // 4 + 8 * (reg % 2), 4 * (lane % 4) + byte + 16 * (reg // 2)


def _ptx_p_to_a_mismatches(ptx: str, fmt: str, tile_n: int) -> int:
    """Follow P through the compiled PTX, as the hardware reads it, and count the (lane, A
    slot) pairs of one block's PV WGMMAs that hold anything but the S value whose key V holds
    at that slot (:func:`fp8_key_order`). The path, per A register of the first PV WGMMA group:
    ``mov.b32 %a, {lo, hi}`` (lo the low 16 bits), each half from ``cvt.rn.satfinite.{fmt}x2
    .f32 %h, x_hi, x_lo`` (its first operand in the HIGH byte), each ``x`` an fp32 register of
    S's accumulator as the first ``Q K^T`` WGMMA lists it (P is computed in place). Anything
    else on the path fails the test (it reads the plain baseline kernel, whose P is one
    conversion per block)."""
    regs = partial(re.findall, r"%r\w*\d+")
    wgmma = rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.{fmt}\.{fmt} \{{[^}}]*\}}, "
    qk = re.search(f"({wgmma})" + r"%rd\d+, %rd\d+", ptx)
    assert qk, "no Q K^T WGMMA in the PTX"
    accumulator = {name: i for i, name in enumerate(regs(qk.group(1).split("{")[1]))}
    pv = [regs(a) for a in re.findall(wgmma + r"\{([^}]*)\}, %rd\d+", ptx)]
    blocks = tile_n // 32
    assert len(pv) == blocks and all(len(a) == 4 for a in pv), pv
    movs = re.findall(r"mov\.b32 (%r\d+), \{(%rs\d+), (%rs\d+)\};", ptx)
    cvts = re.findall(rf"cvt\.rn\.satfinite\.{fmt}x2\.f32 (%rs\d+), (%r\d+), (%r\d+);", ptx)
    halves = {dst: (lo, hi) for dst, lo, hi in movs}
    pairs = {dst: (lo, hi) for dst, hi, lo in cvts}
    assert len(halves) == len(movs) and len(pairs) == len(cvts), "a register defined twice"
    order = fp8_key_order(tile_n)
    lane = np.arange(32)
    bad = 0
    for kb, a_regs in enumerate(pv):
        for reg, a in enumerate(a_regs):
            p_bytes = [x for half in halves[a] for x in pairs[half]]  # byte 0 first
            for byte, x in enumerate(p_bytes):
                s_row, s_key = _ptx_accumulator_coord(lane, accumulator[x])
                a_row, a_k = _ptx_fp8_a_coord(lane, reg, byte)
                bad += int(np.sum((s_row != a_row) | (s_key != order[32 * kb + a_k])))
    return bad


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("dtype", "head_dim"), [("float8_e4m3fn", 128), ("float8_e5m2", 64)])
@pytest.mark.parametrize("storage", ["kernel", "s_order"])
def test_compiled_p_reaches_the_pv_wgmma_as_ptx_reads_it(
    dtype: str, head_dim: int, storage: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 24's fault, on the PTX: each byte of each A register of the PV WGMMAs holds the
    P of the (row, key) that the PTX ISA's fragment layouts put there and that V's reordered
    row multiplies (:func:`_ptx_p_to_a_mismatches`: all 32 lanes x 4 registers x 4 bytes per
    k32 block). The ``s_order`` mutant (P's bytes left in S's accumulator order, the A operand a
    view of them: the kernel before the fix) mismatches on half the slots, rows g and g + 8
    mixed."""
    from attention_crossval.kernel.own.sm90 import fwd

    if storage == "s_order":

        def p_fragments(self, acc_S):  # noqa: ANN001, ANN202
            rP = fwd.cute.make_rmem_tensor_like(acc_S, self.dtype)
            as_a = fwd.fp8_p_layouts(acc_S.layout.shape)[1]
            return rP, fwd.cute.make_tensor(rP.iterator, as_a)

        monkeypatch.setattr(fwd.FlashAttentionForwardSm90, "p_fragments", p_fragments)
        monkeypatch.setattr(
            fwd.FlashAttentionForwardSm90, "store_p",
            lambda self, rP, tOrP, acc_S: rP.store(acc_S.load().to(self.dtype)),
        )  # fmt: skip
    kernel = _fp8_kernel(dtype, head_dim, False, f"fixed-{PTX_NAME[dtype]}")
    ptx = _ptx_text(kernel.compile(options=f"--keep-ptx --dump-dir={tmp_path}"))
    bad = _ptx_p_to_a_mismatches(ptx, PTX_NAME[dtype], kernel.tile_n)
    slots = 32 * 16 * kernel.tile_n // 32
    assert bad == (0 if storage == "kernel" else slots // 2), (bad, slots)


@pytest.mark.cpu
def test_launcher_reorders_v_keys_contiguous_in_the_kernel_order() -> None:
    """``keys_contiguous_v``: a ``[B, Sk', Hkv, D]`` view with unit stride along the keys,
    position ``j`` holding key ``fp8_key_order[j]`` for every batch, head and column, zeros
    past ``Sk``, read from a strided (guard-banded) FP8 view without touching its guards."""
    torch = pytest.importorskip("torch")
    from attention_crossval.kernel.adapters.own_sm90_fp8 import keys_contiguous_v

    B, Sk, H, D, guard = 2, 45, 3, 16, 5
    values = torch.arange(B * Sk * H * D, dtype=torch.float32).remainder(200) - 100
    buf = torch.full((B, Sk + 2 * guard, H, D), float("nan")).to(torch.float8_e4m3fn)
    v = buf[:, guard : guard + Sk]
    v.copy_(values.reshape(B, Sk, H, D).to(torch.float8_e4m3fn))
    out = keys_contiguous_v(v)
    keys = padded_keys(Sk)
    assert tuple(out.shape) == (B, keys, H, D) and out.stride(1) == 1
    assert out.dtype == v.dtype
    order = fp8_key_order(keys)
    got, want = out.float(), v.float()
    for j in range(keys):
        expected = want[:, order[j]] if order[j] < Sk else torch.zeros_like(want[:, 0])
        assert torch.equal(got[:, j], expected), f"position {j} (key {order[j]})"


def _ptx_text(compiled: object) -> str:
    """The PTX of a compile with ``--keep-ptx`` (the DSL gives the text or its file), runs of
    blanks made one space."""
    ptx = compiled.artifacts.PTX
    ptx = Path(ptx).read_text() if "\n" not in ptx and Path(ptx).is_file() else ptx
    return re.sub(r"[ \t]+", " ", ptx)


def _fp8_kernel(dtype: str, head_dim: int, causal: bool, constants: str, **knobs: bool):
    from attention_crossval.kernel.adapters.own_sm90 import consumer_warpgroups
    from attention_crossval.kernel.own.sm90.fwd import FlashAttentionForwardSm90

    offset, threshold = CONSTANTS[constants]
    return FlashAttentionForwardSm90(
        dtype, head_dim, causal, num_consumer_wg=consumer_warpgroups(head_dim, m192=bool(knobs)),
        max_offset_log2=offset, rescale_threshold_log2=threshold, **knobs,
    )  # fmt: skip


ADAPTER_KNOBS = {"overlap": True, "pingpong": True, "longest_first": True}
COMPILE_CONFIGS = [
    (dtype, head_dim, causal, constants, "adapter")
    for dtype in FP8
    for head_dim in (64, 128)
    for causal in (False, True)
    for constants in (("fixed-e4m3", "fa4") if dtype == FP8[0] else ("fixed-e5m2",))
] + [
    ("float8_e4m3fn", 128, True, "fixed-e4m3", "baseline"),
    ("float8_e5m2", 64, False, "fa4", "baseline"),
]


@pytest.mark.cpu
@needs_cutlass
@pytest.mark.parametrize(("dtype", "head_dim", "causal", "constants", "variant"), COMPILE_CONFIGS)
def test_fp8_kernel_compiles_to_fp8_wgmma(
    dtype: str,
    head_dim: int,
    causal: bool,
    constants: str,
    variant: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The FP8 kernel builds for sm_90a on fake tensors (keys-contiguous V, bf16 O, descales):
    both GEMMs are FP8 WGMMAs (``m64n128k32`` for S, ``m64n{D}k32`` for O), P goes through the
    satfinite FP8 conversion (32 pairs per block: 2 rows x 128 keys / 4 lanes / 2), O is
    stored as bf16, and there is no byte permute (``prmt``: each A register of P is two
    converted pairs, and P stays in its lanes), no local memory
    and no spill. The lazy rescale adds one compare per row and loop only with a threshold."""
    knobs = ADAPTER_KNOBS if variant == "adapter" else {}
    kernel = _fp8_kernel(dtype, head_dim, causal, constants, **knobs)
    ptx = _ptx_text(kernel.compile(options=f"--keep-ptx --dump-dir={tmp_path} remarks{{ptx}}"))
    fmt = PTX_NAME[dtype]
    for n in {128, head_dim}:
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.{fmt}.{fmt}" in ptx
    assert "k16" not in re.sub(r"m64n\d+k32", "", " ".join(re.findall(r"m64n\d+k\d+", ptx)))
    loops = 3 if knobs else 1  # the overlap's first block and its masked / unmasked loops
    assert ptx.count(f"cvt.rn.satfinite.{fmt}x2.f32") == 32 * loops
    assert "st.global.b16" in ptx and "ex2.approx.ftz.f32" in ptx
    assert "prmt" not in ptx
    assert ".local" not in ptx
    report = "".join(capfd.readouterr())
    frames = [int(n) for n in re.findall(r"(\d+) bytes stack frame", report)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert frames and spills and max(frames + spills) == 0, report[-2000:]
    # The lazy rescale: growth <= threshold (an immediate) per row (2) and loop; none at 0.
    threshold = CONSTANTS[constants][1]
    compares = re.findall(r"setp\.le\.f32 %p\d+, %r\d+, (0f[0-9A-F]{8})", ptx)
    immediate = "0f" + struct.pack(">f", threshold).hex().upper()
    assert compares == ([immediate] * 2 * loops if threshold else []), compares


@pytest.mark.cpu
@needs_cutlass
def test_fp8_kernel_refuses_what_it_does_not_do() -> None:
    """FP8 with smem_epilogue or persistent, an offset or threshold outside [0, 64), a V that
    is not keys-contiguous, and per-batch lengths: a ValueError that names the rule."""
    from attention_crossval.kernel.own.common.host import compile_on_fake_tensors
    from attention_crossval.kernel.own.sm90.fwd import FlashAttentionForwardSm90

    for knob in ("smem_epilogue", "persistent"):
        with pytest.raises(ValueError, match="FP8"):
            FlashAttentionForwardSm90("float8_e4m3fn", 128, False, **{knob: True})
    for name in ("max_offset_log2", "rescale_threshold_log2"):
        for bad in (-1.0, 64.0, float("nan")):
            with pytest.raises(ValueError, match=name):
                FlashAttentionForwardSm90("float8_e5m2", 64, False, **{name: bad})
    kernel = FlashAttentionForwardSm90("float8_e4m3fn", 64, False)
    with pytest.raises(ValueError, match="unit stride along S"):  # V as the 16-bit kernel takes it
        compile_on_fake_tensors(kernel, kernel.dtype, "sm_90a")
    with pytest.raises(ValueError, match="dense path only"):  # lengths: the varlen path
        compile_on_fake_tensors(kernel, kernel.dtype, "sm_90a", varlen=True, fp8=True)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_inputs_reach_the_device_bit_for_bit_inside_nan_guards(dtype: str) -> None:
    """``_torch.to_device`` of an FP8 case array: the view holds the same bits (torch's FP8
    dtype), and the guard bands hold NaN, so a kernel reading past a sequence gets NaN."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    from attention_crossval.kernel.adapters._torch import GUARD, to_device

    rng = np.random.default_rng(0)
    array = (rng.standard_normal((2, 37, 3, 16)) * 50).astype(getattr(ml_dtypes, dtype))
    view = to_device(array, "cpu")
    assert view.dtype == getattr(torch, dtype) and tuple(view.shape) == array.shape
    assert np.array_equal(view.view(torch.uint8).numpy(), array.view(np.uint8))
    buf = view.as_strided((2, 37 + 2 * GUARD, 3, 16), view.stride(), 0)
    guards = torch.cat([buf[:, :GUARD], buf[:, GUARD + 37 :]], dim=1)
    assert bool(guards.float().isnan().all())


@pytest.mark.cpu
def test_own_sm90_fp8_adapter_declares_and_hands_over_the_fp8_case() -> None:
    """``own-sm90-fp8`` declares FP8 with descales and the fixed constants' chain per format
    (FA4's through ``create_fa4``, its e4m3 chain the one that can saturate); its output is bf16
    (another output dtype is refused by name), and a case's descales reach the kernel as float32
    ``[B, Hkv]``, ones where it has none. Needs the FP8 case model (issue 24's CPU half)."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    from attention_crossval.reference.case import INPUT_DTYPES, AttentionCase

    if FP8[0] not in INPUT_DTYPES:
        pytest.skip("the case model has no FP8 inputs yet (issue 24's CPU half)")
    from attention_crossval.kernel.adapters.own_sm90_fp8 import (
        create,
        create_fa4,
        descale_tensors,
    )
    from attention_crossval.kernel.harness.registry import UNPROVEN, resolve

    adapter, fa4 = resolve("own-sm90-fp8"), create_fa4()
    assert "own-sm90-fp8" not in UNPROVEN and type(adapter) is type(create())
    for spec, fixed in ((adapter.spec, True), (fa4.spec, False)):
        assert spec.dtypes == set(FP8) and spec.descales and spec.gqa
        for dtype in FP8:
            chain = spec.precision_for(dtype)
            assert chain.p_dtype == dtype and chain.output_dtype == "bfloat16"
            want = CONSTANTS[f"fixed-{PTX_NAME[dtype]}" if fixed else "fa4"]
            assert (chain.max_offset_log2, chain.rescale_threshold_log2) == want
            assert chain.can_saturate == (not fixed and dtype == FP8[0])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 8, 2, 64)).astype(ml_dtypes.float8_e4m3fn)
    k_descale = np.array([[0.5, 2.0], [1.0, 0.25]], np.float32)
    case = AttentionCase(q=x, k=x, v=x, k_descale=k_descale)
    assert case.out_dtype == "bfloat16" and adapter.spec.unsupported(case) is None
    q_d, k_d, v_d = descale_tensors(case, "cpu")
    assert all(t.dtype == torch.float32 and tuple(t.shape) == (2, 2) for t in (q_d, k_d, v_d))
    assert bool((q_d == 1).all()) and bool((v_d == 1).all())
    assert np.array_equal(k_d.numpy(), k_descale)
    other = AttentionCase(q=x, k=x, v=x, output_dtype="float32")
    assert "output_dtype" in adapter.spec.unsupported(other)


@pytest.mark.cpu
@needs_cutlass
@needs_tvm_ffi
@pytest.mark.usefixtures("dsl_arch_sm90a")
def test_fp8_launch_goes_through_the_own_kernels_tvm_ffi_launch(
    launch_compiles: list[tuple],  # noqa: F811 - the fixture
) -> None:
    """``own_sm90_fp8.launch`` copies V keys-contiguous and calls the own kernels' TVM-FFI launch
    (``_cute.launch``), as the 16-bit adapters do: one sm_90a compile per variant (a second
    call reuses it; FA4's constants are another variant), every parameter filled (TVM-FFI
    counts them), and the compiled function's C++ checks refuse host tensors (argument #0),
    so the call got past the Python part with FP8 q, k, the padded V, bf16 O and the descales.
    Its own checks come first and name the rule (k and v must match)."""
    torch = pytest.importorskip("torch")
    from attention_crossval.kernel.adapters import _cute, own_sm90_fp8

    compiles = launch_compiles
    q, k, v = (torch.zeros(2, 200, 2, 64).to(torch.float8_e4m3fn) for _ in range(3))
    out, lse = torch.zeros(2, 200, 2, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 200)
    descales = tuple(torch.ones(2, 2) for _ in range(3))

    def call(constants: tuple[float, float], v: object = v) -> None:
        own_sm90_fp8.launch(
            q, k, v, out, lse, 0.125, causal=True, descales=descales,
            max_offset_log2=constants[0], rescale_threshold_log2=constants[1],
            **dict.fromkeys(own_sm90_fp8.KNOBS, True),
        )  # fmt: skip

    fixed, fa4 = CONSTANTS["fixed-e4m3"], CONSTANTS["fa4"]
    for constants in (fixed, fixed, fa4):
        with pytest.raises(ValueError, match=r"argument #0(.|\n)*expected device_type=cuda"):
            call(constants)
    assert len(compiles) == 2 and compiles[0][-1] is True, compiles  # the FP8 key part
    function, padding = _cute._COMPILED[compiles[0]]
    assert len(padding) == 14  # q, k, v, o, lse, scale_log2, five optional, three descales
    with pytest.raises(TypeError, match="14 parameters"):
        function(q, k, v, out, lse, 0.125)
    with pytest.raises(ValueError, match="k .* and v .* must match"):
        call(fixed, v[:, :100])
