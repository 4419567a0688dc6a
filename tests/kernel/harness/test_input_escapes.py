"""Regressions for inputs that escaped as tracebacks, hangs or garbage (issue 21, part C).

Each test names the escape it pins: non-native byte order, a sink far above every logit, a
saved case with out-of-range scalars, a precision chain with an infinite threshold, a dlse
spanning more than the float64 exponent range, and file names built from user text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest

from attention_crossval.kernel.harness.backward import run_backward_case
from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.properties import replay
from attention_crossval.properties.exact_oracles import agrees_with_double, naive_backward
from attention_crossval.reference.case import AttentionCase, Mask, nonfinite_rows
from attention_crossval.reference.exact import exact_attention, naive_exact_attention
from attention_crossval.reference.exact_backward import exact_backward
from attention_crossval.reference.file_names import MAX_PART, safe_file_name, safe_part
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.testing.broken.cpu_backward_faults import BrokenBackwardAdapter
from attention_crossval.testing.broken.cpu_faults import GuardedNumpyAdapter

pytestmark = pytest.mark.cpu


def _case(sink: float, **options) -> AttentionCase:
    rng = np.random.default_rng(1)
    # one kv head for both query heads: sink-only rows and ordinary rows share a chunk
    q, k, v = (
        rng.standard_normal((1, s, h, 8)).astype(np.float16) for s, h in ((3, 2), (5, 1), (5, 1))
    )
    with np.errstate(over="ignore"):  # 1e39 becomes inf, which the case refuses
        sink_array = np.array([sink, 0.0], np.float32)
    return AttentionCase(q, k, v, mask=Mask(causal=True), sink=sink_array, **options)


# ---- a sink far above every logit ----------------------------------------------------------


@pytest.mark.parametrize("sink", [1e9, 1e12, 3e38, float(np.finfo(np.float32).max)])
def test_a_dominant_sink_is_handled_analytically_in_bounded_time(sink: float) -> None:
    """Escape: exp(sink - max logit) as a fixed-point integer took minutes at 1e9, raised
    MemoryError at 1e12 and OverflowError at 3e38. Now O = 0 and LSE = sink (the nearest
    doubles) with bound 2^-1074, in milliseconds."""
    case = _case(sink, softcap=30.0 if sink == 1e12 else None)
    start = time.perf_counter()
    exact = exact_attention(case)
    assert time.perf_counter() - start < 5.0
    assert (exact.o[:, :, 0] == 0).all() and (exact.o_lo[:, :, 0] == 0).all()
    assert (exact.lse[:, 0] == np.float32(sink)).all()
    assert (exact.o_err_bound[:, 0] == 2.0**-1074).all()
    assert (exact.lse_err_bound[:, 0] == 2.0**-1074).all()
    assert (exact.o[:, :, 1] != 0).any()  # the other head's sink (0) is an ordinary key


@pytest.mark.parametrize("sink", [-3e38, -float(np.finfo(np.float32).max)])
def test_a_sink_far_below_every_logit_weighs_nothing(sink: float) -> None:
    with_sink = _case(sink)
    without = AttentionCase(with_sink.q, with_sink.k, with_sink.v, mask=with_sink.mask)
    exact, reference = exact_attention(with_sink), exact_attention(without)
    np.testing.assert_array_equal(exact.o[:, :, 0], reference.o[:, :, 0])
    np.testing.assert_array_equal(exact.lse[:, 0], reference.lse[:, 0])


@pytest.mark.parametrize("margin", [20.0, 100.0, 820.0, 836.0, 845.0, 900.0])
def test_the_analytic_sink_gives_the_doubles_of_the_full_evaluation(margin: float) -> None:
    """Across the switch (about 835 above the largest logit for 5 keys) the exact tier agrees
    with the naive mpmath loop within its bound: the analytic branch returns the doubles the
    full evaluation rounds to."""
    probe = exact_attention(_case(0.0))
    top = float(np.nanmax(probe.lse[:, 0]))  # >= the largest logit of head 0
    case = _case(float(np.float32(top + margin)))
    exact, naive = exact_attention(case), naive_exact_attention(case, dps=400)
    allowed = np.broadcast_to(exact.o_err_bound.transpose(0, 2, 1)[..., None], exact.o.shape)
    allowed = allowed + np.spacing(np.abs(naive.o))
    assert np.all(np.abs(exact.o + exact.o_lo - naive.o) <= allowed)
    lse_allowed = exact.lse_err_bound + np.spacing(np.abs(naive.lse))
    assert np.all(np.abs(exact.lse - naive.lse) <= lse_allowed)


@pytest.mark.parametrize("sink", [math.inf, -math.inf, math.nan, 1e39])
def test_a_sink_outside_the_float32_range_is_refused(sink: float) -> None:
    with pytest.raises(ValueError, match="sink=.* must hold finite float32 values"):
        _case(sink)


# ---- non-native byte order -----------------------------------------------------------------


def _inputs(dtype: str) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(2)
    return tuple(rng.standard_normal((1, s, 2, 8)).astype(dtype) for s in (3, 5, 5))


@pytest.mark.parametrize("dtype", [">f2", ">f4", "<f2", "<f4"])
def test_inputs_in_any_byte_order_are_read_by_value(dtype: str) -> None:
    """Escape: ``nonfinite_rows`` read big-endian inputs as native (IndexError on finite ones).
    The case converts them to native order, so every tier sees the caller's values."""
    inputs = _inputs(dtype)
    native = AttentionCase(*(x.astype(x.dtype.newbyteorder("=")) for x in inputs))
    case = AttentionCase(*inputs)
    for name in "qkv":
        assert getattr(case, name).dtype.isnative
        np.testing.assert_array_equal(getattr(case, name), getattr(native, name))
    np.testing.assert_array_equal(exact_attention(case).lse, exact_attention(native).lse)


@pytest.mark.parametrize("dtype", [">f2", ">f4"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_big_endian_inputs_are_refused(dtype: str, name: str, bad: float) -> None:
    """Escape: inf/NaN in a valid big-endian row passed the check, and the exact tier then
    certified garbage (O = 1 +- 4.9e-32, LSE = -4.6e18)."""
    inputs = dict(zip("qkv", _inputs(dtype), strict=True))
    inputs[name][0, 2, 1, 3] = bad
    with pytest.raises(ValueError, match=rf"{name} must be finite outside padding"):
        AttentionCase(**inputs)


@pytest.mark.parametrize("dtype", [">f2", ">f4"])
def test_nonfinite_rows_reads_the_bits_in_the_arrays_byte_order(dtype: str) -> None:
    array = _inputs(dtype)[1]
    array[0, 4, 1, 7] = np.inf
    expected = np.zeros((1, 5, 2), bool)
    expected[0, 4, 1] = True
    np.testing.assert_array_equal(nonfinite_rows(array), expected)


def test_float64_in_big_endian_is_refused_by_dtype() -> None:
    q, k, v = _inputs(">f8")
    with pytest.raises(ValueError, match=r"q.dtype=float64 must be one of"):
        AttentionCase(q, k, v)


def test_a_big_endian_upstream_gradient_is_read_by_value() -> None:
    case = AttentionCase(*_inputs("<f2"))
    do = np.random.default_rng(3).standard_normal((1, 3, 2, 8)).astype(">f2")
    backward = BackwardCase(case, do, dlse=np.zeros((1, 2, 3), ">f8"))
    assert backward.do.dtype == np.float16 and backward.do.dtype.isnative
    np.testing.assert_array_equal(backward.do, do)
    do[0, 1, 0, 0] = np.nan
    with pytest.raises(ValueError, match="do must be finite outside padding"):
        BackwardCase(case, do)


# ---- saved cases ---------------------------------------------------------------------------


def _replay(path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = replay.main([str(path)])
    return code, err.getvalue()


@pytest.mark.parametrize("sink", [1e9, 1e12, 3e38, -3e38])
def test_replay_of_a_case_with_a_huge_sink_finishes(sink: float, tmp_path) -> None:
    """Escape: every rerun of a saved case with sink 3e38 was an OverflowError traceback (1e12:
    MemoryError, 1e9: minutes in the exact tier)."""
    path = _case(sink).save(tmp_path / "case.npz")
    start = time.perf_counter()
    with np.errstate(all="ignore"):  # the fp32 chain's sink * log2(e) overflows, as a kernel's
        code, err = _replay(path)
    assert code == 0 and "Traceback" not in err and time.perf_counter() - start < 30


def test_a_saved_case_in_big_endian_replays_by_value(tmp_path) -> None:
    case = _case(0.0)
    path = case.save(tmp_path / "case.npz")
    with np.load(path) as data:
        fields = {name: data[name] for name in data.files}
    for name in "qkv":
        fields[name] = fields[name].astype(">f2")
    np.savez(path, **fields)
    loaded = AttentionCase.load(path)
    for name in "qkv":
        np.testing.assert_array_equal(getattr(loaded, name), getattr(case, name))


# ---- a dlse spanning more than the float64 exponent range ----------------------------------


@pytest.mark.parametrize(
    "low, high", [(1e-300, 1e300), (1e-300, 1.0), (2.0**-1074, 2.0**1023), (-1e308, 1e308)]
)
def test_a_dlse_spanning_the_float64_range_is_exact(low: float, high: float) -> None:
    """Escape: the exact backward took dlse to integers through float64 limbs scaled by
    2^-lowest_bit, which overflowed once the values spanned more than about 2^970
    ("cannot convert float NaN to integer"). Now it agrees with the naive mpmath loop."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 3, 1, 4)).astype(np.float16) for _ in range(3))
    do = rng.standard_normal((1, 3, 1, 4)).astype(np.float16)
    dlse = np.array([[[low, high, 0.5]]])
    case = BackwardCase(AttentionCase(q, k, v), do, dlse)
    exact, naive = exact_backward(case), naive_backward(case, dps=700)
    for name in ("dq", "dk", "dv"):
        hi, lo, bound = (getattr(exact, name + suffix) for suffix in ("", "_lo", "_err_bound"))
        assert agrees_with_double(hi, lo, bound, naive[name]).all(), name
    assert agrees_with_double(exact.d, 0 * exact.d, exact.d_err_bound, naive["d"]).all()


# ---- file names from user text -------------------------------------------------------------

NAMES = [
    "../../x",
    "..",
    ".",
    "",
    "a/b",
    "a\\b",
    "/etc/passwd",
    ".hidden",
    "x" * 300,
    "ker nel:ü\u2603",
    "nul\x00byte",
    "line\nbreak",
    "sdpa-math",
]


@pytest.mark.parametrize("name", NAMES, ids=[ascii(n)[:20] for n in NAMES])
def test_a_file_name_from_user_text_stays_one_safe_name(name: str, tmp_path) -> None:
    part = safe_part(name)
    assert re.fullmatch(r"[A-Za-z0-9_+=-][A-Za-z0-9._+=~-]*", part), part
    assert len(part) <= MAX_PART + 9
    file_name = safe_file_name(name, "bound", "0123456789abcdef", suffix=".npz")
    (tmp_path / file_name).write_bytes(b"")  # no ENAMETOOLONG, no missing folder
    assert [p.name for p in tmp_path.iterdir()] == [file_name]


def test_safe_names_are_kept_and_changed_names_stay_distinct() -> None:
    assert safe_part("sdpa-math") == "sdpa-math" and safe_part("fa3_v2.1") == "fa3_v2.1"
    variants = ["a/b", "a_b", "a\\b", "a b", "x" * 300, "x" * 301, "", ".", ".."]
    assert len({safe_part(v) for v in variants}) == len(variants)


@pytest.mark.parametrize("name", ["../../x", "a/b", "x" * 300, "/abs", "ü/.."])
def test_a_failing_case_is_saved_inside_the_finding_folder(name: str, tmp_path) -> None:
    """Escape: with --report-dir a kernel named ``../../x`` wrote its case outside the folder,
    ``a/b`` raised FileNotFoundError and a 300-character name ENAMETOOLONG."""
    folder = tmp_path / "one" / "two" / "reports"
    forward = GuardedNumpyAdapter("skip_last_row")
    forward.spec = dataclasses.replace(forward.spec, name=name)
    backward = BrokenBackwardAdapter("skip_last_k_block")
    backward.spec = dataclasses.replace(backward.spec, name=name)
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((1, 8, 2, 16)).astype(np.float16) for _ in range(4))
    case = AttentionCase(q, k, v, mask=Mask(causal=True, q_lengths=(6,), k_lengths=(7,)))
    verdicts = [
        run_case(forward, case, compare=False, finding_dir=folder),
        run_backward_case(backward, BackwardCase(case, do), compare=False, finding_dir=folder),
    ]
    saved = [Path(f.case_path) for verdict in verdicts for f in verdict.findings[:1]]
    assert len(saved) == 2 and all(path.parent == folder for path in saved), saved
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(saved)
