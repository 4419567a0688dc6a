"""pytest-xdist requires every worker to collect the same test ids in the same order; ids built
from sets or hashes of strings would differ between processes (each has its own hash seed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collect(hash_seed: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(ROOT / "src"))
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.cpu
def test_collection_is_identical_under_different_hash_seeds() -> None:
    runs = [_collect(seed) for seed in ("0", "4242")]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    ids = [[line for line in out.splitlines() if "::" in line] for out in outputs]
    assert all(run.returncode == 0 for run in runs), outputs[0][-2000:]
    assert len(ids[0]) > 500, outputs[0][-2000:]
    assert ids[0] == ids[1], sorted(set(ids[0]) ^ set(ids[1]))[:10]


@pytest.mark.cpu
def test_xdist_workers_get_this_packages_longest_tests_first() -> None:
    """In an xdist worker the package's tests are reordered by LONGEST_FIRST within the places
    they hold; a foreign test keeps its place and the order within a rank is collection's."""
    from types import SimpleNamespace

    from attention_crossval.pytest_plugin import LONGEST_FIRST, _longest_first

    def item(name: str) -> SimpleNamespace:
        return SimpleNamespace(originalname=name, name=f"{name}[x]")

    sweep, own, backward = (item(n) for n in LONGEST_FIRST[4::-2])
    other, foreign = item("test_bounds_hold"), item("test_theirs")
    items = [sweep, other, foreign, own, backward]
    _longest_first(items, [sweep, other, own, backward])
    assert items == [backward, own, foreign, sweep, other]
