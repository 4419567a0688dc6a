"""Honest, stable sampling: the run's seed, the coverage sweep, the bounded saving of cases.

* A seeded run (ci profile, ``--hypothesis-seed`` or ``$ATTENTION_CROSSVAL_SEED``) prints its
  seed and draws the same cases again from it; another seed draws others.
* ``coverage.sweep`` pairs put every score distribution and every declared mask kind in front
  of each kernel, and ``attention_cases(required_mask_kinds=...)`` really draws that kind.
* ``replay.save_failing_case`` keeps at most ``CASES_PER_TEST`` files per test, the last always.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import MASK_KINDS, KernelSpec
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.properties import replay
from attention_crossval.properties.coverage import coverage_key, sweep
from attention_crossval.properties.strategies import (
    DISTRIBUTIONS,
    REFERENCE_SPEC,
    attention_cases,
)
from attention_crossval.pytest_plugin import (
    PROFILE_PREFIX,
    SEED_ENV,
    SEEDED_PROFILES,
    _choose_run_seed,
    _git_head,
    derived_seed,
)
from attention_crossval.testing.mutants import MUTANTS, trigger_case

pytestmark = pytest.mark.cpu

SPECS = {
    "reference": REFERENCE_SPEC,
    "streaming-fa": resolve("streaming-fa").spec,
    "causal-only": KernelSpec(name="causal-only", mask_kinds=frozenset({"causal"})),
    "no-masks": KernelSpec(name="no-masks", mask_kinds=frozenset()),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_sweep_covers_every_distribution_and_declared_mask_kind(name: str) -> None:
    spec = SPECS[name]
    pairs = sweep(spec)
    allowed = {
        n
        for n, d in DISTRIBUTIONS.items()
        if "varlen" in spec.mask_kinds or not d.needs_key_padding
    }
    assert [d for d, _ in pairs] == [d for d in DISTRIBUTIONS if d in allowed]
    assert {k for _, k in pairs} == (set(spec.mask_kinds) or {"none"})


@settings(max_examples=30)
@given(data=st.data())
def test_required_mask_kind_and_distribution_are_drawn(data: st.DataObject) -> None:
    """Every sweep pair's strategy draws its distribution and its mask kind (others may join)."""
    spec = SPECS["streaming-fa"]
    distribution, kind = data.draw(st.sampled_from(sweep(spec)))
    case = data.draw(
        attention_cases(
            spec=spec, max_len=65, distributions=[distribution], required_mask_kinds=[kind]
        )
    )
    assert coverage_key(case)[2] == distribution and kind in case.mask.kinds, case.describe()


def test_required_mask_kinds_must_be_declared() -> None:
    with pytest.raises(ValueError, match="required_mask_kinds="):
        attention_cases(spec=SPECS["causal-only"], required_mask_kinds=["varlen"])
    assert set(MASK_KINDS) == set(REFERENCE_SPEC.mask_kinds)


def test_saving_keeps_the_first_cases_and_always_the_last(tmp_path) -> None:
    distinct = [trigger_case(name, block_n=8) for name in MUTANTS]  # 7 different cases
    assert len({replay.save_case(c, tmp_path / "probe") for c in distinct}) == len(distinct)
    assert len(distinct) > replay.CASES_PER_TEST + 1
    paths = [replay.save_failing_case(c, tmp_path, test="t") for c in distinct]
    kept = sorted(p.name for p in tmp_path.glob("*.npz"))
    expected = [*paths[: replay.CASES_PER_TEST - 1], paths[-1]]
    assert kept == sorted(p.name for p in expected)
    other = replay.save_failing_case(distinct[0], tmp_path, test="another test")
    replay.save_failing_case(distinct[1], tmp_path, test="t")
    assert other.exists()  # shared with another test: never deleted


class _Options:
    """The two options the run seed reads, as a pytest config answers them."""

    def __init__(self, rootpath, **options: str | None) -> None:
        self.rootpath, self.options = rootpath, options

    def getoption(self, name: str, default: object = None) -> object:
        return self.options.get(name, default)


def test_run_seed_comes_from_the_option_env_commit_or_date(pytestconfig, tmp_path, monkeypatch):
    monkeypatch.delenv(SEED_ENV, raising=False)
    assert _choose_run_seed(_Options(tmp_path, hypothesis_seed="5"), "ci") == (
        5,
        "--hypothesis-seed",
    )
    seed, source = _choose_run_seed(_Options(tmp_path), "ci")  # tmp_path: no git work tree
    assert source.startswith("UTC date ") and str(seed) == source.split()[2]
    assert _choose_run_seed(_Options(tmp_path), "dev")[0] is None
    commit = _git_head(pytestconfig.rootpath)
    if commit is not None:  # a checkout: the commit decides
        assert _choose_run_seed(_Options(pytestconfig.rootpath), "ci") == (
            int(commit[:12], 16),
            f"git commit {commit[:12]}",
        )
    monkeypatch.setenv(SEED_ENV, "11")
    assert _choose_run_seed(_Options(tmp_path), "dev")[0] == 11


@pytest.mark.parametrize("profile", ["dev", "ci", "thorough", "debug"])
def test_profiles_report_the_shrunk_case(profile: str) -> None:
    """No explain phase: it replayed variants of the shrunk case and left a larger one (B=2,
    Sq=513) as the reported failure although a 1x1 case had failed first."""
    phases = settings.get_profile(PROFILE_PREFIX + profile).phases
    assert Phase.shrink in phases and Phase.explain not in phases


def test_ci_profile_is_seeded_not_derandomized() -> None:
    ci = settings.get_profile(PROFILE_PREFIX + "ci")
    assert not ci.derandomize and ci.database is None and "ci" in SEEDED_PROFILES


def test_kernels_get_different_reproducible_seeds() -> None:
    assert derived_seed(7, "a") == derived_seed(7, "a") != derived_seed(7, "b")
    assert derived_seed(7, "a") != derived_seed(8, "a")


DRAWS = """
import json, os
import pytest
from hypothesis import given, strategies as st

pytestmark = pytest.mark.cpu
seen = {"a": [], "b": []}

@given(st.integers(0, 10**9))
def test_draw_a(x):
    seen["a"].append(x)

@given(st.integers(0, 10**9))
def test_draw_b(x):
    seen["b"].append(x)

def test_zz_dump():
    with open(os.environ["DRAWS_OUT"], "w") as out:
        json.dump(seen, out)
"""


def _draws(pytester: pytest.Pytester, *args: str) -> tuple[dict[str, list[int]], str]:
    out = pytester.path / "draws.json"
    pytester.makepyfile(test_draws=DRAWS)
    pytester.makeini("[pytest]\nattention_crossval_strict = true\n")  # these tests as the package's
    plugin = ("-p", "attention_crossval.pytest_plugin")
    result = pytester.runpytest_subprocess(*plugin, "-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=3)
    header = next(line for line in result.outlines if line.startswith("attention-crossval seed: "))
    return json.loads(out.read_text()), header


def test_a_seeded_run_prints_its_seed_and_repeats_its_cases(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tests of one seeded run draw the same values (the seed decides); another seed, given
    through the environment, draws others."""
    monkeypatch.setenv("DRAWS_OUT", str(pytester.path / "draws.json"))
    monkeypatch.setenv("CI", "true")
    checkout = str(Path(__file__).resolve().parents[2] / "src")  # src/: importable uninstalled too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")]))
    seven, header = _draws(pytester, "--hypothesis-seed=7")
    assert header.startswith("attention-crossval seed: --hypothesis-seed=7 (--hypothesis-seed;")
    assert seven["a"] == seven["b"] and len(seven["a"]) > 1
    monkeypatch.setenv(SEED_ENV, "8")
    eight, header = _draws(pytester)
    assert header.startswith(f"attention-crossval seed: --hypothesis-seed=8 (${SEED_ENV};")
    assert eight["a"] != seven["a"]
