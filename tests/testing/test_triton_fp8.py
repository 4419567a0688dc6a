"""The Triton FP8 forward (testing/broken/triton_fp8.py): its constants, its run on FA4's trigger
under Triton's interpreter on the CPU, and on a GPU.

FA4's trigger (:func:`creep_case`) is a row max creeping up by just under the lazy threshold per
K block: with the fixed constants P never clamps and the kernel passes every check; with FA4's
(offset 8, threshold 4, e4m3) P clamps at 448 while the row sum keeps the fp32 P, and the
harness fails it on ``bound``. The streaming trace proves the trigger fires (skipped rescales,
clamped P), so a pass is not a case that never exercised the bug.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.registry import BROKEN_FIXTURES, default_kernels, resolve
from attention_crossval.properties.kernels_under_test import worker
from attention_crossval.reference.precision import StreamingPrecision, fp8_max
from attention_crossval.reference.streaming import RescaleTrace, streaming_attention
from attention_crossval.testing.broken.triton_fp8 import (
    BLOCK_M,
    BLOCK_N,
    FA4,
    FIXED,
    PROMOTION_INTERVAL,
    creep_case,
    fa4_constants,
    fixed,
)


def _trace(case, constants: tuple[float, float]) -> RescaleTrace:
    offset, threshold = constants
    chain = StreamingPrecision.fp8_attention(
        case.dtype, max_offset_log2=offset, rescale_threshold_log2=threshold
    )
    trace = RescaleTrace()
    streaming_attention(case, chain, block_m=BLOCK_M, block_n=BLOCK_N, trace=trace)
    return trace


@pytest.mark.cpu
def test_constants_fixed_fit_the_format_and_fa4s_do_not() -> None:
    """The fixed constants keep ``max_offset + threshold <= log2(fp8 max)``; FA4's e4m3 pair
    does not, and its fixture declares the fixed chain (so the bound is defined and can fail);
    it is never a default kernel."""
    for dtype, (offset, threshold) in FIXED.items():
        assert offset + threshold <= math.log2(fp8_max(dtype)), dtype
        assert not fixed().spec.precision_for(dtype).can_saturate
    assert all(sum(pair) > math.log2(fp8_max(dtype)) for dtype, pair in FA4.items())
    broken = resolve("triton-fp8-fa4")
    assert broken.constants == FA4 and broken.expected_check == "bound"
    for dtype in FA4:
        assert broken.spec.precision_for(dtype) == fixed().spec.precision_for(dtype)
    assert set(BROKEN_FIXTURES) & set(default_kernels(has_gpu=True)) == set()
    assert resolve("triton-fp8").spec.descales and resolve("triton-fp8").spec.dtypes == set(FIXED)


@pytest.mark.cpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_creep_case_fires_the_trigger(causal: bool) -> None:
    """On the trigger, both chains skip rescales; only FA4's clamps P."""
    case = creep_case(causal=causal)
    fa4, ok = _trace(case, FA4[case.dtype]), _trace(case, FIXED[case.dtype])
    assert fa4.skipped_rescales.sum() > 100 and ok.skipped_rescales.sum() > 100
    assert fa4.clamped_p.sum() > 1000 and ok.clamped_p.sum() == 0


# Run by Triton's interpreter in a fresh process (TRITON_INTERPRET=1 must be set before the
# kernel module is imported). Prints the sorted findings per adapter on FA4's trigger, then the
# fixed kernel's largest difference from the streaming tier, in bf16 ulps, on a case with two kv
# heads of different descales, varlen lengths and a causal mask.
_INTERPRETED = """
from attention_crossval.properties.triton_interpreter import patch_interpreter

patch_interpreter()

import dataclasses

import numpy as np

from attention_crossval.testing.broken.triton_fp8 import (
    BLOCK_M, BLOCK_N, creep_case, fa4_constants, fixed
)
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.reference.case import Mask
from attention_crossval.reference.streaming import streaming_attention

trigger = creep_case(causal=True)
for make in (fixed, fa4_constants):
    adapter = make()
    adapter.device = "cpu"
    print(adapter.spec.name, sorted({f.check for f in run_case(adapter, trigger).findings}))
case = creep_case("float8_e5m2", Sq=100, Sk=700, D=32, Hq=4, Hkv=2, seed=1)
case = dataclasses.replace(
    case,
    q_descale=case.q_descale * np.float32([[1, 2]]),
    k_descale=case.k_descale * np.float32([[3, 0.5]]),
    v_descale=case.v_descale * np.float32([[1, 4]]),
    mask=Mask(causal=True, q_lengths=(77,), k_lengths=(650,)),
)
adapter = fixed()
adapter.device = "cpu"
print("gqa varlen", sorted({f.check for f in run_case(adapter, case).findings}))
o = adapter(case).o[:, :77]
fp32_mma = dataclasses.replace(  # the interpreter's dots accumulate in fp32
    adapter.spec.precision_for(case.dtype), mma_accumulator_bits=None, mma_promotion_interval=None
)
ref = streaming_attention(case, fp32_mma, block_m=BLOCK_M, block_n=BLOCK_N).o[:, :77]
ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-126))) - 7)
print("max bf16 ulps from the streaming tier", np.max(np.abs(o - ref) / ulp))
"""


@pytest.mark.cpu
def test_fp8_kernel_under_the_interpreter() -> None:
    """The kernel itself, run by Triton's interpreter. On FA4's trigger (e4m3, causal, 16 K
    blocks) the fixed constants pass every check and FA4's fail ``bound`` alone (O wrong, LSE
    right). On e5m2 with GQA (two kv heads, different descales), varlen lengths and a partial
    last tile, the fixed kernel passes every check and is within one bf16 ulp of the streaming
    tier's emulation of its chain with fp32 MMAs (the interpreter's dots have no narrow FP8
    accumulator): the same algorithm up to the fp32 summation order."""
    pytest.importorskip("torch", reason="torch is not installed (the interpreter runs on it)")
    pytest.importorskip("triton", reason="triton is not installed: the GPU test covers it")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-4:-1] == ["triton-fp8 []", "triton-fp8-fa4 ['bound']", "gqa varlen []"], lines
    assert lines[-1].startswith("max bf16 ulps") and float(lines[-1].split()[-1]) <= 1.0, lines


# Triton's names of the FP8 formats: pointer types of the signature and PTX operand types.
_TRITON_FP8 = {"float8_e4m3fn": ("fp8e4nv", "e4m3"), "float8_e5m2": ("fp8e5", "e5m2")}


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", sorted(_TRITON_FP8))
def test_fp8_kernel_compiles_to_fp8_wgmma_for_sm90(dtype: str) -> None:
    """Compiled for sm_90 without a GPU (Triton's ahead-of-time path, its bundled ptxas): both
    dots are FP8 WGMMAs (Q K^T over D in k32 steps, P V over the keys), not the fp16
    ``mma.sync`` Triton falls back to when asked for a fully fp32 accumulation, and P is
    converted with ``cvt.rn.satfinite``."""
    import re

    pytest.importorskip("triton", reason="triton is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from attention_crossval.testing.broken._triton_fp8_kernel import attention_fp8_fwd

    name, ptx_type = _TRITON_FP8[dtype]
    offset, threshold = FIXED[dtype]
    constants = dict(
        MAX_OFFSET=offset, THRESHOLD=threshold, P_MAX=fp8_max(dtype), CAUSAL=True,
        IMPRECISE_ACC=PROMOTION_INTERVAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=128,
    )  # fmt: skip
    pointers = dict.fromkeys(("Q", "K", "VT"), f"*{name}") | {"O": "*bf16", "L": "*fp32"}
    pointers |= dict.fromkeys(("QLEN", "KLEN"), "*i32")
    pointers |= dict.fromkeys(("Q_DESCALE", "K_DESCALE", "V_DESCALE"), "*fp32")
    signature = {
        arg: "constexpr" if arg in constants else pointers.get(arg, "i32")
        for arg in attention_fp8_fwd.arg_names
    } | {"scale_log2": "fp32"}
    source = ASTSource(fn=attention_fp8_fwd, signature=signature, constexprs=constants)
    ptx = triton_compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?);?\s", ptx))
    both = f"f32.{ptx_type}.{ptx_type}"
    assert wgmma == {f"m64n{BLOCK_N}k32.{both}", f"m64n128k32.{both}"}, wgmma
    assert "mma.sync" not in ptx
    assert f"cvt.rn.satfinite.{ptx_type}x2.f32" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa4_constants_are_caught_on_the_gpu(causal: bool) -> None:
    """On a GPU: FA4's constants fail ``bound`` alone on the trigger, the fixed ones pass. 1024
    keys: on longer creeping ramps the worst case of the declared narrow accumulator leaves a
    bound FA4's clamp stays inside (docs/fp8.md#mma-accumulation)."""
    case = creep_case(Sk=1024, D=128, causal=causal)
    runs = ((fixed, "triton-fp8", set()), (fa4_constants, "triton-fp8-fa4", {"bound"}))
    for make, name, expected in runs:
        verdict = run_case(make(), case, isolated=worker(name))
        assert {f.check for f in verdict.findings} == expected, verdict.findings
