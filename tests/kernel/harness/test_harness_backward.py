"""The backward harness (kernel/harness/backward.py) on CPU kernels: each deliberately broken
backward (``testing/broken/cpu_backward_faults.py``) is caught by exactly its named checks, the
correct one passes; overflow, triage, determinism, the isolated worker, padding, the float64
references and the spec's backward declarations."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import find

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.backward import (
    fill_backward_padding,
    run_backward_case,
)
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.references_backward import float64_gradients
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.kernel.harness.verdict import CheckFailed
from attention_crossval.properties.strategies import backward_cases
from attention_crossval.reference.case import AttentionCase, CausalAlignment, Mask
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.testing.broken.cpu_backward_faults import (
    EXPECTED,
    BrokenBackwardAdapter,
    trigger_case,
)
from attention_crossval.testing.broken.cpu_backward_faults import sample_case as _case


@pytest.mark.cpu
@pytest.mark.parametrize("bug", sorted(set(EXPECTED) - {"none", "exit"}))
def test_broken_backward_is_caught_by_exactly_its_checks(bug: str) -> None:
    """Each deliberately broken backward fails exactly its named checks on its trigger case,
    and raise_for names them; the unbroken one passes the same case."""
    case = trigger_case(bug)
    run_backward_case(BrokenBackwardAdapter("none"), case, samples=1).raise_for()
    verdict = run_backward_case(BrokenBackwardAdapter(bug), case, samples=1)
    assert {f.check for f in verdict.findings} == EXPECTED[bug], verdict.findings
    for check in EXPECTED[bug]:
        with pytest.raises(CheckFailed, match=f"^{check}:"):
            verdict.raise_for(check)


@pytest.mark.cpu
def test_correct_backward_passes_every_check() -> None:
    verdict = run_backward_case(BrokenBackwardAdapter("none"), _case(), samples=1)
    verdict.raise_for()
    expected = {"unwritten", "output-guard", "padding-read", "determinism", "zero-grad"}
    assert expected | {"dq-bound", "dk-bound", "dv-bound"} <= verdict.applied
    assert verdict.run_to_run is not None and verdict.run_to_run.bitwise_equal


@pytest.mark.cpu
def test_overflow_the_declared_chain_allows_is_not_a_finding() -> None:
    """V = +-1e4 makes dS ~ 1e5: FlashAttention's fp16 dS overflows to +-inf and dq, dk turn
    inf or NaN, which the chain allows (bound inf, undefined), so nothing fails and a note
    counts the rows; the same NaN in dv, which no overflow reaches, is still a finding."""
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 2, 1, 16)).astype(np.float16) for _ in range(2))
    v = np.where(rng.random((1, 2, 1, 16)) < 0.5, -1e4, 1e4).astype(np.float16)
    do = np.full((1, 2, 1, 16), 2.0, np.float16) * np.sign(v[:, :1])
    case = BackwardCase(AttentionCase(q, k, v), do.astype(np.float16))
    verdict = run_backward_case(BrokenBackwardAdapter("none"), case, samples=1)
    assert not np.isfinite(verdict.result.dq).all()  # the chain did overflow
    assert verdict.findings == ()
    assert any("may overflow" in note for note in verdict.declared)

    class NanDv(BrokenBackwardAdapter):
        def _gradients(self, case: BackwardCase) -> Gradients:
            grads = super()._gradients(case)
            return dataclasses.replace(grads, dv=np.full_like(grads.dv, np.nan))

    verdict = run_backward_case(NanDv("none"), case, samples=1)
    assert [f.check for f in verdict.findings] == ["nonfinite"]
    assert verdict.findings[0].message.startswith("dv:")


@pytest.mark.cpu
def test_bound_failure_carries_the_triage() -> None:
    verdict = run_backward_case(BrokenBackwardAdapter("missing_d"), _case(), samples=1)
    with pytest.raises(CheckFailed, match="(?s)^dq-bound:.*kernel implementation bug"):
        verdict.raise_for("dq-bound")


@pytest.mark.cpu
def test_nondeterministic_backward_is_reported_not_failed() -> None:
    """A backward declared nondeterministic is held to the bound on every run, and its
    run-to-run differences are reported."""
    adapter = BrokenBackwardAdapter("atomic_dq")
    adapter.spec = dataclasses.replace(adapter.spec, backward_deterministic=False)
    verdict = run_backward_case(adapter, trigger_case("atomic_dq"), samples=1, repeats=3)
    verdict.raise_for()
    assert not verdict.run_to_run.required
    assert verdict.run_to_run.differing > 0 and verdict.run_to_run.max_abs_diff > 0


@pytest.mark.cpu
def test_isolated_backward_crash_is_a_finding_and_the_worker_recovers(tmp_path) -> None:
    worker = IsolatedKernel(
        "attention_crossval.testing.broken.cpu_backward_faults:exit_in_backward", timeout_s=30.0
    )
    adapter = BrokenBackwardAdapter("exit")
    try:
        verdict = run_backward_case(adapter, _case(), isolated=worker, finding_dir=tmp_path)
        assert [f.check for f in verdict.findings] == ["crash"]
        saved = BackwardCase.load(verdict.findings[0].case_path)
        np.testing.assert_array_equal(saved.do, _case().do)
        again = run_backward_case(adapter, _case(), isolated=worker, compare=False)
        assert again.failed("crash")
    finally:
        worker.close()


@pytest.mark.cpu
def test_isolated_worker_runs_the_streaming_backward() -> None:
    worker = IsolatedKernel("streaming-fa", timeout_s=60.0)
    try:
        verdict = run_backward_case(resolve("streaming-fa"), _case(), isolated=worker, samples=1)
        verdict.raise_for()
        assert {"crash", "timeout"} <= verdict.applied
    finally:
        worker.close()


@pytest.mark.cpu
def test_fill_backward_padding_touches_only_padding() -> None:
    case = _case()
    poisoned = fill_backward_padding(case, np.nan)
    assert np.isnan(poisoned.do[1, 5:].astype(np.float32)).all()
    np.testing.assert_array_equal(poisoned.do[1, :5], case.do[1, :5])
    assert np.isnan(poisoned.forward.v[1, 19:].astype(np.float32)).all()
    np.testing.assert_array_equal(poisoned.forward.v[0], case.forward.v[0])


@pytest.mark.cpu
def test_torch_float64_gradients_match_the_streaming_float64_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chunked dense torch reference (used on the GPU) agrees with the float64 streaming
    backward on a padded, GQA, causal case, chunks smaller than Sq included."""
    pytest.importorskip("torch", reason="torch is not installed (CI has none)")
    from attention_crossval.kernel.harness import references_backward

    case = fill_backward_padding(_case(), np.nan)
    expected = float64_gradients(case)
    monkeypatch.setattr(
        references_backward, "CHUNK_ELEMENTS", 7 * case.forward.Hq * case.forward.Sk
    )
    actual = references_backward.torch_float64_gradients(case, device="cpu")
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(
            getattr(actual, name), getattr(expected, name), rtol=1e-12, atol=1e-12
        )


@pytest.mark.cpu
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"backward": 1}, r"^spec.backward=1 must be a bool"),
        ({"backward_deterministic": True}, r"need spec.backward=True"),
        ({"backward": True, "backward_precision": []}, r"backward_precision=\[\] must be a dict"),
        (
            {"backward": True, "backward_precision": {"float16": StreamingPrecision()}},
            r"values BackwardPrecision chains",
        ),
        ({"backward_head_dims": {64}}, r"need spec.backward=True"),
        ({"backward": True, "backward_head_dims": {}}, r"must be None or a non-empty set"),
        ({"backward": True, "backward_head_dims": {32}}, r"must be a subset of spec.head_dims"),
    ],
)
def test_spec_rejects_bad_backward_declarations(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KernelSpec(name="k", **changes)


@pytest.mark.cpu
def test_backward_head_dims_narrow_the_backward_cases() -> None:
    """A backward declared for fewer head dims than the forward: its cases are drawn there,
    and any other D (or Dv != D) is skipped with the reason."""
    spec = dataclasses.replace(
        BrokenBackwardAdapter().spec,
        head_dims=frozenset({8, 16}),
        head_dims_v=frozenset({8, 16}),
        backward_head_dims=frozenset({8}),
    )
    drawn = find(backward_cases(spec=spec, max_len=8), lambda c: True)
    assert drawn.forward.D == drawn.forward.Dv == 8
    wide = _case(np.float16, D=16)
    verdict = run_backward_case(dataclasses.replace(BrokenBackwardAdapter(), spec=spec), wide)
    assert verdict.skipped == "backward declared for D = Dv in [8] only (D=16, Dv=16)"


@pytest.mark.cpu
def test_a_declared_backward_needs_the_method() -> None:
    adapter = resolve("attention_crossval.testing.broken.cpu_faults:guarded")
    adapter.spec = dataclasses.replace(adapter.spec, backward=True)
    with pytest.raises(ValueError, match="spec.backward is True, so it must have backward"):
        run_backward_case(adapter, _case())


@pytest.mark.cpu
def test_default_backward_chain_follows_the_declared_forward_chain() -> None:
    forward = StreamingPrecision(output_dtype="float16")
    spec = KernelSpec(name="k", backward=True, precision={"float16": forward})
    chain = spec.backward_precision_for("float16")
    assert chain.forward == forward and chain.dq_order == "permuted"
    deterministic = dataclasses.replace(spec, backward_deterministic=True)
    assert deterministic.backward_precision_for("float16").dq_order == "fixed"


@pytest.mark.cpu
def test_sdpa_math_backward_through_autograd_on_cpu() -> None:
    """The SDPA adapter's autograd backward (math backend, on torch's CPU device), GQA and a
    top-left causal mask, passes every backward check."""
    pytest.importorskip("torch", reason="torch is not installed (CI has none)")
    from attention_crossval.kernel.adapters.sdpa import SdpaAdapter

    adapter = SdpaAdapter.create("math")
    adapter = dataclasses.replace(adapter, spec=dataclasses.replace(adapter.spec, device="cpu"))
    case = _case(D=64)
    mask = Mask(causal=True, alignment=CausalAlignment.TOP_LEFT)
    forward = dataclasses.replace(case.forward, mask=mask)
    verdict = run_backward_case(adapter, BackwardCase(forward, case.do), samples=1)
    verdict.raise_for()
    assert verdict.run_to_run.required and verdict.run_to_run.bitwise_equal


def _report(tmp_path, passes: str, *, html: bool = False) -> dict:
    from attention_crossval.report.configs import Config
    from attention_crossval.report.runner import RunOptions
    from attention_crossval.report.session import resolve_kernels, run_report

    configs = [
        Config("float16", 16, 20, 40, B=2, mask="varlen"),
        Config("bfloat16", 32, 33, 33, Hq=4, Hkv=2, mask="causal", distribution="ramp"),
    ]
    options = RunOptions(rows=2, passes=passes)
    kernels = resolve_kernels(["streaming-fa"])
    return run_report(configs, kernels, options, tmp_path, progress=False, html=html)


@pytest.mark.cpu
def test_report_pass_both_adds_the_backward_to_each_record(tmp_path) -> None:
    report = _report(tmp_path, "both")
    for record in report["records"]:
        assert record["verdict"] == "pass" and record["primary_pair"]
        section = record["backward"]
        assert section["verdict"] == "pass" and section["determinism"]["bitwise_equal"]
        assert set(section["vacuous"]) == {"dq", "dk", "dv"}
        for pairs in section["gradients"].values():
            assert set(pairs) == {
                "kernel_vs_exact",
                "kernel_vs_float64",
                "kernel_vs_streaming",
                "streaming_vs_exact",
            }
            assert all(p["max_bound_fraction"] <= 1 for p in pairs.values())
    markdown = (tmp_path / "report.md").read_text()
    assert "## Backward pass" in markdown and "| config | kernel | verdict | max abs" in markdown


@pytest.mark.cpu
def test_report_pass_backward_holds_no_forward_fields(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the HTML page needs matplotlib")
    report = _report(tmp_path, "backward", html=True)
    assert all(
        "primary_pair" not in r and r["backward"]["status"] == "ok" for r in report["records"]
    )
    assert {r["status"] for r in report["records"]} == {"ok"}
    markdown = (tmp_path / "report.md").read_text()
    assert "## Backward pass" in markdown and "max abs" not in markdown
    assert "nothing to plot" in (tmp_path / "report.html").read_text()


@pytest.mark.cpu
def test_forward_records_keep_their_keys() -> None:
    """Regression guard: the ``passes`` option is left out of a forward run's digest, so
    reports written before the backward existed still resume and diff (digest of then)."""
    from attention_crossval.report.runner import RunOptions

    assert RunOptions().digest == "74e47b8eed77"
    assert RunOptions(passes="both").digest != RunOptions().digest


@pytest.mark.cpu
def test_report_rejects_an_unknown_pass(capsys: pytest.CaptureFixture[str]) -> None:
    from attention_crossval.report.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--pass", "sideways"])
    assert stop.value.code == 2
    assert "argument --pass: invalid choice: 'sideways'" in capsys.readouterr().err


@pytest.mark.cpu
def test_backward_checks_are_in_the_one_vocabulary() -> None:
    """Adapters' ``backward_checks`` use the forward's names; an unknown name is refused."""
    from attention_crossval.kernel.adapters import flash_attn_cute, sdpa, streaming
    from attention_crossval.kernel.contract.checks import ADAPTER_CHECKS
    from attention_crossval.kernel.harness.execution import backward_checks

    for adapter in (
        streaming.create(),
        sdpa.math(),
        flash_attn_cute.deterministic(),
        BrokenBackwardAdapter(),
    ):
        assert backward_checks(adapter) <= ADAPTER_CHECKS
    adapter = BrokenBackwardAdapter()
    adapter.backward_checks = frozenset({"prefill"})
    with pytest.raises(ValueError, match=r"backward_checks has \['prefill'\]"):
        backward_checks(adapter)
