"""The report command end to end: CLI run, schema, Markdown, resume, diff, triage, HTML render.

Mirrors ``report/``; every run uses the ``tiny`` preset (two 33 x 70 configs) so the file stays
well under a minute on a 2-core CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.reference.case import AttentionResult
from attention_crossval.report import configs as report_configs
from attention_crossval.report.cli import main
from attention_crossval.report.configs import Config, load_config_file, preset, sampled_configs
from attention_crossval.report.diff import diff_records, load_records
from attention_crossval.report.runner import Kernel, RunOptions, record_key
from attention_crossval.report.schema import _errors, load_schema, validate
from attention_crossval.report.session import run_report

pytestmark = pytest.mark.cpu

FAST = RunOptions(rows=8)
SAME_BY_PATH = "attention_crossval.kernel.adapters.streaming:create"


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    argv = ["--preset", "tiny", "--rows", "8", "--out", str(out), "--no-progress"]
    # The same kernel twice, by name and by dotted path: two kernels give the comparison plot.
    assert main([*argv, "--kernel", "streaming-fa", "--kernel", SAME_BY_PATH]) == 0
    return out


@dataclasses.dataclass
class Counting:
    """Wraps an adapter, counting calls per case label (to see what a resumed run reruns)."""

    inner: object
    calls: list = dataclasses.field(default_factory=list)

    @property
    def spec(self):
        return self.inner.spec

    def __call__(self, case):
        self.calls.append(case.label)
        return self.inner(case)


@dataclasses.dataclass
class Perturbed:
    """The streaming kernel with 4 ulps of bf16 added to one output element, in the last row of
    the flattened [B, Hq, Sq] grid, which ``sample_rows`` always includes: a kernel bug."""

    inner: object

    @property
    def spec(self):
        return self.inner.spec

    def __call__(self, case):
        result = self.inner(case)
        o = result.o.copy()
        o[-1, -1, -1, 0] += 4 * 2.0**-8 * max(1.0, abs(o[-1, -1, -1, 0]))
        return AttentionResult(o=o, lse=result.lse)


class Raising:
    spec = resolve("streaming-fa").spec

    def __call__(self, case):
        raise RuntimeError("illegal memory access (simulated)")


def test_cli_default_kernel_writes_valid_json_markdown_html(tiny_report):
    report = json.loads((tiny_report / "report.json").read_text())
    validate(report)
    assert report["kernels"] == ["streaming-fa", SAME_BY_PATH]
    names = [c.name for c in preset("tiny")]
    pairs = [(r["config"]["name"], r["kernel"]["name"]) for r in report["records"]]
    assert pairs == [(n, k) for n in names for k in report["kernels"]]
    for record in report["records"]:
        assert record["verdict"] == "pass", record
        assert set(record["pairs"]) == {
            "kernel_vs_exact",
            "kernel_vs_streaming",
            "streaming_vs_exact",
        }
        assert record["pairs"]["kernel_vs_exact"]["total"] > 0
        assert record["determinism"]["bitwise_equal"] is True
        assert record["worst"]["rescales"] >= 0
    markdown = (tiny_report / "report.md").read_text()
    table_rows = [
        line.split(" | ")[:2] for line in markdown.splitlines() if line.startswith("| bf16")
    ]
    assert [(name.strip("| "), kernel) for name, kernel in table_rows] == pairs
    pytest.importorskip("matplotlib")
    html = (tiny_report / "report.html").read_text()
    assert html.count("<img class='plot'") == 4 and "Kernel vs kernel" in html


def test_schema_rejects_a_broken_report(tiny_report):
    report = json.loads((tiny_report / "report.json").read_text())
    schema = load_schema()
    assert list(_errors(report, schema, schema, "$")) == []  # the dependency-free checker agrees
    broken = copy.deepcopy(report)
    del broken["records"][0]["verdict"]
    broken["records"][1]["pairs"]["kernel_vs_exact"]["max_ulp"] = "lots"
    errors = list(_errors(broken, schema, schema, "$"))
    assert any("verdict" in e for e in errors) and any("max_ulp" in e for e in errors)
    with pytest.raises(ValueError, match="schema"):
        validate(broken)


def test_resume_skips_finished_configs(tmp_path):
    configs = preset("tiny")
    first = Counting(resolve("streaming-fa"))
    run_report(configs[:1], [Kernel("counted", first)], FAST, tmp_path, progress=False, html=False)
    assert len(first.calls) == FAST.repeats
    # An interrupted append leaves a torn line: it is ignored, and the next record starts clean.
    with (tmp_path / "records.jsonl").open("a") as stream:
        stream.write('{"key": "torn')
    second = Counting(resolve("streaming-fa"))
    report = run_report(
        configs, [Kernel("counted", second)], FAST, tmp_path, progress=False, html=False
    )
    assert second.calls == [f"report:{configs[1].name}"] * FAST.repeats
    assert report["resumed_records"] == 1 and report["summary"]["records"] == 2
    assert report["exact_cache"] == {"hits": 0, "misses": 1}
    # Other options give other keys: nothing is reused, but the exact tier comes from its cache.
    third = Counting(resolve("streaming-fa"))
    report = run_report(
        configs,
        [Kernel("counted", third)],
        RunOptions(rows=8, repeats=1),
        tmp_path,
        progress=False,
        html=False,
    )
    assert len(third.calls) == 2 and report["exact_cache"]["hits"] == 2
    keys = [
        json.loads(line)["key"]
        for line in (tmp_path / "records.jsonl").read_text().splitlines()[-2:]
    ]
    assert keys == [record_key(c, "counted", RunOptions(rows=8, repeats=1)) for c in configs]


def test_triage_separates_kernel_bug_from_reference_and_records_errors(tmp_path):
    kernels = [
        Kernel("perturbed", Perturbed(resolve("streaming-fa"))),
        Kernel("raising", Raising()),
    ]
    config = Config("bfloat16", 64, 40, 70, name="triage")
    report = run_report([config], kernels, FAST, tmp_path, progress=False, html=False)
    perturbed, raising = report["records"]
    assert perturbed["verdict"] == "fail"
    assert not perturbed["pairs"]["kernel_vs_exact"]["passed"]
    assert not perturbed["pairs"]["kernel_vs_streaming"]["passed"]
    assert perturbed["pairs"]["streaming_vs_exact"]["passed"]  # the references agree: kernel bug
    assert (perturbed["worst"]["b"], perturbed["worst"]["row"], perturbed["worst"]["head"]) == (
        0,
        39,
        1,
    )
    assert raising["verdict"] == "error" and "illegal memory access" in raising["message"]
    markdown = (tmp_path / "report.md").read_text()
    assert (
        "| triage | perturbed | FAIL |" in markdown and "| triage | raising | error |" in markdown
    )


def test_without_matplotlib_json_and_markdown_still_written(tmp_path, monkeypatch, capsys):
    from attention_crossval import report

    for name in ("html", "plots"):  # forget the loaded modules, so they are imported afresh
        monkeypatch.delitem(sys.modules, f"attention_crossval.report.{name}", raising=False)
        monkeypatch.delattr(report, name, raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    kernels = [Kernel("streaming-fa", resolve("streaming-fa"))]
    run_report(preset("tiny")[:1], kernels, RunOptions(rows=4, repeats=1), tmp_path, progress=False)
    assert (tmp_path / "report.json").exists() and (tmp_path / "report.md").exists()
    assert not (tmp_path / "report.html").exists()
    assert "no HTML page" in capsys.readouterr().err


def test_diff_flags_regressions(tiny_report, tmp_path, capsys):
    old = load_records(tiny_report / "report.json")
    new = copy.deepcopy(old)
    new[0]["verdict"] = "fail"
    pair = new[1]["pairs"][new[1]["primary_pair"]]
    pair["max_bound_fraction"] = 0.9 if pair["max_bound_fraction"] < 0.5 else "inf"
    new[2]["pairs"][new[2]["primary_pair"]]["max_bound_fraction"] *= 1.01  # noise: not flagged
    regressed = [r["kernel"] for r in diff_records(old, new) if r["change"] == "regression"]
    assert regressed == [old[0]["kernel"]["name"], old[1]["kernel"]["name"]]
    assert {r["change"] for r in diff_records(old, old)} == {"same"}
    report = json.loads((tiny_report / "report.json").read_text())
    report["records"] = new
    (tmp_path / "new.json").write_text(json.dumps(report))
    assert main(["diff", str(tiny_report / "report.json"), str(tmp_path / "new.json")]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert main(["diff", str(tiny_report / "report.json"), str(tiny_report / "records.jsonl")]) == 0


def test_config_file_and_deterministic_builds(tmp_path):
    (tmp_path / "c.toml").write_text(
        '[[config]]\ndtype = "float16"\nD = 64\nSq = 5\nSk = 9\nmask = "causal"\n'
        'distribution = "ramp"\n'
        '[[config]]\ndtype = "bfloat16"\nD = 128\nSq = 3\nSk = 300\nB = 3\nmask = "varlen"\n'
        "seed = 7\n"
    )
    configs = load_config_file(tmp_path / "c.toml")
    assert [c.name for c in configs] == [
        "fp16-d64-q5-k9-causal-ramp",
        "bf16-d128-q3-k300-varlen-gaussian-s7",
    ]
    a, b = configs[1].build(), configs[1].build()
    assert all(np.array_equal(getattr(a, n), getattr(b, n)) for n in "qkv")
    assert a.mask.k_lengths == (300, 150, 0)  # the last batch has no keys: empty rows
    (tmp_path / "bad.json").write_text(
        json.dumps([{"dtype": "float16", "D": 64, "Sq": 1, "Sk": 1, "Dk": 3}])
    )
    with pytest.raises(ValueError, match="unknown keys"):
        load_config_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="distribution"):
        Config("float16", 64, 1, 1, distribution="nope")
    assert main(["--config-file", str(tmp_path / "bad.json"), "--out", str(tmp_path)]) == 2


def test_sampled_configs_repeat_for_a_seed(tmp_path):
    argv = ["--sample", "2", "--rows", "4", "--repeats", "1", "--no-html", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "report.json").read_text())["records"]
    assert [r["config"]["name"] for r in records] == ["sampled-0-000", "sampled-0-001"]
    assert {r["verdict"] for r in records} <= {"pass"}
    spec = resolve("streaming-fa").spec
    first, again = sampled_configs(3, seed=5, spec=spec), sampled_configs(3, seed=5, spec=spec)
    assert [c.digest for c in first] == [c.digest for c in again]
    assert all(spec.supports(c.build()) for c in first)
    assert first[0].fields()["distribution"] in report_configs.distribution_names()


def test_html_renders_its_plots_in_headless_chromium(tiny_report, tmp_path, html_render):
    pytest.importorskip("matplotlib")
    result = html_render.script.check(
        tiny_report / "report.html", html_render.binary, tmp_path / "shot.png"
    )
    assert result["total"] >= 3 and result["loaded"] == result["total"], result
    assert result["screenshot"] and (tmp_path / "shot.png").stat().st_size > 10_000
    assert html_render.script.first_screen_shows_worst(result), result["first_screen"]


def test_html_page_skips_records_without_plot_data(tiny_report) -> None:
    """The schema leaves ``histogram`` and ``row_profile`` optional: an ok record without them
    (a backward-only record, or an edited report fed to merge) is left out of the plots (a
    KeyError in plots.histograms before; found by test_diff_merge_resume_on_mutated_reports)."""
    from attention_crossval.report.html import render_html

    report = json.loads((tiny_report / "report.json").read_text())
    validate(report)
    stripped = copy.deepcopy(report)
    stripped["records"][0].pop("histogram")
    validate(stripped)
    page = render_html(stripped)
    assert "<img" in page  # the other record is still plotted
    for record in stripped["records"]:
        record.pop("histogram", None)
    assert "nothing to plot" in render_html(stripped)
