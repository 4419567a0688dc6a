"""Bad input to ``attention-report`` gives a message naming the field and its rule, exit code 2.

Table-driven, as ``test_argument_validation.py``: one row per malformed invocation or input
file. Every row fails before any case is evaluated, so the whole table runs in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attention_crossval.report.cli import main

pytestmark = pytest.mark.cpu

BROKEN = "attention_crossval.testing.broken"
TINY = ["--preset", "tiny", "--only", "none", "--tier", "streaming", "--no-html", "--no-progress"]

GOOD = {"dtype": "bfloat16", "D": 64, "Sq": 8, "Sk": 8}


def _entry(**changes) -> dict:
    return {key: value for key, value in {**GOOD, **changes}.items() if value is not ...}


# (id, file name, file text, words the message must contain): --config-file inputs.
CONFIG_FILES = [
    ("missing-Sq-Sk", "c.json", json.dumps([_entry(Sq=..., Sk=...)]), ["#0", "Sq", "Sk"]),
    ("missing-in-2nd", "c.json", json.dumps([GOOD, _entry(D=...)]), ["#1", "'D'", "missing"]),
    ("toml-missing-dtype", "c.toml", "[[config]]\nD = 64\nSq = 8\nSk = 8\n", ["#0", "dtype"]),
    ("unknown-key", "c.json", json.dumps([_entry(Dk=3)]), ["#0", "unknown", "Dk"]),
    ("entry-not-object", "c.json", "[5]", ["#0", "object"]),
    ("empty-list", "c.json", "[]", ["non-empty list"]),
    ("json-syntax", "c.json", '[{"dtype": "bfloat16",', ["not valid JSON", "line 1", "column"]),
    ("toml-syntax", "c.toml", "[[config]]\ndtype =\n", ["not valid TOML", "line 2"]),
    ("not-utf8", "c.json", b"\xff\xfe[", ["not valid JSON"]),
]


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [row[1:] for row in CONFIG_FILES],
    ids=[row[0] for row in CONFIG_FILES],
)
def test_bad_config_file_names_file_entry_and_key(tmp_path, capsys, name, text, words):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    message = _fails(capsys, ["--config-file", str(path), "--out", str(tmp_path / "out")])
    assert str(path) in message
    for word in words:
        assert word in message


# (field, its value as JSON text): each makes Config refuse the entry before any case runs.
CONFIG_VALUES = [
    ("seed", '"x"'),
    ("seed", "-1"),
    ("seed", "true"),
    ("seed", "1.5"),
    ("name", "5"),
    ("noise", "true"),
    ("noise", "1e400"),
    ("noise", "-0.5"),
    ("noise", '"0.1"'),
    ("dtype", '["bfloat16"]'),
    ("dtype", '"float64"'),
    ("mask", '["none"]'),
    ("mask", '"nope"'),
    ("distribution", "{}"),
    ("distribution", '"nope"'),
    ("D", "0"),
    ("D", "64.0"),
    ("Sq", "true"),
    ("Hkv", "3"),
    ("Hkv", "0"),
    ("tile_n", "-128"),
]


@pytest.mark.parametrize(
    ("key", "value"), CONFIG_VALUES, ids=[f"{k}={v}" for k, v in CONFIG_VALUES]
)
def test_bad_config_value_names_the_field(tmp_path, capsys, key, value):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([GOOD])[:-2] + f', "{key}": {value}}}]')
    message = _fails(capsys, ["--config-file", str(path), "--out", str(tmp_path / "out")])
    assert f"config.{key}=" in message
    assert f"{path} config #0" in message


@pytest.fixture(scope="module")
def one_report(tmp_path_factory) -> Path:
    """A finished one-config report (streaming tier only: about a second)."""
    out = tmp_path_factory.mktemp("one")
    argv = ["--preset", "tiny", "--only", "none", "--tier", "streaming", "--repeats", "1"]
    assert main([*argv, "--no-html", "--no-progress", "--out", str(out)]) == 0
    return out


def _without(record: dict, key: str) -> dict:
    return {k: v for k, v in record.items() if k != key}


# (id, bad file name, its text from (report, record), words the message must hold).
BAD_REPORTS = [
    (
        "record-without-config",
        "bad.json",
        lambda rep, rec: json.dumps({**rep, "records": [_without(rec, "config")]}),
        ["config"],
    ),
    ("not-a-report", "bad.json", lambda rep, rec: "[1]", ["schema"]),
    ("json-syntax", "bad.json", lambda rep, rec: json.dumps(rep)[:-5], ["line 1", "column"]),
    (
        "jsonl-without-kernel",
        "bad.jsonl",
        lambda rep, rec: json.dumps(_without(rec, "kernel")),
        ["line 1", "kernel"],
    ),
    ("jsonl-torn-line", "bad.jsonl", lambda rep, rec: json.dumps(rec) + "\n{", ["line 2"]),
    (
        "jsonl-two-options",
        "bad.jsonl",
        lambda rep, rec: json.dumps(rec) + "\n" + json.dumps({**rec, "key": rec["key"] + "x"}),
        ["two records", "bf16-d64-q33-k70-none-gaussian"],
    ),
]


@pytest.mark.parametrize("side", ["old", "new"])
@pytest.mark.parametrize(
    ("name", "make", "words"), [row[1:] for row in BAD_REPORTS], ids=[row[0] for row in BAD_REPORTS]
)
def test_diff_names_the_malformed_report(one_report, tmp_path, capsys, side, name, make, words):
    report = json.loads((one_report / "report.json").read_text())
    bad = tmp_path / name
    bad.write_text(make(report, report["records"][0]))
    good = str(one_report / "report.json")
    argv = ["diff", str(bad), good] if side == "old" else ["diff", good, str(bad)]
    message = _fails(capsys, argv)
    assert str(bad) in message
    assert good not in message
    for word in words:
        assert word in message


def test_merge_names_the_malformed_shard(one_report, tmp_path, capsys):
    bad = tmp_path / "report.json"
    bad.write_text("{}")
    message = _fails(capsys, ["merge", str(tmp_path / "out"), str(tmp_path)])
    assert str(bad) in message and "schema_version" in message


# (argv, the option the message must name): {file} an existing file, {dir} a directory,
# {missing} a path that does not exist. Each is refused before a kernel runs.
CLI_ARGS = [
    (["--kernel-timeout", "-1"], "--kernel-timeout"),
    (["--kernel-timeout", "0"], "--kernel-timeout"),
    (["--kernel-timeout", "nan"], "--kernel-timeout"),
    (["--rows", "0"], "--rows"),
    (["--rows", "-3"], "--rows"),
    (["--rows", "x"], "--rows"),
    (["--repeats", "0"], "--repeats"),
    (["--prec-bits", "10"], "--prec-bits"),
    (["--sample", "0"], "--sample"),
    (["--sample", "-2"], "--sample"),
    (["--shard", "3/2"], "--shard"),
    (["--shard", "a/b"], "--shard"),
    (["--shard", "1"], "--shard"),
    (["--shard", "0/2", "--gpus", "0"], "--gpus"),
    (["--preset", "nope"], "--preset"),
    (["--preset", "tiny", "--sample", "2"], "--sample"),
    (["--tier", "nope"], "--tier"),
    (["--isolate", "sometimes"], "--isolate"),
    (["--preset", "tiny", "--only", "no-such-config"], "--only"),
    (["--config-file", "{missing}"], "--config-file"),
    (["--config-file", "{dir}"], "--config-file"),
    (["--out", "{file}"], "--out"),
    (["--out", ""], "--out"),
    (["--kernel", "no-such-kernel"], "kernel="),
    (["--kernel", "streaming-fa", "--kernel", "streaming-fa"], "kernels="),
    (["--gpus", ","], "--gpus"),
    (["diff", "{file}"], "new"),
    (["diff", "{missing}", "{file}"], "old"),
    (["diff", "{file}", "{dir}"], "new"),
    (["diff", "{file}", "{file}", "--rel-increase", "-1"], "--rel-increase"),
    (["diff", "{file}", "{file}", "--min-increase", "nan"], "--min-increase"),
    (["diff", "{file}", "{file}", "--out", "{dir}"], "--out"),
    (["merge", "{file}", "{dir}"], "out"),
    (["merge", "{dir}", "{missing}"], "missing"),
    # issue 9, section 5: each used to end in a traceback or never return
    (["--prec-bits", "1023"], "--prec-bits"),  # OverflowError in exact._finish_row
    (["--prec-bits", "961"], "--prec-bits"),
    (["--sample", str(10**30)], "--sample"),  # drew 10**30 cases: never returned
    (["--repeats", "101"], "--repeats"),
    (["--kernel-timeout", "1e300"], "--kernel-timeout"),  # OverflowError in the pipe's poll
    (["--kernel-start-timeout", "0"], "--kernel-start-timeout"),
    (["--kernel", f"{BROKEN}.fails_at_import:x"], "ZeroDivisionError"),  # a traceback
    (["--kernel", f"{BROKEN}.cpu_faults:bad_spec"], "must be a KernelSpec"),  # AttributeError
    (["--kernel", f"{BROKEN}.cpu_faults:factory_segfaults"], "killed by SIGSEGV"),  # run ended
]


@pytest.mark.parametrize(("argv", "option"), CLI_ARGS, ids=[" ".join(a) for a, _ in CLI_ARGS])
def test_bad_option_names_the_option(tmp_path, capsys, argv, option):
    (tmp_path / "file").write_text("{}")
    (tmp_path / "dir").mkdir()
    where = {name: str(tmp_path / name) for name in ("file", "dir", "missing")}
    message = _fails(capsys, [arg.format(**where) for arg in argv])
    assert option in message.splitlines()[-1]


DEEP = "[" * 100_000 + "]" * 100_000  # RecursionError in json and tomllib


@pytest.mark.parametrize(
    ("name", "text"),
    [("c.json", DEEP), ("c.toml", f"a = {DEEP}"), ("c.json", "[" * 900 + "]" * 900)],
    ids=["json", "toml", "json-900"],
)
def test_deeply_nested_config_file_is_refused(tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    message = _fails(capsys, ["--config-file", str(path), "--out", str(tmp_path / "out")])
    assert str(path) in message


@pytest.mark.parametrize("command", ["diff-old", "diff-new", "merge", "resume"])
def test_deeply_nested_report_is_refused(one_report, tmp_path, capsys, command):
    """Regression: RecursionError from diff, merge and resume on a deeply nested JSON file."""
    good = str(one_report / "report.json")
    bad = tmp_path / ("records.jsonl" if command == "resume" else "report.json")
    # merge: parses (200 levels), then refused by depth; the others: RecursionError in json
    bad.write_text('{"a": ' * 200 + "1" + "}" * 200 if command == "merge" else DEEP)
    argv = {
        "diff-old": ["diff", str(bad), good],
        "diff-new": ["diff", good, str(bad)],
        "merge": ["merge", str(tmp_path / "out"), str(tmp_path)],
        "resume": [*TINY, "--out", str(tmp_path)],
    }[command]
    message = _fails(capsys, argv)
    assert str(bad) in message
    assert "nested deeper than 64 levels" in message or "is not JSON" in message


def _record_without_primary_pair(one_report: Path) -> dict:
    record = json.loads((one_report / "report.json").read_text())["records"][0]
    return {**record, "primary_pair": "kernel_vs_exact"}  # the run compared streaming only


def test_diff_refuses_a_record_without_its_primary_pair(one_report, tmp_path, capsys):
    """Regression: a schema-valid record whose primary_pair named no pair: KeyError in diff."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_record_without_primary_pair(one_report)) + "\n")
    message = _fails(capsys, ["diff", str(bad), str(one_report / "report.json")])
    assert f"{bad} line 1" in message and "primary_pair" in message


def test_merge_refuses_a_record_without_its_primary_pair(one_report, tmp_path, capsys):
    report = json.loads((one_report / "report.json").read_text())
    report["shard"] = {"index": 0, "count": 1, "cuda_visible_devices": None}
    report["records"] = [_record_without_primary_pair(one_report)]
    (tmp_path / "report.json").write_text(json.dumps(report))
    message = _fails(capsys, ["merge", str(tmp_path / "out"), str(tmp_path)])
    assert "$.records[0]" in message and "primary_pair" in message


@pytest.mark.parametrize("line", ["5", "[]", "{}", '{"key": 1}', "null"])
def test_resume_refuses_a_json_line_that_is_not_a_record(tmp_path, capsys, line):
    """Regression: such a line in records.jsonl raised TypeError/KeyError on every rerun."""
    (tmp_path / "records.jsonl").write_text(line + "\n")
    message = _fails(capsys, [*TINY, "--out", str(tmp_path)])
    assert "records.jsonl line 1 does not match schema.json" in message
    assert "--fresh" in message
    assert main([*TINY, "--out", str(tmp_path), "--fresh"]) == 0


def test_resume_drops_a_torn_line(one_report, tmp_path):
    """A line cut short by an interrupted write is not JSON: the run redoes that record."""
    records = (one_report / "records.jsonl").read_text()
    (tmp_path / "records.jsonl").write_text(records[: len(records) // 2])
    assert main([*TINY, "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["resumed_records"] == 0 and report["summary"]["records"] == 1


def test_second_run_into_a_locked_out_is_refused(tmp_path, capsys):
    """Regression: two runs into one --out both did all the work and duplicated records."""
    from attention_crossval.report.session import output_lock

    with output_lock(tmp_path):
        message = _fails(capsys, [*TINY, "--out", str(tmp_path)])
        assert f"--out {tmp_path} is in use by another attention-report run (pid " in message
        assert not (tmp_path / "records.jsonl").exists()
    assert main([*TINY, "--out", str(tmp_path)]) == 0  # released with the holder


def _damaged(content: bytes, damage: str) -> bytes:
    if damage == "truncated":  # BadZipFile
        return content[:100]
    flagged = bytearray(content)  # flag bit 5 in the central directory: NotImplementedError
    flagged[content.index(b"PK\x01\x02") + 8] |= 0x20
    return bytes(flagged)


@pytest.mark.parametrize("damage", ["truncated", "patched-flag"])
def test_corrupted_cache_entry_is_a_miss_and_fresh_clears_the_cache(tmp_path, damage):
    """Regression: a corrupted cache/exact/*.npz raised BadZipFile on every rerun (and a
    damaged header flag NotImplementedError), and --fresh kept the cache."""
    argv = ["--preset", "tiny", "--only", "none", "--rows", "2", "--repeats", "1", "--no-html"]
    argv += ["--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    (entry,) = (tmp_path / "cache" / "exact").glob("*.npz")
    entry.write_bytes(_damaged(entry.read_bytes(), damage))
    (tmp_path / "records.jsonl").unlink()  # force a recomputation through the cache
    assert main(argv) == 0
    assert json.loads((tmp_path / "report.json").read_text())["exact_cache"] == {
        "hits": 0,
        "misses": 1,
    }
    np.load(entry).close()  # rewritten: readable again
    stale = entry.with_name("stale.npz")
    stale.write_bytes(b"junk")
    assert main([*argv, "--fresh"]) == 0
    assert not stale.exists()
    assert json.loads((tmp_path / "report.json").read_text())["exact_cache"]["misses"] == 1


def test_two_cache_writers_of_one_key_both_succeed(tmp_path, monkeypatch):
    """Regression: every writer used one temporary name, so of two runs writing one entry the
    second's os.replace found its file gone (or wrote into the first's final file)."""
    import threading

    from attention_crossval.reference.case import AttentionCase
    from attention_crossval.reference.exact import sample_rows
    from attention_crossval.report import cache as cache_module

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, s, 1, 8)).astype(np.float16) for s in (2, 3, 3))
    case = AttentionCase(q, k, v)
    rows = sample_rows(case, 2)
    both_writing = threading.Barrier(2, timeout=60)
    savez = np.savez

    def savez_together(*args, **kwargs):
        both_writing.wait()  # both writers are between computing and publishing the entry
        savez(*args, **kwargs)

    monkeypatch.setattr(cache_module.np, "savez", savez_together)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            cache_module.ExactCache(tmp_path).get(case, rows, 128)
        except BaseException as error:  # noqa: BLE001 - collected for the assertion below
            errors.append(error)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    monkeypatch.undo()
    assert errors == []
    (entry,) = tmp_path.glob("*.npz")  # no temporary file left behind
    assert cache_module.ExactCache(tmp_path).get(case, rows, 128).o.shape == (1, 2, 1, 8)


@pytest.mark.parametrize(
    ("fault", "check", "timeout"),
    [
        ("sys_exit", "crash", "30"),  # ended the run with exit 0, 0 records, no report
        ("segfault", "crash", "30"),
        ("hang", "timeout", "3"),  # ignored --kernel-timeout
        ("wrong_shape", "shape", "30"),  # exit 2 and no report.json, on every rerun
        ("writes_inputs", "input-write", "30"),  # passed
    ],
)
def test_faulty_cpu_kernel_is_a_finding_not_the_end_of_the_run(tmp_path, fault, check, timeout):
    argv = [*TINY, "--kernel", f"{BROKEN}.cpu_faults:{fault}", "--kernel-timeout", timeout]
    assert main([*argv, "--out", str(tmp_path)]) == 1  # the report is written; the record failed
    (record,) = json.loads((tmp_path / "report.json").read_text())["records"]
    assert [f["check"] for f in record["findings"]] == [check]
    assert record["kernel"]["isolated"] is True
    assert record["verdict"] in ("fail", "error")


def test_repeated_tier_is_one_tier(tmp_path):
    argv = ["--preset", "tiny", "--only", "none", "--tier", "streaming", "--tier", "streaming"]
    assert (
        main([*argv, "--repeats", "1", "--no-html", "--no-progress", "--out", str(tmp_path)]) == 0
    )
    assert json.loads((tmp_path / "report.json").read_text())["options"]["tiers"] == ["streaming"]


def _fails(capsys, argv: list[str]) -> str:
    """Run the CLI, assert exit code 2 with no traceback; return stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refuses at parse time
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err
