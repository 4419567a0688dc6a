"""benchmarks/bench_gpu_phases.py: ``--stop-after`` interrupts pytest itself, so a run cut short
still ends in pytest's own summary and the phase table of the tests that finished."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(
        not (ROOT / "benchmarks" / "bench_gpu_phases.py").is_file(),
        reason="the benchmarks are not in this installation",
    ),
]


def test_stop_after_interrupts_pytest_and_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.bench_gpu_phases import run_pytest

    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(120)\n")
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    code, wall = run_pytest(
        ["-p", "no:cacheprovider", "-p", "no:xdist", "-q", "test_slow.py"],
        tmp_path / "phases.json",
        stop_after=10,
    )
    assert code == pytest.ExitCode.INTERRUPTED, f"pytest exited {code}, not interrupted"
    assert time.perf_counter() - start < 60, "the interrupted pytest did not stop"
    assert (tmp_path / "phases.json").is_file(), "the interrupted run wrote no phase timings"
    assert wall >= 10
