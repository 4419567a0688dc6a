"""Known findings (kernel/contract/known_findings.py): a declared divergence keeps its cases in
scope and
shows as "known" (report) or xfail (pytest), never as a pass and never hiding another failure.
The strict-xfail test per known finding is in test_known_strict.py; it is exercised here through
pytest itself, with the CPU divergent adapters of testing/broken/cpu_known.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_crossval
from attention_crossval.kernel.contract.known_findings import (
    KnownFinding,
    backward_trigger_case,
    trigger_case,
)
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.backward import run_backward_case
from attention_crossval.kernel.harness.forward import fill_padding, run_case
from attention_crossval.kernel.harness.hidden_nan import hidden_nan_findings, masked_hidden_keys
from attention_crossval.kernel.harness.known import (
    covering,
    run_backward_with_known,
    run_with_known,
    xfail_if_known,
)
from attention_crossval.kernel.harness.registry import GPU_BUILTIN, resolve
from attention_crossval.kernel.harness.verdict import CheckFailed, Finding
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.report.configs import Config
from attention_crossval.report.runner import Kernel, RunOptions
from attention_crossval.report.session import run_report
from attention_crossval.testing.mutants_surface import load_surface_mutant

pytestmark = pytest.mark.cpu

CPU_KNOWN = "attention_crossval.testing.broken.cpu_known"
PLUGIN = "attention_crossval.pytest_plugin"
LINK = "https://github.com/pytorch/pytorch"


# The peers' divergences, once hidden by narrower declarations (docs/usage.md, "Known findings"):
# (check, mask kinds, features), each as docs/results-h200.md records it. Backward ones are
# named "backward <check>".
_NAN = ("padding-read", {"varlen"}, set())
_NAN_BACKWARD = ("backward padding-read", {"varlen"}, set())
_PAGE_TAIL = ("padding-read", set(), {"paged"})  # pages of 128 keys
_HIDING = {"explicit", "window", "varlen"}
# flash-attn-cute: window-hidden keys read; a dominant sink overflows
_FA_SURFACE = [("hidden-nan", {"window"}, set()), ("nonfinite", set(), {"sink"})]
# flash-attn-cute: paged KV at D = 96 gives a wrong, nondeterministic O
_PAGED_D96 = [(check, set(), {"paged"}) for check in ("determinism", "bound", "lse")]
DECLARED = {
    "sdpa-math": [_NAN, _NAN_BACKWARD],
    "sdpa-efficient": [_NAN, _NAN_BACKWARD],
    "sdpa-cudnn": [
        ("empty-rows", _HIDING, set()),
        _NAN,
        ("backward zero-grad", _HIDING, set()),
        ("backward nonfinite", _HIDING, set()),
        _NAN_BACKWARD,
    ],
    "flash-attn-cute": [_NAN, _PAGE_TAIL, *_PAGED_D96, *_FA_SURFACE, _NAN_BACKWARD],
    "flash-attn-cute-deterministic": [
        _NAN,
        _PAGE_TAIL,
        *_PAGED_D96,
        *_FA_SURFACE,
        _NAN_BACKWARD,
    ],
    # hidden keys read under explicit masks and under windows
    "flex-attention": [
        _NAN,
        ("hidden-nan", {"explicit"}, set()),
        ("hidden-nan", {"window"}, set()),
    ],
}


@pytest.mark.parametrize("name", GPU_BUILTIN)
def test_builtin_known_findings_are_declared_and_triggerable(name: str) -> None:
    """Each peer declares its known finding with the cases back in scope, and the trigger case
    lies inside the declaration and under the finding (else the strict test would skip)."""
    adapter = resolve(name)
    spec = adapter.spec
    declared = [(k.name, set(k.mask_kinds), set(k.features)) for k in spec.known_findings]
    assert declared == DECLARED.get(name, []), declared
    for known in spec.known_findings:
        assert known.mask_kinds <= spec.mask_kinds and known.features <= spec.surface_features
        checks = adapter.backward_checks if known.backward else adapter.checks
        always_on = ("empty-rows", "zero-grad", "bound", "lse")  # the reference checks
        assert known.check in checks or known.check in always_on
        case = trigger_case(spec, known)
        assert spec.unsupported(case) is None
        assert known.applies(case)


@pytest.mark.parametrize("name", GPU_BUILTIN)
def test_builtin_backward_chains_are_the_measured_ones(name: str) -> None:
    """The chains measured on the H200 (their errors fit these chains' bounds, not
    FlashAttention's): sdpa-efficient forms dS from the 16-bit P; sdpa-flash and sdpa-cudnn
    round dk/dv per query head before the GQA sum; sdpa-efficient and sdpa-cudnn round the
    scaled dS; sdpa-cudnn flushes a subnormal dS to zero."""
    spec = resolve(name).spec
    if not spec.backward:
        pytest.skip(f"{name} declares no backward")
    chains = [spec.backward_precision_for(dtype) for dtype in sorted(spec.dtypes)]
    half = [c for c in chains if c.p_dtype is not None]
    assert all(c.ds_from_rounded_p == (name == "sdpa-efficient") for c in half), chains
    per_head, scaled = (
        name in ("sdpa-flash", "sdpa-cudnn"),
        name in ("sdpa-efficient", "sdpa-cudnn"),
    )
    assert all(c.dkv_rounded_per_head == per_head for c in half), chains
    assert all(c.ds_scaled == scaled for c in half), chains
    assert all(c.ds_flushes_subnormals == (name == "sdpa-cudnn") for c in half), chains


KNOWN = KnownFinding("padding-read", frozenset({"varlen"}), "reads padding", LINK)

BAD_KNOWN: list[tuple[dict[str, Any], str]] = [
    ({"check": "bounds"}, "known_finding.check='bounds' must be one of"),
    ({"mask_kinds": "varlen"}, "known_finding.mask_kinds='varlen' must be a set"),
    ({"mask_kinds": {3}}, "known_finding.mask_kinds={3} must be a set of mask kind names"),
    ({"reason": " "}, "known_finding.reason=' ' must be a non-empty str"),
    ({"link": "github.com/x"}, "known_finding.link='github.com/x' must be an https:// URL"),
    ({"features": "paged"}, "known_finding.features='paged' must be a set of names from"),
    ({"features": {"page_size"}}, "known_finding.features={'page_size'} must be a set of names"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_KNOWN)
def test_known_finding_rejects_bad_fields(overrides: dict[str, Any], message: str) -> None:
    fields = {"check": "padding-read", "mask_kinds": {"varlen"}, "reason": "r", "link": LINK}
    with pytest.raises(ValueError, match=re.escape(message)):
        KnownFinding(**{**fields, **overrides})


@pytest.mark.parametrize(
    ("known", "message"),
    [
        ([KNOWN], "spec.known_findings=[KnownFinding("),
        ((KNOWN, "padding-read"), "must be a tuple of KnownFinding"),
        ((KNOWN,), "spec.known_findings[0].mask_kinds=['varlen'] must be a subset of"),
        (
            (KnownFinding("padding-read", frozenset(), "r", LINK, features=frozenset({"paged"})),),
            "spec.known_findings[0].features=['paged'] must be features the spec declares ([]",
        ),
    ],
)
def test_spec_rejects_bad_known_findings(known: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        KernelSpec(name="k", mask_kinds=frozenset({"causal"}), known_findings=known)


def _case(mask: Mask) -> AttentionCase:
    q, k, v = (np.ones((1, 4, 1, 8), dtype=np.float16) for _ in range(3))
    return AttentionCase(q, k, v, mask=mask)


def test_covering_needs_every_finding_known_on_that_case() -> None:
    empty = KnownFinding("empty-rows", frozenset({"explicit"}), "nonzero hidden rows", LINK)
    spec = KernelSpec(
        name="k", mask_kinds=frozenset({"varlen", "explicit"}), known_findings=(KNOWN, empty)
    )
    varlen, plain = _case(Mask(k_lengths=(2,))), _case(Mask())
    padding, bound = Finding("padding-read", "m"), Finding("bound", "m")
    assert covering(spec, varlen, [padding]) == (KNOWN,)
    assert covering(spec, varlen, [padding, padding]) == (KNOWN,)
    assert covering(spec, varlen, []) == ()  # nothing failed: a pass, not a known finding
    assert covering(spec, varlen, [padding, bound]) == ()  # bound is not known: a failure
    assert covering(spec, plain, [padding]) == ()  # no varlen mask: the finding does not apply
    assert covering(spec, varlen, [Finding("empty-rows", "m")]) == ()  # not an explicit mask


def test_features_narrow_a_known_finding_to_cases_with_them() -> None:
    """A finding with ``features`` applies only to cases that have all of them (and match its
    mask kinds), and says so in its ``when``."""
    paged = KnownFinding("padding-read", frozenset(), "r", LINK, features=frozenset({"paged"}))
    both = KnownFinding(
        "padding-read", frozenset({"varlen"}), "r", LINK, features={"paged", "softcap"}
    )
    spec = KernelSpec(
        name="k", mask_kinds={"varlen"}, paged=True, softcap=True, known_findings=(paged, both)
    )
    varlen = _case(Mask(k_lengths=(2,)))
    padding = Finding("padding-read", "m")
    assert covering(spec, varlen, [padding]) == ()  # not paged
    with_pages = dataclasses.replace(varlen, page_size=2)
    assert covering(spec, with_pages, [padding]) == (paged,)
    capped = dataclasses.replace(with_pages, softcap=5.0)
    assert covering(spec, capped, [padding]) == (paged, both)
    assert not both.applies(dataclasses.replace(capped, mask=Mask()))  # no varlen mask
    assert (paged.when, both.when) == ("paged cases", "varlen masks, paged and softcap cases")
    assert paged.to_dict()["when"] == "paged cases"


def _trigger(name: str) -> tuple[Any, AttentionCase]:
    adapter = resolve(f"{CPU_KNOWN}:{name}")
    return adapter, trigger_case(adapter.spec, adapter.spec.known_findings[0])


def test_known_empty_rows_xfails_in_pytest() -> None:
    adapter, case = _trigger("hidden_rows")
    verdict = run_with_known(adapter, case)
    assert [f.check for f in verdict.findings] == ["empty-rows"]
    with pytest.raises(pytest.xfail.Exception, match="^known empty-rows with explicit masks"):
        xfail_if_known(verdict, adapter.spec, case)


def test_known_padding_read_still_gets_every_other_check() -> None:
    """NaN padding blocks the reference checks; rerun on zero padding, a bug hiding behind a
    known padding-read (O scaled by 1 + 2^-4 on causal cases) is caught by ``bound``. Without
    the rerun the verdict would be all known: the demonstration that the rerun is needed."""
    adapter, case = _trigger("reads_padding")
    verdict = run_with_known(adapter, case)
    assert [f.check for f in verdict.findings] == ["padding-read"]
    assert np.isfinite(verdict.result.o).all()
    with pytest.raises(pytest.xfail.Exception):
        xfail_if_known(verdict, adapter.spec, case)

    wrong, trigger = _trigger("reads_padding_and_wrong")
    mask = Mask(causal=True, k_lengths=trigger.mask.k_lengths)  # the bug is on causal cases
    case = AttentionCase(trigger.q, trigger.k, trigger.v, mask=mask)
    blocked = run_case(wrong, case)
    assert covering(wrong.spec, case, blocked.findings)  # the bug hides behind the known one
    verdict = run_with_known(wrong, case)
    assert [f.check for f in verdict.findings] == ["bound", "padding-read"]
    xfail_if_known(verdict, wrong.spec, case)  # returns: not every failure is known
    with pytest.raises(CheckFailed, match="^bound:"):  # the failure leads with the unknown one
        verdict.raise_for()


CALL_OPTIONS = "attention_crossval.testing.broken.cpu_call_options"


def test_a_read_of_a_page_tail_is_a_padding_read_and_xfails_as_a_known_one() -> None:
    """The NaN that the paged layout puts in the unused tail of a last page is padding: a
    kernel that reads it (and weights it by 0) is classified ``padding-read`` (NaN in the page
    slots, finite with zeros there), not ``nonfinite``; the known finding of paged cases covers
    it; the rerun with zeros there still checks the bound, so the same kernel with a scaled O
    is caught. A case without pages runs clean."""
    adapter = resolve(f"{CALL_OPTIONS}:reads_page_tail")
    case = trigger_case(adapter.spec, adapter.spec.known_findings[0])
    assert case.page_size == adapter.spec.tile_n and case.k_length(0) % case.page_size
    assert [f.check for f in run_case(adapter, case).findings] == ["padding-read"]
    verdict = run_with_known(adapter, case)
    assert [f.check for f in verdict.findings] == ["padding-read"]
    with pytest.raises(pytest.xfail.Exception, match="^known padding-read with paged cases"):
        xfail_if_known(verdict, adapter.spec, case)
    run_case(adapter, dataclasses.replace(case, page_size=None)).raise_for()

    wrong = resolve(f"{CALL_OPTIONS}:reads_page_tail_and_wrong")
    verdict = run_with_known(wrong, case)
    assert [f.check for f in verdict.findings] == ["bound", "padding-read"]
    xfail_if_known(verdict, wrong.spec, case)  # returns: bound is not known
    with pytest.raises(CheckFailed, match="^bound:"):
        verdict.raise_for()


def test_a_known_padding_read_is_not_reported_again_as_hidden_nan() -> None:
    """The rerun of a known ``padding-read`` skips that check; the ``hidden-nan`` check then
    poisons only the keys a mask hides, not the padding the kernel is known to read (before,
    the known read came back as a ``hidden-nan`` failure), and still finds a hidden-key read."""
    adapter = resolve(f"{CPU_KNOWN}:reads_padding")
    adapter = dataclasses.replace(adapter, checks=adapter.checks | {"hidden-nan"})
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, S, 1, 16)).astype(np.float16) for S in (4, 20, 20))
    # a window over the last keys: the first 6 and 13 keys hidden, and batch 0 has padding
    case = AttentionCase(q, k, v, mask=Mask(causal=True, window_left=3, k_lengths=(13, 20)))
    assert masked_hidden_keys(case).any()
    verdict = run_with_known(adapter, case)
    assert [f.check for f in verdict.findings] == ["padding-read"]

    mutant = load_surface_mutant("hidden_v_read").streaming_attention  # reads hidden V, * 0

    def hidden_reader(which: AttentionCase) -> AttentionResult:
        with np.errstate(all="ignore"):
            return mutant(which, block_m=4, block_n=4)

    clean = fill_padding(case, 0.0)
    found = hidden_nan_findings(clean, hidden_reader(clean), hidden_reader, padding=False)
    assert [f.check for f in found] == ["hidden-nan"]


def test_known_zero_grad_reruns_without_the_hidden_rows_gradient() -> None:
    """A kernel that differentiates uniform attention on hidden rows (as sdpa-cudnn does) also
    breaks dq/dk/dv bounds on every key, so the known ``zero-grad`` alone could never cover the
    case; the rerun with dO = 0 on those rows leaves only the known finding, and a dv bug
    hiding behind it is still caught by ``dv-bound``."""
    adapter = resolve(f"{CPU_KNOWN}:hidden_rows")
    known = adapter.spec.known_findings[1]
    case = backward_trigger_case(adapter.spec, known)
    blocked = run_backward_case(adapter, case)
    assert {"zero-grad", "dk-bound", "dv-bound"} <= {f.check for f in blocked.findings}
    assert not covering(adapter.spec, case.forward, blocked.findings, backward=True)
    verdict = run_backward_with_known(adapter, case)
    assert [f.check for f in verdict.findings] == ["zero-grad"]
    with pytest.raises(pytest.xfail.Exception, match="^known backward zero-grad"):
        xfail_if_known(verdict, adapter.spec, case.forward, backward=True)

    wrong = resolve(f"{CPU_KNOWN}:hidden_rows_and_wrong")
    verdict = run_backward_with_known(wrong, case)
    assert [f.check for f in verdict.findings] == ["dv-bound", "zero-grad"]
    xfail_if_known(verdict, wrong.spec, case.forward, backward=True)  # returns: dv-bound is not
    with pytest.raises(CheckFailed, match="^dv-bound:"):  # not the known zero-grad first
        verdict.raise_for()


def test_report_calls_covered_records_known(tmp_path) -> None:
    """Verdict known (counted apart, listed with reason and link) only when every failed check
    is known and every tier pair passes; a case with another bug (causal) fails."""
    configs = [
        Config("bfloat16", 16, 20, 40, B=3, Hq=2, Hkv=1, mask="varlen"),
        Config("bfloat16", 16, 20, 40, B=3, Hq=2, Hkv=1, mask="varlen-causal"),
    ]
    kernels = [
        Kernel(name, resolve(f"{CPU_KNOWN}:{name}"))
        for name in ("reads_padding", "reads_padding_and_wrong")
    ]
    report = run_report(configs, kernels, RunOptions(rows=4), tmp_path, progress=False, html=False)
    verdicts = {(r["config"]["mask"], r["kernel"]["name"]): r["verdict"] for r in report["records"]}
    assert verdicts == {
        ("varlen", "reads_padding"): "known",
        ("varlen", "reads_padding_and_wrong"): "known",
        ("varlen-causal", "reads_padding"): "known",
        ("varlen-causal", "reads_padding_and_wrong"): "fail",
    }
    assert report["summary"]["verdicts"] == {"known": 3, "fail": 1}
    known = report["records"][0]
    assert known["findings"][0]["known"] is True
    assert known["known_findings"][0]["link"] == "https://example.com/upstream-issue"
    markdown = (tmp_path / "report.md").read_text()
    assert "## Known findings" in markdown
    assert "| reads_padding | padding-read | varlen masks |" in markdown
    assert "FAIL (padding-read (known))" in markdown


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytester's runs import the package (and its plugin) from where this copy lives."""
    root = str(Path(attention_crossval.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


def _outcomes(pytester: pytest.Pytester, *args: str) -> dict[str, int]:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", PLUGIN, *args)
    return result.parseoutcomes()


def test_a_fixed_known_finding_fails_the_strict_test(pytester: pytest.Pytester) -> None:
    """Through pytest itself: the strict test xfails on a kernel that still diverges and fails
    on one declaring the same finding without diverging (the upstream fix gets noticed)."""
    strict = "attention_crossval.properties.test_known_strict"
    kernels = ("--kernel", f"{CPU_KNOWN}:reads_padding", "--kernel", f"{CPU_KNOWN}:fixed")
    outcomes = _outcomes(pytester, "--pyargs", strict, "-rxX", *kernels)
    assert outcomes == {"xfailed": 1, "failed": 1}, outcomes


PROPERTY = """
import pytest
from hypothesis import assume, given, settings, strategies as st

from attention_crossval.kernel.harness.known import run_with_known, xfail_if_known
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.properties.strategies import attention_cases

@pytest.mark.cpu
@pytest.mark.parametrize("name", ["reads_padding", "reads_padding_and_wrong"])
@settings(max_examples=15, derandomize=True, database=None, deadline=None)
@given(data=st.data())
def test_property(name, data):
    adapter = resolve("attention_crossval.testing.broken.cpu_known:" + name)
    case = data.draw(attention_cases(spec=adapter.spec, max_len=33))
    verdict = run_with_known(adapter, case)
    assume(verdict.skipped is None)
    xfail_if_known(verdict, adapter.spec, case)
    verdict.raise_for()
"""


def test_known_cases_in_a_property_test_hide_no_other_bug(pytester: pytest.Pytester) -> None:
    """The call site in the kernel property suite: known cases are rejected, so a kernel failing
    only its known check passes and one with another bug (on causal cases) fails."""
    pytester.makepyfile(test_property=PROPERTY)
    outcomes = _outcomes(pytester, "-m", "cpu")
    assert outcomes == {"passed": 1, "failed": 1}, outcomes


def test_a_sweep_counts_known_cases_and_still_fails_on_another_bug(
    pytester: pytest.Pytester,
) -> None:
    """The kernel suite's feature sweep over paged cases: a kernel failing only its known
    page-tail read passes (its known cases count as run instead of being replaced), the same
    kernel with a scaled O fails."""
    kernels = [
        f"{CALL_OPTIONS}:{name}" for name in ("reads_page_tail", "reads_page_tail_and_wrong")
    ]
    args = [a for k in kernels for a in ("--kernel", k)]
    suite = "attention_crossval.properties.test_kernels"
    # Seeded: the sweep's two cases catch the scaled O only when one has a non-empty row (the
    # simplest case is an empty one); seed 1 draws such a case (seed 2 does not).
    options = (
        "-p",
        "no:cacheprovider",
        "-p",
        PLUGIN,
        "-m",
        "cpu",
        "-k",
        "feature and paged",
        "-rf",
    )
    options += ("--hypothesis-seed=1",)
    result = pytester.runpytest_subprocess(*options, "--pyargs", suite, *args)
    result.assert_outcomes(passed=1, failed=1, deselected=44)
    result.stdout.fnmatch_lines(
        ["*CheckFailed: bound:*", "FAILED *reads_page_tail_and_wrong-paged*"]
    )
