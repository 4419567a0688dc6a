"""benchmarks/timing.py (the checkout's benchmark clock) against a stub ``triton.testing``.

The benchmarks are scripts of the checkout, not of the installed package, so the module is
loaded from its file beside ``properties/``; an installed copy without it skips, saying so.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest

TIMING = Path(__file__).resolve().parents[2] / "benchmarks" / "timing.py"
pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not TIMING.is_file(), reason=f"{TIMING} is not in this installation"),
]


@pytest.fixture
def timing(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The module, with ``triton.testing`` replaced by a stub recording which clock ran: 2 ms
    by ``do_bench``, 1 ms by ``do_bench_cudagraph``, which raises when ``capture_fails``."""
    calls: list[tuple[str, dict]] = []
    state = types.SimpleNamespace(calls=calls, capture_fails=False)

    def do_bench(fn, **kwargs) -> float:
        calls.append(("stream", kwargs))
        return 2.0

    def do_bench_cudagraph(fn, **kwargs) -> float:
        calls.append(("graph", kwargs))
        if state.capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 1.0

    testing = types.ModuleType("triton.testing")
    testing.do_bench, testing.do_bench_cudagraph = do_bench, do_bench_cudagraph
    triton = types.ModuleType("triton")
    triton.testing = testing
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.testing", testing)
    spec = importlib.util.spec_from_file_location("bench_timing_under_test", TIMING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    state.tflops = module.tflops
    return state


def test_graph_clock_times_graph_replays(timing: types.SimpleNamespace) -> None:
    """``graph=True`` times CUDA-graph replays by their median; the default clock is the
    stream's ``do_bench`` median; both after one untimed call (the compile)."""
    ran = []
    assert timing.tflops(4e12, lambda: ran.append(1), graph=True, rep=50) == 4000.0
    assert timing.calls == [("graph", {"rep": 50, "return_mode": "median"})]
    assert timing.tflops(4e12, lambda: ran.append(1)) == 2000.0
    assert timing.calls[1] == ("stream", {"warmup": 25, "rep": 100, "return_mode": "median"})
    assert ran == [1, 1]


def test_graph_clock_falls_back_to_the_stream_clock(
    timing: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call that cannot be captured in a graph is timed on the stream, and says so."""
    timing.capture_fails = True

    def kernel() -> None:
        pass

    assert timing.tflops(4e12, kernel, graph=True) == 2000.0
    assert [clock for clock, _ in timing.calls] == ["graph", "stream"]
    assert "kernel: no CUDA graph" in capsys.readouterr().err


def test_a_failing_call_is_nan_with_its_traceback(
    timing: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernel that raises gives NaN (its table cell) and its traceback, timing nothing."""

    def broken() -> None:
        raise ValueError("bad launch")

    assert math.isnan(timing.tflops(1.0, broken, graph=True))
    assert timing.calls == []
    err = capsys.readouterr().err
    assert "broken failed" in err and "ValueError: bad launch" in err


def test_host_clock_times_the_issue_of_calls_without_waiting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``host_us_per_call``: one untimed call, then ``calls`` calls issued in a row with the
    GPU synchronized only before and after them (a stub ``torch`` records the order), as
    microseconds per call; a call that raises gives NaN and its traceback."""
    events: list[str] = []
    cuda = types.SimpleNamespace(synchronize=lambda: events.append("sync"))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    spec = importlib.util.spec_from_file_location("bench_timing_host", TIMING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    us = module.host_us_per_call(lambda: events.append("call"), calls=5)
    assert events == ["call", "sync", *["call"] * 5, "sync"]
    assert 0 < us < 1e6

    def broken() -> None:
        raise ValueError("bad launch")

    assert math.isnan(module.host_us_per_call(broken))
    assert "ValueError: bad launch" in capsys.readouterr().err
