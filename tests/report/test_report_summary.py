"""What a reader of a report meets first: the exit status, the per-kernel summary with the worst
error-to-bound (first screen of the HTML), errors as one line with their text set apart, ulps
that leave near-zero references out, and ``diff`` across a renamed kernel path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from attention_crossval.reference.case import AttentionResult
from attention_crossval.reference.compare import compare
from attention_crossval.report.cells import fmt
from attention_crossval.report.cli import main
from attention_crossval.report.diff import diff_records, load_records

pytestmark = pytest.mark.cpu

NO_MASK = "attention_crossval.testing.broken.cpu_mistakes:no_causal_mask"
RAISES = "attention_crossval.testing.broken.cpu_faults:raises"
TINY = ["--preset", "tiny", "--rows", "8", "--no-progress"]


@pytest.fixture(scope="module")
def broken_report(tmp_path_factory) -> Path:
    """The tiny preset on a kernel without its causal mask, a kernel that raises, and
    streaming-fa; the run exits 1 (failures and errors)."""
    out = tmp_path_factory.mktemp("broken")
    kernels = ["--kernel", NO_MASK, "--kernel", RAISES, "--kernel", "streaming-fa"]
    assert main([*TINY, *kernels, "--out", str(out)]) == 1
    return out


def _worst_forward(report: dict, kernel: str) -> float:
    return max(
        float(r["pairs"][r["primary_pair"]]["max_bound_fraction"])
        for r in report["records"]
        if r["kernel"]["name"] == kernel and r["status"] == "ok"
    )


def test_exit_status_follows_the_records(broken_report: Path, tmp_path: Path) -> None:
    """1 when a record fails or errors (--strict still accepted), 0 with --exit-zero or when
    every record passes; the report is written either way."""
    argv = [*TINY, "--no-html", "--kernel", NO_MASK, "--out", str(tmp_path)]
    assert main(argv) == 1
    assert main([*argv, "--strict"]) == 1
    assert main([*argv, "--exit-zero"]) == 0
    assert (tmp_path / "report.json").is_file()
    passing = [*TINY, "--no-html", "--kernel", "streaming-fa", "--out", str(tmp_path / "ok")]
    assert main(passing) == 0


def test_markdown_opens_with_the_worst_error_per_kernel(broken_report: Path) -> None:
    report = json.loads((broken_report / "report.json").read_text())
    markdown = (broken_report / "report.md").read_text()
    summary = markdown.index("## Summary per kernel")
    assert summary < markdown.index("| config | kernel | verdict")
    rows = {
        line.split(" | ")[0].lstrip("| "): line for line in markdown[summary:].splitlines()[4:7]
    }
    worst = _worst_forward(report, NO_MASK)
    assert worst > 1 and f"| {fmt(worst)} (bf16-d64-q33-k70-causal-gaussian) |" in rows[NO_MASK]
    assert "1 pass, 1 fail" in rows[NO_MASK] and "2 error" in rows[RAISES]
    assert "| 2 pass |" in rows["streaming-fa"]


def test_errors_are_one_line_in_the_table_with_the_traceback_below(broken_report: Path) -> None:
    markdown = (broken_report / "report.md").read_text()
    table_rows = [
        line
        for line in markdown.splitlines()
        if line.startswith(f"| bf16-d64-q33-k70-none-gaussian | {RAISES}")
    ]
    assert table_rows == [
        f"| bf16-d64-q33-k70-none-gaussian | {RAISES} | error | RuntimeError: deliberate "
        "failure inside the kernel |" + "  |" * 11
    ]
    errors = markdown[markdown.index("## Errors") :]
    assert "Traceback (most recent call last)" in errors and errors.count("### ") == 2
    page = (broken_report / "report.html").read_text()
    assert page.count("<details><summary>bf16-d64-q33-k70-") == 2
    assert "<td>Traceback" not in page


def test_ulps_leave_out_near_zero_references() -> None:
    """A reference of 0 has the subnormal spacing as its ulp: an error of 1e-3 there read as
    7e41 ulp. Within the bound of zero the report gives the absolute error against the bound."""
    reference = np.zeros((1, 2, 1, 4))
    reference[0, 0, 0, 0] = 1.0
    actual = reference + np.where(reference == 0, 1e-3, 0.0)
    bound = np.full(reference.shape, 2e-3)
    report = compare(
        AttentionResult(o=actual), AttentionResult(o=reference), bound=bound, output_dtype="float32"
    )
    assert report.passed and report.max_ulp == 0 and report.max_rel == 0
    assert report.near_zero == 7 and report.near_zero_max_abs == pytest.approx(1e-3)
    assert report.near_zero_max_bound_fraction == pytest.approx(0.5)
    assert "e+" not in report.summary() and "near-zero references 7" in report.summary()
    no_bound = compare(
        AttentionResult(o=actual), AttentionResult(o=reference), bound=None, output_dtype="float32"
    )
    assert no_bound.near_zero == 0 and no_bound.max_ulp > 1e40  # without a bound: plain ulps


def test_diff_matches_a_renamed_kernel_path_and_fails_on_lost_records(
    broken_report: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = json.loads((broken_report / "report.json").read_text())
    moved = copy.deepcopy(report)
    for record in moved["records"]:
        if record["kernel"]["name"] == NO_MASK:
            record["kernel"]["name"] = "mykernels.attention:no_causal_mask"
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    old = str(broken_report / "report.json")
    rows = diff_records(load_records(old), load_records(tmp_path / "moved.json"))
    renamed = [r for r in rows if " -> " in r["kernel"]]
    assert len(renamed) == 2 and {r["change"] for r in renamed} == {"same"}
    assert all("matched by spec name 'cpu-no-causal-mask'" in r["why"] for r in renamed)
    assert main(["diff", old, str(tmp_path / "moved.json")]) == 0
    assert "Kernel path renamed" in capsys.readouterr().out
    regressed = copy.deepcopy(moved)
    passing = next(
        r
        for r in regressed["records"]
        if r["kernel"]["spec_name"] == "cpu-no-causal-mask" and r["verdict"] == "pass"
    )
    passing["verdict"] = "fail"
    (tmp_path / "regressed.json").write_text(json.dumps(regressed))
    assert main(["diff", old, str(tmp_path / "regressed.json")]) == 1
    lost = copy.deepcopy(report)
    lost["records"] = lost["records"][1:]
    (tmp_path / "lost.json").write_text(json.dumps(lost))
    assert main(["diff", old, str(tmp_path / "lost.json")]) == 1
    assert "1 removed" in capsys.readouterr().out


def test_html_first_screen_shows_the_worst_error_to_bound(broken_report: Path, html_render) -> None:
    result = html_render.script.check(broken_report / "report.html", html_render.binary)
    report = json.loads((broken_report / "report.json").read_text())
    assert html_render.script.first_screen_shows_worst(result), result["first_screen"]
    assert fmt(_worst_forward(report, NO_MASK)) in result["first_screen"]
    assert result["loaded"] == result["total"] >= 3


def test_worst_case_histograms_show_non_finite_errors() -> None:
    """A kernel whose every error is infinite (NaN output) has no finite bin: its worst-case
    panel was empty; those errors now fill the last bin, past the bound."""
    pytest.importorskip("matplotlib")
    from attention_crossval.report.plots import _shares

    record = {"histogram": {"counts": [0, 0, 0], "infinite": 6, "zeros": 2}}
    assert list(_shares(record)) == [0.0, 0.0, 1.0]
