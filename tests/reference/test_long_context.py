"""Long contexts (docs/long-context.md): row intervals, the chunked reference, adversarial row
plans, the worst-row scan, timed phases, and a kernel whose bug shows only past 32k keys.

The tests run at sizes a CPU does in seconds (few query rows, up to 40k keys);
``test_long_context_gpu.py`` checks flash-attn-cute at 64k prefill and 128k decode.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.references import CaseReferences, reference_findings
from attention_crossval.properties.strategies import attention_cases, long_context_cases
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.masks import key_ranges, visible_all, visible_counts
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.rowwise import row_scores, rowwise_attention
from attention_crossval.reference.sampling import adversarial_plan, candidates, worst_positions
from attention_crossval.reference.streaming import RescaleTrace, streaming_attention
from attention_crossval.report.configs import Config, _mask, preset
from attention_crossval.report.runner import PHASES
from attention_crossval.testing.broken.cpu_long import LATE_KEYS, correct, late_rescale

pytestmark = pytest.mark.cpu
_SPEC = KernelSpec(
    "long-test", mask_kinds=frozenset({"causal", "window", "varlen"}), tile_m=16, tile_n=16
)


@settings(max_examples=40, deadline=None)
@given(attention_cases(spec=_SPEC, max_len=40))
def test_key_ranges_are_the_visibility_predicate(case: AttentionCase) -> None:
    """One interval per row, equal to the dense predicate, so long cases never need it."""
    dense = visible_all(case)
    assert np.array_equal(visible_counts(case), dense.sum(axis=-1))
    for b in range(case.B):
        lo, hi = key_ranges(case, b)
        j = np.arange(case.Sk)
        assert np.array_equal((j >= lo[:, None]) & (j < hi[:, None]), dense[b, 0])


@settings(max_examples=25, deadline=None)
@given(attention_cases(spec=_SPEC, max_len=40), st.sampled_from(["numpy", "torch"]))
def test_rowwise_reference_agrees_with_the_float64_streaming_tier(
    case: AttentionCase, backend: str
) -> None:
    """Chunked over rows and keys (tiny chunks, so every chunk boundary is crossed)."""
    if backend == "torch":
        pytest.importorskip("torch", reason="torch is not installed: the NumPy path is tested")
    positions = np.arange(case.Sq)[::2]
    got = rowwise_attention(case, positions, backend=backend, row_chunk=3, key_chunk=5)
    want = streaming_attention(case)
    scale = np.maximum(np.abs(want.o[:, positions]).max(initial=0), 1)
    assert np.allclose(got.o, want.o[:, positions], rtol=0, atol=1e-12 * scale)
    want_lse = want.lse[:, :, positions]
    # LSE = m + log l: float64 roundings of |m| up to ~1e6 (the huge distribution)
    close = np.isclose(got.lse, want_lse, rtol=1e-12, atol=1e-9)
    assert ((got.lse == want_lse) | close).all()


def _long_case(Sk: int = 40_000, Sq: int = 256, distribution: str = "ramp") -> AttentionCase:
    """Causal, few query rows, many keys: every row sees more than 32k keys."""
    return Config(
        "bfloat16", 64, Sq, Sk, Hq=2, Hkv=1, mask="causal", distribution=distribution
    ).build()


def test_plan_holds_every_reason_and_stays_in_budget() -> None:
    case = Config("bfloat16", 64, 1500, 1000, mask="window").build()  # diagonal enters late
    found = candidates(case, tile_m=128, tile_n=128)
    lo, hi = key_ranges(case, 0)
    count = hi - lo
    assert {0, 1499} <= set(found["edges"].tolist())
    assert set(range(0, 1500, 128)) <= set(found["tile_edges"].tolist())
    chosen = found["mod_tile"]
    assert chosen.size and ((count[chosen] % 128 == 1) | ((hi[chosen] - 1) % 128 == 0)).all()
    for series in (lo, hi):  # where the diagonal enters the keys, where the window leaves key 0
        bend = int(np.flatnonzero(np.diff(series, 2))[0]) + 1
        assert bend in set(found["kinks"].tolist())
    plan = adversarial_plan(case, tile_m=128, tile_n=128, budget=40, seed=3)
    assert set(plan.reasons) == {"edges", "kinks", "tile_edges", "mod_tile", "uniform"}
    assert len(plan.positions) <= 40 + len(found["edges"])
    assert set(plan.reasons["tile_edges"].tolist()) >= {0, 1499}


def test_ramp_forces_hundreds_of_rescales_past_64_blocks() -> None:
    """The long ramp holds exactly: every visible block after the first raises the max, as
    the streaming trace proves on sampled rows."""
    case = _long_case(Sq=4)
    trace = RescaleTrace()
    streaming_attention(case, StreamingPrecision.flash_attention("bfloat16"), trace=trace)
    assert trace.visible_blocks.min() == -(-case.Sk // 128)
    assert (trace.rescales == trace.visible_blocks - 1).all()
    assert trace.rescales.min() >= 300


def test_scan_ranks_the_rows_a_late_bug_breaks_first() -> None:
    """The broken kernel is exact on rows with <= 32768 visible keys; the float32 scan puts
    the others first."""
    case = Config("bfloat16", 64, 64, 32_800, Hq=1, Hkv=1, mask="causal", distribution="ramp")
    case = case.build()
    result = late_rescale()(case)
    scores = row_scores(case, result, row_chunk=16, key_chunk=4096)
    lo, hi = key_ranges(case, 0)
    late = hi > LATE_KEYS
    assert scores[0, 0, late].min() > 10 * scores[0, 0, ~late].max()
    assert late[worst_positions(scores, 4)].all()


@pytest.mark.parametrize("factory", [late_rescale, correct])
def test_a_bug_past_32k_keys_is_caught_on_sampled_rows(factory) -> None:
    """A long case (above the dense limit) is checked on a row plan plus the worst rows: the
    late-rescale kernel fails ``bound``, the same tier unmutated passes, in seconds."""
    kernel, case = factory(), _long_case()
    result = kernel(case)
    refs = CaseReferences(case, rows=2, subset_rows=16, tile_m=128, tile_n=128)
    assert refs.long
    findings = reference_findings(case, result, kernel.spec, references=refs.focus(result))
    assert any(f.check == "bound" for f in findings) is (factory is late_rescale), findings


def test_report_phases_add_up_on_a_long_case(tmp_path) -> None:
    """Every phase is timed and the record's unaccounted time is (close to) zero."""
    from attention_crossval.report.cache import ExactCache
    from attention_crossval.report.runner import Kernel, RunOptions, evaluate

    config = Config("bfloat16", 64, 256, 33_000, Hq=2, Hkv=1, mask="causal")
    options = RunOptions(rows=2, repeats=2, subset_rows=16)
    (record,) = evaluate(config, [Kernel("cpu-long", correct())], options, ExactCache(tmp_path))
    timing = record["timing"]
    assert record["verdict"] == "pass", record["pairs"]
    assert {"scan_s", "float64_s", "bound_s", "exact_s", "harness_s"} <= set(timing)
    assert abs(timing["unaccounted_s"]) < 0.05 * timing["total_s"] + 0.2
    assert sum(timing.get(p, 0.0) for p in PHASES) == pytest.approx(
        timing["total_s"] - timing["unaccounted_s"]
    )
    assert record["sampling"]["rows"] < 64  # not every row: 256 x 2


def test_long_references_never_form_an_sq_by_sk_array() -> None:
    """The scan and the references of a long case allocate O(row chunk x key chunk + rows x
    Sk): here half a dense float64 score matrix, and no more at any Sq (chunks are fixed)."""
    import tracemalloc

    case = _long_case(Sk=33_000, Sq=1024, distribution="gaussian")
    refs = CaseReferences(case, rows=2, subset_rows=16, tile_m=128, tile_n=128)
    result = AttentionResult(o=np.zeros((1, 1024, 2, 64)), lse=np.zeros((1, 2, 1024)))
    tracemalloc.start()
    refs = refs.focus(result)
    refs.bounds(StreamingPrecision.flash_attention("bfloat16"), 128)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    dense = case.B * case.Hq * case.Sq * case.Sk * 8  # float64 scores, bytes
    assert peak < dense / 2


def test_gpu_long_preset_reaches_the_sizes_of_the_issue() -> None:
    configs = {c.name: c for c in preset("gpu-long")}
    assert configs["long-prefill-64k"].Sq == configs["long-prefill-64k"].Sk == 65536
    assert configs["long-decode-128k-b8"].B == 8 and configs["long-decode-128k"].Sk == 131072
    assert any(c.distribution == "ramp" for c in configs.values())
    mask = _mask(configs["long-varlen-32k"])  # building its 4 x 32k inputs takes seconds
    assert mask.k_lengths[0] == 32768 and max(mask.k_lengths[1:]) < 1024
    assert KernelSpec("x").max_seqlen >= 131072  # the default hides no preset size


_LONG_SPEC = KernelSpec(
    "long-strategy",
    mask_kinds=frozenset({"causal", "varlen"}),
    head_dims=frozenset({4, 8}),
    tile_m=16,
    tile_n=16,
    device="cpu",
)


@settings(max_examples=16, deadline=None)
@given(long_context_cases(spec=_LONG_SPEC, min_keys=1100, max_keys=1600))
def test_long_context_cases_have_their_shape_and_ramps_rescale_every_block(case) -> None:
    """At reduced sizes (1100-1600 keys, tiles of 16: ~100 blocks a row): each kind has its
    shape, and on a ramp the streaming trace proves a rescale in every visible block after the
    first."""
    kind = dict(part.split("=") for part in case.label.split())["long"].split("-")[0]
    assert 1100 <= case.Sk <= 1600 and case.Hq % case.Hkv == 0
    if kind == "decode":
        assert case.Sq == 1
    elif kind == "prefill":
        assert case.Sq == case.Sk and case.mask.causal
    elif kind == "varlen":
        lengths = sorted(case.mask.k_lengths)
        assert lengths[-1] == case.Sk and lengths[-2] <= 4 * 16 + 1 and len(lengths) >= 3
    else:
        trace = RescaleTrace()
        precision = StreamingPrecision.flash_attention(case.dtype)
        streaming_attention(case, precision, block_m=16, block_n=16, trace=trace)
        assert (trace.rescales == trace.visible_blocks - 1).all()
        assert trace.rescales.min() >= 60


def test_long_context_cases_default_to_32k_and_128k() -> None:
    from attention_crossval.properties._strategies.long import _keys

    assert _keys(32768, 131072, 128) == [32768, 32769, 81920, 131072]
    with pytest.raises(ValueError, match="varlen"):
        long_context_cases(spec=KernelSpec("x", mask_kinds=frozenset({"causal"})))
    with pytest.raises(ValueError, match="max_keys"):
        long_context_cases(spec=KernelSpec("x", max_seqlen=4096))


def test_mask_without_rows_is_empty_everywhere() -> None:
    """Zero lengths: every row empty, no key range."""
    case = AttentionCase(
        np.zeros((1, 3, 1, 4), np.float32),
        np.zeros((1, 5, 1, 4), np.float32),
        np.zeros((1, 5, 1, 4), np.float32),
        mask=Mask(q_lengths=(0,), k_lengths=(0,)),
    )
    assert (visible_counts(case) == 0).all()


# Run by Triton's interpreter (TRITON_INTERPRET=1, NumPy on the CPU) in a fresh process: the
# variable must be set before the kernel module is imported, and the interpreter's fixes
# (properties/triton_interpreter.py) applied.
_INTERPRETED = """
from attention_crossval.properties.triton_interpreter import patch_interpreter

patch_interpreter()

from attention_crossval.testing.broken.triton_fa import correct, late_rescale
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.report.configs import Config

case = Config("float16", 16, 16, 384, Hq=2, Hkv=1, distribution="ramp", tile_n=64).build()
for make in (late_rescale, correct):
    adapter = make()
    adapter.device = "cpu"
    if adapter.switches.get("LATE_BLOCK"):
        adapter.switches["LATE_BLOCK"] = 4  # keys past 256 instead of 32768
    verdict = run_case(adapter, case)
    print(adapter.spec.name, sorted({f.check for f in verdict.findings}))
"""


def test_triton_late_rescale_is_caught_under_the_interpreter() -> None:
    """The Triton kernel's late-rescale bug (its threshold lowered to K block 4 of 64 keys), run
    by Triton's interpreter: the harness fails it on ``bound``, the unbroken kernel passes the
    same ramp. The 64k-key run on the GPU is ``test_long_context_gpu.py``."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torch", reason="torch is not installed (the interpreter runs on it)")
    pytest.importorskip("triton", reason="triton is not installed: the GPU test covers it")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-2:] == [
        "triton-fa-late-rescale ['bound']",
        "triton-fa-correct []",
    ], run.stdout
