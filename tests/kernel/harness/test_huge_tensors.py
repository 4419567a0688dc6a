"""Tensors above 2^31 elements (docs/long-context.md#huge): the element budget is a documented,
overridable limit; the ``gpu-huge`` preset is refused cleanly under a lower one; big inputs reach
an isolated kernel through a mapped file, not the pipe, and a kernel writing into them is still
caught. The full-size case (4 GiB K) runs on the GPU host only: here a scaled-down copy."""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pytest

from attention_crossval.kernel.harness import mapped
from attention_crossval.kernel.harness.forward import fill_padding, run_case
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.reference.case import (
    ELEMENTS_ENV,
    INPUT_DTYPES,
    MAX_ELEMENTS,
    AttentionCase,
    Mask,
    element_budget,
    nonfinite_rows,
)
from attention_crossval.report.configs import HUGE_KEYS, preset

pytestmark = pytest.mark.cpu
FAULTS = "attention_crossval.testing.broken.cpu_faults"


def test_gpu_huge_has_a_tensor_above_2_31_elements() -> None:
    (config,) = preset("gpu-huge")
    shapes = config.shapes()
    assert int(np.prod(shapes["k"])) > 2**31 and int(np.prod(shapes["v"])) > 2**31
    assert (HUGE_KEYS - 1) * config.Hkv * config.D >= 2**31  # the last key starts past 2^31


def test_budget_is_overridable_and_refuses_by_name(monkeypatch) -> None:
    (config,) = preset("gpu-huge")  # listed and sharded under any budget
    monkeypatch.delenv(ELEMENTS_ENV, raising=False)
    assert element_budget() == MAX_ELEMENTS
    with pytest.raises(ValueError, match=rf"config huge-decode-2g: k \[1, {HUGE_KEYS}, 8, 128\] "):
        config.check_budget()
    with pytest.raises(ValueError, match=f"above the element budget 2\\*\\*28 .*{ELEMENTS_ENV}"):
        config.build()  # refused before any array is drawn
    monkeypatch.setenv(ELEMENTS_ENV, "2**32")
    assert element_budget() == 2**32
    config.check_budget()
    monkeypatch.setenv(ELEMENTS_ENV, str(2**20))
    with pytest.raises(ValueError, match=r"above the element budget 2\*\*20"):
        dataclasses.replace(config, Sk=8192, name="").check_budget()
    for bad in ("lots", "0", "2**41", "-5"):
        monkeypatch.setenv(ELEMENTS_ENV, bad)
        with pytest.raises(ValueError, match=re.escape(f"{ELEMENTS_ENV}='{bad}' must be an int")):
            element_budget()


def test_report_refuses_gpu_huge_before_running(monkeypatch, tmp_path, capsys) -> None:
    from attention_crossval.report.cli import main

    monkeypatch.delenv(ELEMENTS_ENV, raising=False)
    argv = ["--preset", "gpu-huge", "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 2
    assert "above the element budget 2**28" in capsys.readouterr().err


def test_finite_check_reads_bits_in_chunks(monkeypatch) -> None:
    """The chunked bit test finds every inf and NaN, and only those, in each dtype."""
    monkeypatch.setattr("attention_crossval.reference.case._FINITE_CHUNK", 7)
    rng = np.random.default_rng(0)
    for dtype in ("float16", "bfloat16", "float32"):
        x = rng.standard_normal((2, 9, 3, 5)) * 1e3
        x[1, 4, 2, 3], x[0, 8, 0, 0], x[0, 0, 1, 4] = np.nan, np.inf, -np.inf
        array = x.astype(INPUT_DTYPES[dtype])
        want = ~np.isfinite(array.astype(np.float32)).all(axis=-1)
        assert np.array_equal(nonfinite_rows(array), want), dtype


def test_derived_cases_share_the_frozen_arrays() -> None:
    """No copy of K when a case is derived (fill_padding without padding, replace)."""
    (config,) = preset("tiny")[:1]
    case = config.build()
    assert fill_padding(case, np.nan) is case
    assert dataclasses.replace(case, label="x").k is case.k
    padded = dataclasses.replace(case, mask=Mask(k_lengths=(case.Sk - 3,)))
    poisoned = fill_padding(padded, np.nan)
    assert poisoned.q is case.q and np.isnan(poisoned.k[0, -3:].astype(np.float32)).all()
    mine = np.zeros((1, 2, 1, 4), np.float16)
    owned = AttentionCase(mine, mine, mine)
    mine[0, 0, 0, 0] = 1.0  # a writable input is still copied: the case never changes
    assert owned.q[0, 0, 0, 0] == 0


def test_huge_draws_are_chunked_and_reproducible(monkeypatch) -> None:
    """Up to the old budget the case's generator draws directly (old recipes keep their
    inputs); beyond, spawned float32 streams give the same values whatever the thread count."""
    from attention_crossval.properties._strategies import scores

    monkeypatch.setattr(scores, "DIRECT_ELEMENTS", 1000)
    monkeypatch.setattr(scores, "_NORMAL_CHUNK", 64)
    small = scores.normal(np.random.default_rng(5), (10, 100))
    assert small.dtype == np.float64
    assert np.array_equal(small, np.random.default_rng(5).standard_normal((10, 100)))
    big = scores.normal(np.random.default_rng(5), (3, 1001))
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    again = scores.normal(np.random.default_rng(5), (3, 1001))
    assert big.dtype == np.float32 and np.array_equal(big, again)
    assert abs(big.mean()) < 0.1 and 0.9 < big.std() < 1.1
    assert len(np.unique(big.reshape(-1)[: 64 * 40].reshape(40, 64), axis=0)) == 40  # no repeats


@pytest.fixture
def small_mapping(monkeypatch):
    """Arrays of 1 KiB and more travel through a mapped file (the parent decides)."""
    monkeypatch.setattr(mapped, "MAPPED_BYTES", 1024)


def test_mapped_inputs_written_by_a_kernel_are_caught(small_mapping) -> None:
    """Through the mapping the worker's writes stay private and the watch still sees them."""
    from attention_crossval.testing.broken.cpu_faults import FaultyAdapter

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, S, 2, 16)).astype(np.float16) for S in (20, 37, 37))
    case = AttentionCase(q, k, v)
    before = case.q.copy()
    worker = IsolatedKernel(f"{FAULTS}:writes_inputs", timeout_s=60.0)
    try:
        verdict = run_case(FaultyAdapter("writes_inputs"), case, isolated=worker)
    finally:
        worker.close()
    ((sent, file),) = mapped._last
    assert sent is case and file is not None  # it went through the mapping, written once
    assert [f.check for f in verdict.findings] == ["input-write"]
    assert "q: 1280 elements written" in verdict.findings[0].message
    assert np.array_equal(case.q, before)  # the parent's case is untouched
    mapped.release()
    assert not os.path.exists(file.path) and not mapped._last


def test_scaled_down_huge_decode_passes_through_the_mapped_path(small_mapping, tmp_path) -> None:
    """gpu-huge at 1/512 of its keys (the same heads, dims, distribution), as a long case
    (sampled rows), through an isolated CPU kernel fed by the mapping: it passes."""
    from attention_crossval.report.cache import ExactCache
    from attention_crossval.report.runner import Kernel, RunOptions, evaluate

    (config,) = preset("gpu-huge")
    small = dataclasses.replace(config, Sk=HUGE_KEYS // 512, name="huge-decode-scaled")
    worker = IsolatedKernel("attention_crossval.testing.broken.cpu_long:correct", timeout_s=120.0)
    try:
        options = RunOptions(rows=2, dense_limit=1 << 16, subset_rows=8)
        (record,) = evaluate(
            small, [Kernel("cpu-long", worker, worker)], options, ExactCache(tmp_path)
        )
    finally:
        worker.close()
    assert record["verdict"] == "pass", (record["message"], record["findings"])
    assert record["sampling"]["rows"] <= 16
    assert not mapped._last  # the report released the case's file
