"""Campaigns through a scheduler: ``--shard auto[/N]`` takes the shard from a Slurm job array's
or a Kubernetes Indexed Job's environment, and N separate processes under those variables,
merged, give the unsharded run's records (none lost, none duplicated), resumably.

The processes run streaming-fa against the streaming tier on five small configs, so the whole
file costs a few process starts (docs/campaigns.md has the recipes these tests stand for).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from attention_crossval.report.cli import main
from attention_crossval.report.shard import Shard, parse_shard

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
SLURM = "SLURM_ARRAY_TASK_ID"
INDEXED = "JOB_COMPLETION_INDEX"
# Five configs over three shards: shards of 2, 2 and 1 config.
CONFIGS = [
    {"dtype": "bfloat16", "D": 16, "Sq": 8, "Sk": 24, "seed": seed, "mask": mask}
    for seed, mask in enumerate(["none", "causal", "none", "causal", "none"])
]
SHARDS = 3


def _slurm(task: int, first: int = 0, count: int = SHARDS, step: int = 1) -> dict[str, str]:
    return {
        SLURM: str(task),
        "SLURM_ARRAY_TASK_MIN": str(first),
        "SLURM_ARRAY_TASK_STEP": str(step),
        "SLURM_ARRAY_TASK_COUNT": str(count),
    }


@pytest.mark.parametrize(
    ("text", "environ", "shard"),
    [
        ("auto", _slurm(0), Shard(0, 3, SLURM)),
        ("auto", _slurm(2), Shard(2, 3, SLURM)),
        ("auto", _slurm(1, first=1), Shard(0, 3, SLURM)),  # sbatch --array=1-3
        ("auto/3", _slurm(3, first=1), Shard(2, 3, SLURM)),
        ("auto", _slurm(14, first=10, step=2), Shard(2, 3, SLURM)),  # --array=10-14:2
        ("auto", {SLURM: "4", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_COUNT": "2"},
         Shard(1, 2, SLURM)),  # no step variable: 1
        ("auto/4", {INDEXED: "3"}, Shard(3, 4, INDEXED)),
        (" auto / 4 ", {INDEXED: "0"}, Shard(0, 4, INDEXED)),
        ("2/5", {INDEXED: "0"}, Shard(2, 5)),  # K/N ignores the environment
    ],
)  # fmt: skip
def test_shard_from_the_scheduler_environment(text: str, environ: dict, shard: Shard) -> None:
    assert parse_shard(text, environ) == shard


@pytest.mark.parametrize(
    ("text", "environ", "named"),
    [
        ("auto", {}, "neither is set"),
        ("auto/3", {**_slurm(0), INDEXED: "0"}, "both are set"),
        ("auto", {INDEXED: "1"}, f"{INDEXED} needs the shard count"),
        ("auto/3", {INDEXED: "3"}, f"{INDEXED}=3 gives shard 3, outside 0..2"),
        ("auto/3", {INDEXED: "-1"}, f"{INDEXED}='-1'; it must be an integer >= 0"),
        ("auto/3", {INDEXED: ""}, f"{INDEXED}=''"),
        ("auto", _slurm(3), f"{SLURM}=3 .*gives shard 3, outside 0..2"),  # 0-based, one too far
        ("auto", _slurm(0, first=1), "SLURM_ARRAY_TASK_MIN=1.* not a task"),
        ("auto", _slurm(11, first=10, step=2), "SLURM_ARRAY_TASK_STEP=2.* not a task"),
        ("auto", {SLURM: "x", "SLURM_ARRAY_TASK_MIN": "0"}, f"{SLURM}='x'"),
        ("auto", {SLURM: "0", "SLURM_ARRAY_TASK_COUNT": "3"}, "SLURM_ARRAY_TASK_MIN is not set"),
        ("auto", {SLURM: "0", "SLURM_ARRAY_TASK_MIN": "0"}, "SLURM_ARRAY_TASK_COUNT is not set"),
        ("auto", _slurm(0, count=0), "SLURM_ARRAY_TASK_COUNT is 0"),
        ("auto/4", _slurm(0), "SLURM_ARRAY_TASK_COUNT=3 differs"),
        ("auto/0", {INDEXED: "0"}, "--shard='auto/0' must be"),
        ("auto/x", {INDEXED: "0"}, "--shard='auto/x' must be"),
        ("automatic", {INDEXED: "0"}, "--shard='automatic' must be"),
    ],
)
def test_bad_scheduler_environment_names_the_variable(text: str, environ: dict, named: str):
    with pytest.raises(ValueError, match=named):
        parse_shard(text, environ)


def test_cli_refuses_a_missing_index_before_writing(tmp_path: Path, monkeypatch, capsys) -> None:
    for variable in (SLURM, INDEXED):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(SystemExit) as exit:
        main(["--shard", "auto/2", "--out", str(tmp_path), "--no-progress"])
    assert exit.value.code == 2
    assert "argument --shard: --shard auto takes K from" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _run_shards(config_file: Path, out: Path, environs: list[dict[str, str]], shard: str):
    """One ``attention-report --shard SHARD`` process per environment, side by side (as the
    scheduler runs them); every process gets the same command line."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", INDEXED))}
    command = [
        *(sys.executable, "-m", "attention_crossval.report", "--config-file", str(config_file)),
        *("--kernel", "streaming-fa", "--tier", "streaming", "--rows", "4", "--repeats", "1"),
        *("--no-progress", "--no-html", "--out", str(out), "--shard", shard),
    ]
    children = [
        subprocess.Popen(
            command,
            env={**base, **environ, "PYTHONPATH": path},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for environ in environs
    ]
    for child in children:
        output = child.communicate(timeout=300)[0]
        assert child.returncode == 0, output


def _records(folder: Path) -> list[dict]:
    report = json.loads((folder / "report.json").read_text())
    return [{k: v for k, v in r.items() if k != "timing"} for r in report["records"]]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """The config file, a campaign root, and the unsharded run's records (timings left out)."""
    root = tmp_path_factory.mktemp("campaign")
    config_file = root / "configs.json"
    config_file.write_text(json.dumps(CONFIGS))
    argv = ["--config-file", str(config_file), "--tier", "streaming", "--rows", "4"]
    argv += ["--repeats", "1", "--no-progress", "--no-html", "--out", str(root / "single")]
    assert main(argv) == 0
    return config_file, root, _records(root / "single")


def _merge(root: Path, out: Path) -> list[dict]:
    shards = [str(root / f"shard-{k}-of-{SHARDS}") for k in range(SHARDS)]
    assert main(["merge", str(out), *shards, "--no-html"]) == 0
    return _records(out)


def _equal_record_sets(merged: list[dict], single: list[dict]) -> None:
    keys = [r["key"] for r in merged]
    assert len(keys) == len(set(keys)) == len(CONFIGS)  # nothing duplicated, nothing lost
    assert merged == single  # the same records, in the unsharded order


def test_slurm_array_shards_merge_to_the_single_run(campaign) -> None:
    """``sbatch --array=1-3``: tasks 1..3 (SLURM_ARRAY_TASK_MIN=1) are shards 0..2."""
    config_file, root, single = campaign
    out = root / "slurm"
    tasks = [_slurm(task, first=1) for task in (1, 2, 3)]
    _run_shards(config_file, out, tasks, "auto")
    sizes = [len(_records(out / f"shard-{k}-of-{SHARDS}")) for k in range(SHARDS)]
    assert sizes == [2, 2, 1]
    _equal_record_sets(_merge(out, root / "slurm-merged"), single)


def test_indexed_job_shards_merge_and_a_shard_resumes(campaign) -> None:
    """An Indexed Job of 3 completions; then shard 0 loses its report and its last record
    (a pod killed mid-run) and its rerun computes only what is missing."""
    config_file, root, single = campaign
    out = root / "indexed"
    _run_shards(config_file, out, [{INDEXED: str(k)} for k in range(SHARDS)], f"auto/{SHARDS}")
    _equal_record_sets(_merge(out, root / "indexed-merged"), single)

    shard = out / f"shard-0-of-{SHARDS}"
    lines = (shard / "records.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 2
    (shard / "records.jsonl").write_text(lines[0])
    (shard / "report.json").unlink()
    _run_shards(config_file, out, [{INDEXED: "0"}], f"auto/{SHARDS}")
    rerun = json.loads((shard / "report.json").read_text())
    assert rerun["resumed_records"] == 1 and rerun["summary"]["records"] == 2
    assert len((shard / "records.jsonl").read_text().splitlines()) == 2
    _equal_record_sets(_merge(out, root / "indexed-remerged"), single)


DOC = ROOT / "docs" / "campaigns.md"
needs_doc = pytest.mark.skipif(not DOC.is_file(), reason="an installed copy: no docs/")


def _doc_blocks(language: str) -> list[str]:
    text = DOC.read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _commands(text: str) -> list[list[str]]:
    """The ``attention-report`` command lines in ``text``, arguments only (continuations
    joined)."""
    lines = text.replace("\\\n", " ").splitlines()
    return [shlex.split(line)[1:] for line in lines if line.strip().startswith("attention-report ")]


def _merge_picks(folders: list[Path], merge: list[str]) -> list[Path]:
    """The shard folders that ``attention-report merge OUT PATTERN...`` names."""
    return [f for f in folders if any(fnmatch.fnmatch(str(f), pattern) for pattern in merge[2:])]


def _documented_shards(command: list[str], environs: list[dict[str, str]]) -> list[Path]:
    """Where the documented command writes under each task's environment, checked to be the
    shards 0..N-1 (N = the number of tasks), one folder each under its --out."""
    out = command[command.index("--out") + 1]
    shards = [parse_shard(command[command.index("--shard") + 1], env) for env in environs]
    count = len(environs)
    assert [(s.index, s.count) for s in shards] == [(k, count) for k in range(count)]
    return [shard.folder(out) for shard in shards]


@needs_doc
def test_the_documented_slurm_array_runs_every_shard_and_merges_them() -> None:
    """docs/campaigns.md's sbatch script: tasks --array=A-B are shards 0..N-1 of its --shard,
    and the merge job's glob picks exactly their folders."""
    array = next(block for block in _doc_blocks("bash") if "#SBATCH --array=" in block)
    first, last = map(int, re.search(r"--array=(\d+)-(\d+)", array).groups())
    tasks = [_slurm(task, first, count=last - first + 1) for task in range(first, last + 1)]
    folders = _documented_shards(_commands(array)[0], tasks)
    merges = [c for block in _doc_blocks("bash") for c in _commands(block) if c[0] == "merge"]
    assert merges and all(_merge_picks(folders, merge) == folders for merge in merges)


@needs_doc
def test_the_documented_indexed_job_runs_every_shard_and_merges_them() -> None:
    """docs/campaigns.md's Indexed Job: its completions are the N of its --shard auto/N, its
    --out is on the shared volume, and the merge Job's glob picks exactly the shard folders."""
    job, merge_job = (block for block in _doc_blocks("yaml") if "kind: Job" in block)
    assert "completionMode: Indexed" in job
    completions = int(re.search(r"completions: (\d+)", job).group(1))
    command = json.loads(re.search(r"args: (\[.*?\])", job, re.S).group(1))
    folders = _documented_shards(command, [{INDEXED: str(k)} for k in range(completions)])
    mount = re.search(r"mountPath: (\S+)", job).group(1)
    assert all(folder.is_relative_to(mount) for folder in folders)
    (merge,) = _commands(json.loads(re.search(r"args: (\[.*?\])", merge_job).group(1))[0])
    assert _merge_picks(folders, merge) == folders
