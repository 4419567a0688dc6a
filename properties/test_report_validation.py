"""Bad input to ``attention-report`` gives a message naming the field and its rule, exit code 2.

Table-driven, as ``test_argument_validation.py``: one row per malformed invocation or input
file. Every row fails before any case is evaluated, so the whole table runs in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attention_crossval.report.cli import main

pytestmark = pytest.mark.cpu

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
]


@pytest.mark.parametrize(("argv", "option"), CLI_ARGS, ids=[" ".join(a) for a, _ in CLI_ARGS])
def test_bad_option_names_the_option(tmp_path, capsys, argv, option):
    (tmp_path / "file").write_text("{}")
    (tmp_path / "dir").mkdir()
    where = {name: str(tmp_path / name) for name in ("file", "dir", "missing")}
    message = _fails(capsys, [arg.format(**where) for arg in argv])
    assert option in message.splitlines()[-1]


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
