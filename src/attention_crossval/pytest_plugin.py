"""The pytest plugin (entry point ``pytest11``): options, markers, Hypothesis profiles, GPU skips,
and one ``FAILED <test id> <finding>`` line per failure, printed as it happens and at the end.

Installed with the package, so ``pytest --pyargs attention_crossval.properties -m kernel
--kernel mypkg.fa:adapter`` works from any directory. torch and CUDA are only touched inside
hooks, so ``pytest -m cpu`` collects on a machine with neither.

The plugin is a guest in every pytest session of an environment that installs the package, so
it acts on this package's own tests only: its Hypothesis profiles are namespaced
(``attention_crossval.<name>``) and loaded only while this package's test modules are imported
and its tests run, then the session's own profile is restored; its run seed reaches only its
own tests; BLAS is held to one thread around its tests (threadpoolctl), not through the
process's environment; GPUs are pinned per xdist worker only when its GPU tests were collected.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import importlib.util
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings
from threadpoolctl import threadpool_limits

from attention_crossval.kernel.harness.isolation import DEFAULT_TIMEOUT_S, check_timeout  # noqa: E402

# gpu_workers: one GPU per xdist worker; coverage: shape x mask x distribution x dtype tally;
# phase_timings: seconds per phase of each test (--phase-timings); long_tests: long_context
# tests only when asked for; kernels_under_test: the kernel workers closed at the session end
pytest_plugins = [
    "attention_crossval.kernel.harness.gpu_workers",
    "attention_crossval.properties.coverage",
    "attention_crossval.properties.phase_timings",
    "attention_crossval.properties.long_tests",
    "attention_crossval.properties.kernels_under_test",
]

MARKERS = {
    "cpu": "runs without a GPU (reference-only checks, and kernels declared device='cpu')",
    "gpu": "needs a CUDA GPU and torch; skipped with a reason otherwise",
    "kernel": "checks the kernel under test (--kernel); carries cpu or gpu by the kernel's device",
    "blackwell": "needs an SM100 (Blackwell) GPU; skipped elsewhere",
    "slow": "long-running checks (thorough runs)",
    "long_context": "long-context and huge-tensor GPU checks (minutes each): left out unless -m "
    "names long_context or their file is named (pytest -m long_context)",
    "backward": "checks the backward pass (dq, dk, dv); set on this package's backward test "
    "modules (properties/*backward*.py) by the plugin: -m backward runs them alone",
}

PROFILE_PREFIX = "attention_crossval."
PROFILE_ENV = "ATTENTION_CROSSVAL_PROFILE"
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
# No explain phase: it replays variants of the shrunk example and can leave a larger case as the
# one reported (measured: B=2, Sq=513 shown although a 1x1 case failed first).
_PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)


def _profile(**changes: object) -> settings:
    """A profile built on Hypothesis' ``default`` one (not on whatever profile is loaded when
    this module is imported: under CI that is Hypothesis' derandomized ``ci``)."""
    base = {"deadline": None, "suppress_health_check": _SLOW_OK, "phases": _PHASES}
    return settings(settings.get_profile("default"), **(base | changes))


PROFILES = {
    "dev": _profile(max_examples=25),
    # seeded per run instead of derandomized (run_seed): reproducible, yet new cases per commit
    "ci": _profile(max_examples=60, database=None, print_blob=True),
    "thorough": _profile(max_examples=2000),
    # a fixed-size load for throughput measurements (benchmarks/bench_multi_gpu.py)
    "soak": _profile(max_examples=100, derandomize=True, phases=tuple(Phase)),
    "debug": _profile(max_examples=10, verbosity=Verbosity.verbose),
    # Metered GPU time: the first failure of each test is reported as drawn, not shrunk (a shrink
    # step is a kernel call, often a new compile), so one run lists every failing feature.
    "triage": _profile(max_examples=25, phases=(Phase.explicit, Phase.reuse, Phase.generate)),
}
for _name, _settings in PROFILES.items():
    settings.register_profile(PROFILE_PREFIX + _name, _settings)

SEED_ENV = "ATTENTION_CROSSVAL_SEED"
# Profiles whose runs get one seed per run (a fixed, printed seed); the others draw a random seed
# per test, as Hypothesis does by default, unless --hypothesis-seed or $ATTENTION_CROSSVAL_SEED.
SEEDED_PROFILES = frozenset({"ci"})
_RUN_SEED = pytest.StashKey[tuple[int | None, str]]()
_PROFILE = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "attention_crossval_strict",
        type="bool",
        default=False,
        help="treat every collected test as this package's own: each must be marked cpu or gpu, "
        "and runs under its profile, seed and BLAS limit (its own tests always do)",
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
        "--attention-profile",
        default=None,
        choices=sorted(PROFILES),
        help="Hypothesis profile for this package's tests only (default: "
        "$ATTENTION_CROSSVAL_PROFILE, else ci when $CI is set, else dev); other tests keep the "
        "session's own profile",
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
    group.addoption(
        "--repro-dir",
        default=None,
        metavar="DIR",
        help="for each failing kernel test of this package, write a standalone reproducer "
        "folder (repro.py, case.npz, REPORT.md) under DIR (docs/repro.md)",
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


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    report_dir = config.getoption("--report-dir")
    if report_dir:  # where properties.replay saves failing cases (.npz)
        os.environ["ATTENTION_REPORT_DIR"] = str(report_dir)
    config.stash[_PROFILE] = _choose_profile(config)
    config.stash[_RUN_SEED] = _choose_run_seed(config, config.stash[_PROFILE])
    if not hasattr(config, "workerinput"):  # printed where the terminal is: xdist's controller
        config.pluginmanager.register(FailureLines(config), FailureLines.NAME)


def _choose_profile(config: pytest.Config) -> str:
    """--attention-profile, else $ATTENTION_CROSSVAL_PROFILE (or $HYPOTHESIS_PROFILE when it names
    one of ours), else ci under CI, else dev."""
    for chosen, where in (
        (config.getoption("--attention-profile"), "--attention-profile"),
        (os.environ.get(PROFILE_ENV), f"${PROFILE_ENV}"),
    ):
        if chosen:
            if chosen not in PROFILES:
                raise pytest.UsageError(f"{where}={chosen!r} must be one of {sorted(PROFILES)}")
            return chosen
    if os.environ.get("HYPOTHESIS_PROFILE") in PROFILES:
        return os.environ["HYPOTHESIS_PROFILE"]
    return "ci" if os.environ.get("CI") else "dev"


def profile_name(config: pytest.Config) -> str:
    """The short name of the profile this package's tests run under."""
    return config.stash[_PROFILE]


@contextlib.contextmanager
def own_profile(config: pytest.Config) -> Iterator[None]:
    """This package's profile loaded for the duration, the session's own restored after."""
    getter = getattr(settings, "get_current_profile_name", None)  # Hypothesis >= 6.106
    previous = getter() if getter else settings._current_profile
    settings.load_profile(PROFILE_PREFIX + profile_name(config))
    try:
        yield
    finally:
        settings.load_profile(previous)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """Import this package's test modules under its profile: ``@given`` and ``@settings`` take
    their defaults from the profile loaded when they run at import."""
    if isinstance(collector, pytest.Module) and _owns(collector.config, collector.path):
        with own_profile(collector.config):
            return (yield)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Run this package's tests under its profile, with BLAS on one thread (OpenBLAS with its
    default pool is far slower on the tiers' small GEMMs: docs/numerics.md, "Small GEMMs")."""
    if not _is_ours(item):
        return (yield)
    with own_profile(item.config), threadpool_limits(limits=1, user_api="blas"):
        return (yield)


def _choose_run_seed(config: pytest.Config, profile: str) -> tuple[int | None, str]:
    """``(seed, where it came from)``: --hypothesis-seed, else $ATTENTION_CROSSVAL_SEED, else
    (seeded profiles only) the git commit of the rootdir, else today's UTC date; None: random."""
    given = config.getoption("hypothesis_seed", None)
    if given is not None:
        return _as_seed(given, "--hypothesis-seed"), "--hypothesis-seed"
    if os.environ.get(SEED_ENV):
        return _as_seed(os.environ[SEED_ENV], SEED_ENV), f"${SEED_ENV}"
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


def pytest_itemcollected(item: pytest.Item) -> None:
    """This package's backward tests carry the ``backward`` marker (``-m backward``), set as each
    is collected, before ``-m`` deselects."""
    if item.path.parent == _tests_dir() and "backward" in item.path.stem:
        item.add_marker(pytest.mark.backward)


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the tests that will run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    own = [item for item in items if _is_ours(item)]
    unmarked = [
        item.nodeid for item in own if not ({"cpu", "gpu"} & {m.name for m in item.iter_markers()})
    ]
    if unmarked:
        raise pytest.UsageError(f"every test must be marked cpu or gpu; unmarked: {unmarked[:5]}")
    _seed_own_tests(config, own)
    if hasattr(config, "workerinput"):  # xdist hands tests out in the workers' order
        _longest_first(items, own)
    gpu_items = [item for item in own if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from attention_crossval.kernel.harness.gpu_workers import cuda_available, pin_worker_gpu

    pin_worker_gpu(config)  # before CUDA is first probed in this process
    has_cuda, reason = cuda_available()
    for item in gpu_items:
        if not has_cuda:
            item.add_marker(pytest.mark.skip(reason=f"gpu test skipped: {reason}"))
        elif item.get_closest_marker("blackwell") and not _is_blackwell():
            item.add_marker(pytest.mark.skip(reason="needs an SM100 (Blackwell) GPU; none here"))


# This package's tests by the time one takes (seconds to minutes on a GPU: the backward's
# exact tier and bounds, a kernel's compiles over every configuration it draws), longest first;
# the rest after them. Under xdist a long test that starts last ends the run late.
LONGEST_FIRST = (
    "test_kernel_backward_passes_every_check",
    "test_kernel_passes_every_check",
    "test_own_sm90_passes_every_check",
    "test_kernel_feature_passes_every_check",
    "test_kernel_sweep_passes_every_check",
)


def _longest_first(items: list[pytest.Item], own: list[pytest.Item]) -> None:
    """Reorder this package's tests longest first (:data:`LONGEST_FIRST`, otherwise as
    collected) within the places they hold in ``items``; other tests keep theirs."""
    if not own:
        return
    ours = {id(item) for item in own}
    places = [i for i, item in enumerate(items) if id(item) in ours]

    def rank(item: pytest.Item) -> int:
        name = getattr(item, "originalname", item.name)
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    for place, item in zip(places, sorted(own, key=rank), strict=True):
        items[place] = item


def _seed_own_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give this package's Hypothesis tests the run seed (``hypothesis.seed``), leaving other
    tests and derandomized ones alone (an explicit seed would override ``derandomize``)."""
    seed = run_seed(config)
    if seed is None or config.getoption("hypothesis_seed", None) is not None:
        return  # random per test, or Hypothesis' own --hypothesis-seed applies to every test
    for item in items:
        test = getattr(item, "obj", None)
        used = getattr(test, "_hypothesis_internal_use_settings", None)
        if getattr(test, "is_hypothesis_test", False) and not (used and used.derandomize):
            hypothesis.seed(seed)(test)


def _is_ours(item: pytest.Item) -> bool:
    """A test of this package's own suite (the checkout's properties/ or the installed copy), or
    any test where the ini option ``attention_crossval_strict`` is set: a user's own tests are
    never refused for lacking a cpu/gpu marker, nor run under this package's profile."""
    return _owns(item.config, item.path)


def _owns(config: pytest.Config, path: Path) -> bool:
    return path.parent == _tests_dir() or bool(config.getini("attention_crossval_strict"))


@functools.cache
def _tests_dir() -> Path:
    """Where this package's own tests live (the checkout's properties/, or the installed copy)."""
    return Path(importlib.util.find_spec("attention_crossval.properties").origin).resolve().parent


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """The run's settings, printed only in sessions that collected this package's tests (the
    GPU probe imports torch, which a guest must not do in other people's sessions)."""
    own = [item for item in items if _is_ours(item)]
    if not own:
        return []
    import mpmath

    from attention_crossval.kernel.harness.gpu_workers import cuda_available, worker_gpus_line

    wants_gpu = any(item.get_closest_marker("gpu") for item in own)
    gpu = cuda_available()[1] if wants_gpu else "not probed (no gpu test selected)"
    seed, source = config.stash[_RUN_SEED]
    shown = f"--hypothesis-seed={seed} ({source}; kernels get seeds derived from it)"
    lines = [
        f"numpy {np.__version__}, mpmath {mpmath.__version__} (backend {mpmath.libmp.BACKEND})",
        f"attention-crossval profile: {profile_name(config)} (--attention-profile, for its own "
        "tests only); BLAS on one thread in them",
        f"attention-crossval seed: {shown if seed is not None else source}",
        f"gpu: {gpu}",
    ]
    workers = worker_gpus_line(config) if wants_gpu else None
    return lines + ([workers] if workers else [])


# A failed report of this package's tests carries its one-line finding under this attribute. It
# is set where the exception is (an xdist worker), and the report takes it to the controller.
FINDING_ATTRIBUTE = "attention_crossval_finding"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.failed and call.excinfo is not None and _is_ours(item):
        setattr(report, FINDING_ATTRIBUTE, one_line_finding(call.excinfo.value))
        if item.config.getoption("--repro-dir") and item.get_closest_marker("kernel"):
            from attention_crossval.report.repro import write_reproducers

            text = write_reproducers(call.excinfo.value, item.config.getoption("--repro-dir"))
            if text:
                report.sections.append(("attention-crossval reproducers", text))
    return report


def one_line_finding(error: BaseException) -> str:
    """A failure in one line: a harness check's own first line (``bound: ...``), else the
    exception's type and its first line; of several (Hypothesis' distinct failures), the first."""
    from attention_crossval.kernel.harness.verdict import CheckFailed

    if isinstance(error, BaseExceptionGroup):
        more = len(error.exceptions) - 1
        return one_line_finding(error.exceptions[0]) + (f" (and {more} more)" if more else "")
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    if isinstance(error, CheckFailed):
        return first
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class FailureLines:
    """``FAILED <test id> <finding>`` for each failed test of this package, printed as soon as
    the test finishes and all again at the very end of the run: a quiet run that is cut short
    still shows what failed, and one that finishes ends with the list."""

    NAME = "attention_crossval.failure_lines"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.pending: list[str] = []
        self.printed: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        finding = getattr(report, FINDING_ATTRIBUTE, None)
        if finding is not None:
            outcome = "FAILED" if report.when == "call" else "ERROR"
            self.pending.append(f"{outcome} {report.nodeid} {finding}")

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self) -> None:
        """After the test's own status and progress, so that the line does not split them."""
        self._print_pending()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter):
        """Around pytest's summary: the list follows its short test summary."""
        result = yield
        self._print_pending()
        if self.printed:
            terminalreporter.write_sep("=", f"attention-crossval failures ({len(self.printed)})")
            for line in self.printed:
                terminalreporter.write_line(line, red=True)
        return result

    def _print_pending(self) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        for line in self.pending if reporter is not None else ():
            if reporter._tw.width_of_current_line:  # after the letters (-q) or the status (-v)
                reporter._tw.line()
            reporter.currentfspath = None  # the next result starts a line of its own
            reporter._tw.line(line, red=True)
        self.printed += self.pending
        self.pending.clear()
