"""report.shard: --shard K/N partitions the configs, --gpus runs one pinned child per GPU and
merges, ``attention-report merge`` refuses conflicting or missing shards.

The GPU ids are plain strings here (``--gpus a,b``): they only go into CUDA_VISIBLE_DEVICES, so
the streaming-fa CPU kernel exercises the whole path with the ``tiny`` preset.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.report.cli import main
from attention_crossval.report.configs import PRESETS, preset
from attention_crossval.report.schema import validate
from attention_crossval.report.shard import merge_reports, parse_gpus, parse_shard, shard_configs

pytestmark = pytest.mark.cpu

ARGV = ["--preset", "tiny", "--rows", "8", "--no-progress", "--no-html"]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("count", [1, 2, 3, 7, 1000])
def test_shards_partition_the_configs(name: str, count: int) -> None:
    configs = preset(name)
    shards = [shard_configs(configs, index, count) for index in range(count)]
    names = [c.name for shard in shards for c in shard]
    assert sorted(names) == sorted(c.name for c in configs)  # no loss, no duplicate
    assert len(names) == len(set(names))
    position = {c.name: i for i, c in enumerate(configs)}
    for index, shard in enumerate(shards):
        where = [position[c.name] for c in shard]
        assert where == sorted(where)  # each shard keeps the set's order
        assert all(i % count == index for i in where)
    assert shards == [shard_configs(preset(name), index, count) for index in range(count)]


@pytest.mark.parametrize("text", ["2/2", "-1/2", "1", "a/b", "0/0", "1/", ""])
def test_bad_shard_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


def test_gpu_lists(monkeypatch) -> None:
    assert parse_gpus("3, 1") == ["3", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert parse_gpus("all") == ["4", "6"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for text in ("all", ",", "0,0"):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(text)


def test_no_gpu_found_is_a_cli_error(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main([*ARGV, "--gpus", "all", "--out", str(tmp_path)]) == 2
    assert "names no GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing launched


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny preset unsharded, and through ``--gpus a,b``."""
    plain, sharded = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("sharded")
    assert main([*ARGV, "--out", str(plain)]) == 0
    assert main([*ARGV, "--gpus", "a,b", "--out", str(sharded)]) == 0
    return plain, sharded


def _report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def _without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "timing"} for r in records]


def test_gpus_run_equals_unsharded_run(runs) -> None:
    plain, sharded = (_report(folder) for folder in runs)
    validate(sharded)
    assert [r["key"] for r in sharded["records"]] == [r["key"] for r in plain["records"]]
    assert [r["verdict"] for r in sharded["records"]] == [r["verdict"] for r in plain["records"]]
    assert _without_timing(sharded["records"]) == _without_timing(plain["records"])
    assert sharded["summary"] == plain["summary"]
    assert "--gpus" in sharded["command"]


def test_each_child_saw_its_own_gpu(runs) -> None:
    _, sharded = runs
    shards = _report(sharded)["shards"]
    assert [(s["index"], s["count"], s["cuda_visible_devices"]) for s in shards] == [
        (0, 2, "a"),
        (1, 2, "b"),
    ]
    for shard in shards:
        child = _report(Path(shard["source"]).parent)
        assert child["shard"]["cuda_visible_devices"] == shard["cuda_visible_devices"]
        assert child["summary"]["records"] == shard["records"] == 1
        assert (Path(shard["source"]).parent / "records.jsonl").exists()


def test_shard_resumes_on_its_own(tmp_path: Path) -> None:
    argv = [*ARGV, "--shard", "1/2", "--out", str(tmp_path)]
    assert main(argv) == 0
    first = _report(tmp_path)
    assert main(argv) == 0
    again = _report(tmp_path)
    assert first["resumed_records"] == 0
    assert again["resumed_records"] == again["summary"]["records"] == 1
    assert again["records"] == first["records"]


def test_merge_command_rebuilds_the_report(runs, tmp_path: Path) -> None:
    _, sharded = runs
    folders = [str(sharded / f"shard-{k}-of-2") for k in (1, 0)]  # any order
    assert main(["merge", str(tmp_path), *folders, "--no-html"]) == 0
    assert _report(tmp_path)["records"] == _report(sharded)["records"]


def test_merge_dedupes_equal_records_and_refuses_conflicts(runs, tmp_path: Path, capsys) -> None:
    _, sharded = runs
    zero, one = sharded / "shard-0-of-2", sharded / "shard-1-of-2"
    rerun = tmp_path / "rerun"  # shard 0 again, other timings: the same result
    shutil.copytree(zero, rerun)
    report = _report(rerun)
    report["records"][0]["timing"] = {"kernel_s": 123.0}
    (rerun / "report.json").write_text(json.dumps(report))
    merged = merge_reports([zero, one, rerun], tmp_path / "ok", html=False)
    assert merged["summary"]["records"] == 2

    pair = report["records"][0]["pairs"]["kernel_vs_exact"]
    pair["max_abs"] = pair["max_abs"] * 2 + 1e-3
    (rerun / "report.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="differs between"):
        merge_reports([zero, one, rerun], tmp_path / "bad", html=False)
    assert main(["merge", str(tmp_path / "bad"), str(zero), str(one), str(rerun)]) == 2
    assert "differs between" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "report.json").exists()


def unavailable_on_b():
    """streaming-fa, except in a process pinned to GPU "b": a shard child that fails to start."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "b":
        raise ValueError("no device b")
    return resolve("streaming-fa")


def test_failed_shard_stops_the_merge(tmp_path: Path, capsys) -> None:
    kernel = f"{__name__}:unavailable_on_b"
    assert main([*ARGV, "--kernel", kernel, "--gpus", "a,b", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "shard-1-of-2 exit 2" in error and "no device b" in error
    assert (tmp_path / "shard-0-of-2" / "report.json").exists()  # the other shard finished
    assert not (tmp_path / "report.json").exists()


def test_merge_refuses_missing_or_unsharded_reports(runs, tmp_path: Path) -> None:
    plain, sharded = runs
    with pytest.raises(ValueError, match=r"shards \[1\] of 2 missing"):
        merge_reports([sharded / "shard-0-of-2"], tmp_path, html=False)
    with pytest.raises(ValueError, match="not a shard report"):
        merge_reports([plain, sharded / "shard-0-of-2"], tmp_path, html=False)
