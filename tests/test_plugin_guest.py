"""The plugin is a guest: a user's own property tests run exactly as they would without it.

Installing the package registers its pytest11 plugin in every session of that environment,
the kernel author's own repository included. A foreign test records what it sees (the
Hypothesis profile and its settings, the forced seed, the BLAS thread pool, the environment
variables the plugin once set) in a session without the plugin and in one with it; the records
must be equal, with and without CI set and under ``pytest -n 2``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

PLUGIN = "attention_crossval.pytest_plugin"
ROOT = Path(__file__).resolve().parents[1]

FOREIGN_TEST = """
import json, os
from pathlib import Path

import hypothesis
import numpy  # loaded in both sessions, so that the BLAS pool is there to be seen
from hypothesis import given, settings, strategies as st
from threadpoolctl import threadpool_info


@settings(max_examples=3)
@given(st.integers())
def test_foreign_property(x):
    pass


def test_record(worker_id):
    current = getattr(settings, "get_current_profile_name", lambda: settings._current_profile)
    default = settings.default
    seen = {
        "profile": current(),
        "max_examples": default.max_examples,
        "deadline": str(default.deadline),
        "derandomize": default.derandomize,
        "database": type(default.database).__name__,
        "phases": [p.name for p in default.phases],
        "decorated": test_foreign_property._hypothesis_internal_use_settings.max_examples,
        "forced_seed": hypothesis.core.global_force_seed,
        "own_seed": getattr(test_foreign_property, "_hypothesis_internal_use_seed", None),
        "blas": sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}),
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                                               "ATTENTION_REPORT_DIR")},
    }
    Path(os.environ["GUEST_RECORD"]).write_text(json.dumps(seen, sort_keys=True))
"""


def _record(pytester: pytest.Pytester, plugin: bool, *args: str) -> dict:
    out = pytester.path / f"record-{plugin}-{'-'.join(args) or 'plain'}.json"
    os.environ["GUEST_RECORD"] = str(out)
    load = ("-p", PLUGIN) if plugin else ("-p", f"no:{PLUGIN}")
    result = pytester.runpytest_subprocess(*load, "-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=2)
    return json.loads(out.read_text())


@pytest.mark.parametrize("ci", [False, True], ids=["local", "CI"])
@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "n2"])
def test_a_foreign_test_session_is_unchanged(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: bool, xdist: bool
) -> None:
    for name in ("CI", "HYPOTHESIS_PROFILE", "OPENBLAS_NUM_THREADS", "ATTENTION_CROSSVAL_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    if ci:
        monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    )
    pytester.makepyfile(test_foreign=FOREIGN_TEST)
    args = ("-n", "2", "-p", "xdist") if xdist else ()
    without = _record(pytester, False, *args)
    with_plugin = _record(pytester, True, *args)
    assert with_plugin == without
    assert without["env"] == {
        "OPENBLAS_NUM_THREADS": None,
        "CUDA_VISIBLE_DEVICES": "5,7",
        "ATTENTION_REPORT_DIR": None,
    }
