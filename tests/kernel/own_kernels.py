"""What the tests of the own CuTe DSL kernels share (test_own_kernels.py for SM90,
test_own_sm90_fp8.py, test_own_sm100.py): the compile configurations, the skips without
cutlass or tvm_ffi, the DSL arch and compile-counting fixtures of the launch tests, the spill
check and the targeted cases."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator

import numpy as np
import pytest

from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.precision import cast_input

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(
    not HAS_CUTLASS, reason="cutlass not importable (pip install nvidia-cutlass-dsl==4.8.1)"
)
needs_tvm_ffi = pytest.mark.skipif(
    importlib.util.find_spec("tvm_ffi") is None,
    reason="tvm_ffi not importable (pip install -e '.[kernels]': apache-tvm-ffi)",
)
CONFIGS = [
    (dtype, head_dim, causal)
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
    for causal in (False, True)
]


def assert_no_spills(compile_output: str) -> None:
    """ptxas' ``remarks{ptx}`` report in ``compile_output`` exists and says 0 spill bytes."""
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", compile_output)]
    assert spills, f"no ptxas spill report in the compile output:\n{compile_output[-2000:]}"
    assert max(spills) == 0, f"ptxas spills: {spills}"


def ramp_case(
    Sq: int,
    Sk: int,
    *,
    D: int = 128,
    dtype: str = "bfloat16",
    H: int = 2,
    Hkv: int | None = None,
    **mask: object,
) -> AttentionCase:
    """Keys on a ramp (every KV block raises the running max, so O must be rescaled), random
    values, two batches; lengths chosen by the tests around the 128 tiles; ``Hkv`` kv heads
    (default ``H``), ``mask`` the :class:`Mask` fields."""
    rng = np.random.default_rng(Sq * 1000 + Sk)
    Hkv = H if Hkv is None else Hkv
    q = 0.5 + 0.05 * rng.standard_normal((2, Sq, H, D))
    k = np.linspace(0.0, 2.0, Sk)[None, :, None, None] + 0.1 * rng.standard_normal((2, Sk, Hkv, D))
    v = rng.standard_normal((2, Sk, Hkv, D))
    arrays = (cast_input(a, dtype) for a in (q, k, v))
    return AttentionCase(*arrays, mask=Mask(**mask), label=f"own-sm90 {Sq}x{Sk}")


TARGETED = {
    "rescale over 4 blocks": lambda: ramp_case(128, 512),
    "seqlen_k residue": lambda: ramp_case(200, 300, D=64, dtype="float16"),
    "causal Sq < Sk": lambda: ramp_case(130, 389, causal=True),
    "causal Sq > Sk (empty rows)": lambda: ramp_case(300, 129, causal=True, D=64),
    "causal Sq == Sk, partial tile": lambda: ramp_case(257, 257, causal=True, dtype="float16"),
    "single key": lambda: ramp_case(5, 1, causal=True),
}


@pytest.fixture
def dsl_arch_sm90a() -> Iterator[None]:
    """The DSL's runtime arch set to sm_90a, as ``CUTE_DSL_ARCH=sm_90a`` sets it, so that the
    adapters' launch compiles for sm_90a and loads the result as on an H200 (the DSL gives a
    build for another arch than the runtime's no function to call); reset afterwards to the
    environment's or the detected arch."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    envar.arch = "sm_90a"
    try:
        yield
    finally:
        del envar.arch


@pytest.fixture
def launch_compiles(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The keys of every compile the own adapters' launch asks ``_cute.compiled`` for, from an
    empty compile cache (so a test sees its own compiles, and a reuse as no new key)."""
    from attention_crossval.kernel.adapters import _cute

    keys: list[tuple] = []
    real_compiled = _cute.compiled

    def counted(key: tuple, make_kernel: object) -> tuple:
        keys.append(key)
        return real_compiled(key, make_kernel)

    monkeypatch.setattr(_cute, "compiled", counted)
    monkeypatch.setattr(_cute, "_COMPILED", {})
    return keys
