"""The pytest plugin (entry point ``pytest11``): options, markers, Hypothesis profiles, GPU skips.

Installed with the package, so ``pytest --pyargs attention_crossval.properties -m kernel
--kernel mypkg.fa:adapter`` works from any directory. torch and CUDA are only touched inside
hooks, so ``pytest -m cpu`` collects on a machine with neither.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import importlib.util
import os
import subprocess

# OpenBLAS with its default thread count is ~750x slower on small GEMMs on a 2-core VM; this must
# happen before numpy is imported anywhere (docs/numerics.md, "Small GEMMs").
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, Verbosity, settings  # noqa: E402

from attention_crossval.kernel.isolation import DEFAULT_TIMEOUT_S, check_timeout  # noqa: E402

# gpu_workers: one GPU per xdist worker; coverage: shape x mask x distribution x dtype tally
pytest_plugins = ["attention_crossval.kernel.gpu_workers", "attention_crossval.properties.coverage"]

MARKERS = {
    "cpu": "runs without a GPU (reference-only checks, and kernels declared device='cpu')",
    "gpu": "needs a CUDA GPU and torch; skipped with a reason otherwise",
    "kernel": "checks the kernel under test (--kernel); carries cpu or gpu by the kernel's device",
    "blackwell": "needs an SM100 (Blackwell) GPU; skipped elsewhere",
    "slow": "long-running checks (thorough runs)",
}

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
# No explain phase: it replays variants of the shrunk example and can leave a larger case as the
# one reported (measured: B=2, Sq=513 shown although a 1x1 case failed first).
_PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)
settings.register_profile(
    "dev", max_examples=25, deadline=None, suppress_health_check=_SLOW_OK, phases=_PHASES
)
settings.register_profile(
    "ci",
    parent=settings.get_profile("ci"),  # Hypothesis' own: no database, print_blob
    max_examples=60,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    phases=_PHASES,
    derandomize=False,  # seeded per run instead (run_seed): reproducible, yet new cases per commit
)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=_SLOW_OK, phases=_PHASES
)
# A fixed-size load for throughput measurements (benchmarks/bench_multi_gpu.py).
settings.register_profile(
    "soak", max_examples=100, deadline=None, suppress_health_check=_SLOW_OK, derandomize=True
)
settings.register_profile(
    "debug",
    max_examples=10,
    deadline=None,
    verbosity=Verbosity.verbose,
    suppress_health_check=_SLOW_OK,
    phases=_PHASES,
)
# Metered GPU time: the first failure of each test is reported as drawn, not shrunk (a shrink
# step is a kernel call, often a new compile), so one run lists every failing feature.
settings.register_profile(
    "triage",
    max_examples=25,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

SEED_ENV = "ATTENTION_CROSSVAL_SEED"
# Profiles whose runs get one seed per run (a fixed, printed seed); the others draw a random seed
# per test, as Hypothesis does by default, unless --hypothesis-seed or $ATTENTION_CROSSVAL_SEED.
SEEDED_PROFILES = frozenset({"ci"})
_RUN_SEED = pytest.StashKey[tuple[int | None, str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "attention_crossval_strict",
        type="bool",
        default=False,
        help="refuse every collected test not marked cpu or gpu (this package's own tests always)",
    )
    group = parser.getgroup("attention", "attention kernel cross-validation")
    group.addoption(
        "--kernel",
        action="append",
        default=[],
        metavar="NAME_OR_PATH",
        help="kernel under test for kernel-marked tests: a built-in name (see `attention-report "
        "--list-kernels`) or a dotted path package.module:attr; repeatable",
    )
    group.addoption(
        "--kernel-timeout",
        type=_kernel_timeout,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"seconds per kernel call in its worker process (default {DEFAULT_TIMEOUT_S:g}), "
        "as attention-report's --kernel-timeout: a call past it is a timeout finding and the "
        "worker is killed",
    )
    group.addoption(
        "--report-dir",
        default=None,
        metavar="DIR",
        help="write failing cases (.npz) and per-test error reports here",
    )


def _kernel_timeout(text: str) -> float:
    """``--kernel-timeout``'s value, under the isolation's own rule for a time limit."""
    try:
        value: object = float(text)
    except ValueError:
        value = text  # not a number: check_timeout names the rule
    try:
        return check_timeout("--kernel-timeout", value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@pytest.hookimpl(tryfirst=True)  # before Hypothesis' own hook reads --hypothesis-seed
def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    report_dir = config.getoption("--report-dir")
    if report_dir:  # where properties.replay saves failing cases (.npz)
        os.environ["ATTENTION_REPORT_DIR"] = str(report_dir)
    seed, source = _choose_run_seed(config)
    config.stash[_RUN_SEED] = (seed, source)
    if seed is not None and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(seed)  # Hypothesis' plugin sets its global seed


def _choose_run_seed(config: pytest.Config) -> tuple[int | None, str]:
    """``(seed, where it came from)``: --hypothesis-seed, else $ATTENTION_CROSSVAL_SEED, else
    (seeded profiles only) the git commit of the rootdir, else today's UTC date; None: random."""
    given = config.getoption("hypothesis_seed", None)
    if given is not None:
        return _as_seed(given, "--hypothesis-seed"), "--hypothesis-seed"
    if os.environ.get(SEED_ENV):
        return _as_seed(os.environ[SEED_ENV], SEED_ENV), f"${SEED_ENV}"
    profile = config.getoption("hypothesis_profile", None) or settings.get_current_profile_name()
    if profile not in SEEDED_PROFILES:
        return None, f"random per test ({profile} profile)"
    commit = _git_head(config.rootpath)
    if commit is not None:
        return int(commit[:12], 16), f"git commit {commit[:12]}"
    today = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    return int(today), f"UTC date {today} (no git commit found)"


def _as_seed(value: str, where: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{where}={value!r} must be an integer seed") from None


def _git_head(directory: Path) -> str | None:
    """The commit checked out at ``directory``, or None outside a git work tree (or no git)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) == 40 else None


def run_seed(config: pytest.Config) -> int | None:
    """This run's Hypothesis seed (None: a random seed per test)."""
    return config.stash[_RUN_SEED][0]


def kernel_seed(config: pytest.Config, kernel: str) -> int | None:
    """A seed for ``kernel``'s tests (:func:`derived_seed` of the run seed), or None (random)."""
    seed = run_seed(config)
    return None if seed is None else derived_seed(seed, kernel)


def derived_seed(seed: int, kernel: str) -> int:
    """A 64-bit seed from a run seed and a kernel's name: kernels explore different cases in one
    run, and the same run seed gives each kernel the same cases again."""
    digest = hashlib.sha256(f"{seed}:{kernel}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _is_blackwell() -> bool:
    import torch

    return torch.cuda.get_device_capability()[0] == 10


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _is_ours(item)]
    unmarked = [
        item.nodeid for item in ours if not ({"cpu", "gpu"} & {m.name for m in item.iter_markers()})
    ]
    if unmarked:
        raise pytest.UsageError(f"every test must be marked cpu or gpu; unmarked: {unmarked[:5]}")
    from attention_crossval.kernel.gpu_workers import cuda_available

    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    has_cuda, reason = cuda_available()
    for item in gpu_items:
        if not has_cuda:
            item.add_marker(pytest.mark.skip(reason=f"gpu test skipped: {reason}"))
        elif item.get_closest_marker("blackwell") and not _is_blackwell():
            item.add_marker(pytest.mark.skip(reason="needs an SM100 (Blackwell) GPU; none here"))


def _is_ours(item: pytest.Item) -> bool:
    """Tests of this package, or every test where the ini option ``attention_crossval_strict``
    is set: a user's own unrelated tests are never refused for lacking a cpu/gpu marker."""
    return item.path.parent == _tests_dir() or bool(item.config.getini("attention_crossval_strict"))


@functools.cache
def _tests_dir() -> Path:
    """Where this package's own tests live (the checkout's properties/, or the installed copy)."""
    return Path(importlib.util.find_spec("attention_crossval.properties").origin).resolve().parent


def pytest_report_header(config: pytest.Config) -> list[str]:
    import mpmath

    from attention_crossval.kernel.gpu_workers import cuda_available

    has_cuda, gpu = (
        cuda_available() if config.getoption("-m") != "cpu" else (False, "not probed (-m cpu)")
    )
    profile = settings.get_current_profile_name()
    seed, source = config.stash[_RUN_SEED]
    shown = f"--hypothesis-seed={seed} ({source}; kernels get seeds derived from it)"
    return [
        f"numpy {np.__version__}, mpmath {mpmath.__version__} (backend {mpmath.libmp.BACKEND})",
        f"hypothesis profile: {profile}; OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}",
        f"hypothesis seed: {shown if seed is not None else source}",
        f"gpu: {gpu}",
    ]
