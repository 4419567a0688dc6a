"""Fuzz of the entry points users feed: only ValueError (API) or exit 2 with one line (CLI).

Each test throws malformed input at one entry point: ``attention-report`` options and config
files, ``diff`` / ``merge`` / resume on mutated reports and records, ``replay`` on mutated case
files, and the kernel names and timeouts of the registry and the worker. Valid draws run for
real (a one-config streaming-tier report, a 3x5 case), so every example stays well under a
second; ``max_examples`` is lowered where an example runs a report.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.kernel.harness.registry import factory_path
from attention_crossval.properties import replay
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.file_names import safe_file_name, safe_part
from attention_crossval.report.cli import main

pytestmark = pytest.mark.cpu

TINY = ["--preset", "tiny", "--only", "none", "--tier", "streaming", "--no-html", "--no-progress"]
DEEP = "[" * 5000 + "]" * 5000
NUMBERS = ["0", "-1", "1", "3", "64", "961", "1023", "1e300", "nan", "inf", "-0", str(10**30)]
WORDS = ["", "x", "none", "0/2", "1/1", "3/2", "a/b", ",", "all", "streaming", "exact"]
TEXT = st.sampled_from(NUMBERS + WORDS) | st.text(max_size=6)
OPTIONS = [
    "--rows",
    "--prec-bits",
    "--repeats",
    "--sample",
    "--sample-seed",
    "--kernel-timeout",
    "--kernel-start-timeout",
    "--shard",
    "--only",
    "--tier",
    "--preset",
    "--isolate",
]
# Sinks at and past the float32 range: 1e9 took minutes in the exact tier, 1e12 MemoryError, 3e38
# OverflowError (every rerun of a report or a saved case a traceback).
SINKS = st.sampled_from([2.0, 1e9, 1e12, 3e38, -3e38, 1e39, math.inf, -math.inf, math.nan])
# Stands for a list nested 5000 deep (RecursionError in parsers and repr): drawn as this token
# so Hypothesis can print a failing example, and made real where it is used.
DEEP_TOKEN = "<5000 nested lists>"
JUNK = st.sampled_from(
    [None, True, -1, 0, 1.5, 10**30, "x", "", [], {}, [[1]], math.nan, DEEP_TOKEN]
)


def _real(value: Any) -> Any:
    """``value``, with :data:`DEEP_TOKEN` made a list nested 5000 deep (no recursion)."""
    if value != DEEP_TOKEN:
        return value
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    return nested


def _run(entry: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    """``entry(argv)``'s exit code and stderr; argparse's exits included."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = entry(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


def _assert_clean_exit(code: int, err: str, ok: tuple[int, ...] = (0,)) -> None:
    """``code`` is a success code, or 2 with one error line (argparse adds its usage above)."""
    assert "Traceback" not in err, err
    if code in ok:
        return
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert lines and "error:" in lines[-1], err
    assert len(lines) == 1 or lines[0].startswith("usage:"), err


def _junk_json(value: Any) -> str:
    """JSON text of ``value``, each :data:`DEEP_TOKEN` written as 5000 nested lists."""
    return json.dumps(value).replace(json.dumps(DEEP_TOKEN), DEEP)


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(
    options=st.lists(st.tuples(st.sampled_from(OPTIONS), TEXT), max_size=3),
    config=st.none()
    | st.lists(
        st.fixed_dictionaries(
            {"dtype": st.sampled_from(["float16", "bfloat16"]) | JUNK},
            optional={
                "D": st.sampled_from([16, 32]) | JUNK,
                "Sq": st.integers(1, 24) | JUNK,
                "Sk": st.integers(1, 24) | JUNK,
                "B": st.integers(1, 2) | JUNK,
                "mask": st.sampled_from(["none", "causal", "varlen"]) | JUNK,
                "sink": SINKS | JUNK,
                "extra": JUNK,
            },
        ),
        max_size=2,
    ).map(_junk_json)
    | st.sampled_from([DEEP, "a = " + DEEP, "[[config]]\ndtype =", "\xff"]),
    fresh=st.booleans(),
)
def test_report_cli_exits_0_1_or_2_with_one_line(
    options: list[tuple[str, str]], config: str | None, fresh: bool
) -> None:
    """0: every record passed; 1: a record failed (a drawn sink past float32's range overflows
    streaming-fa's own chain, as a real kernel's); 2: refused with one line. Never a traceback."""
    with tempfile.TemporaryDirectory() as out:
        argv = [*TINY, "--repeats", "1", "--out", out]
        if config is not None:
            path = Path(out) / ("c.toml" if config.startswith(("a =", "[[")) else "c.json")
            path.write_text(config)
            argv = [a for a in argv if a not in ("--preset", "tiny")] + ["--config-file", str(path)]
        argv += [part for pair in options for part in pair] + (["--fresh"] if fresh else [])
        code, err = _run(main, argv)
    event(f"exit {code}")
    _assert_clean_exit(code, err, ok=(0, 1))


@pytest.mark.parametrize("sink", ["1e9", "1e12", "3e38", "-3e38", "3.4028234663852886e38"])
def test_report_with_a_huge_sink_runs_the_exact_tier_in_seconds(sink: str, tmp_path) -> None:
    """Through --config-file: the exact tier's sink of 3e38 was an OverflowError traceback."""
    path = tmp_path / "c.toml"
    path.write_text(f'[[config]]\ndtype = "float16"\nD = 16\nSq = 8\nSk = 8\nsink = {sink}\n')
    argv = ["--config-file", str(path), "--tier", "exact", "--no-html", "--no-progress"]
    with np.errstate(all="ignore"):  # the fp32 chain's sink * log2(e) overflows, as a kernel's
        code, err = _run(main, [*argv, "--repeats", "1", "--out", str(tmp_path / "out")])
    _assert_clean_exit(code, err, ok=(0, 1))
    # Past about 1.5e38 the float32 chain of streaming-fa (the kernel here) overflows forming
    # the sink's log2 value, as a real kernel's would: a failing record, so exit 1.
    assert code == (1 if float(sink) > 1e38 else 0)
    records = (tmp_path / "out" / "records.jsonl").read_text().splitlines()
    assert len(records) == 1  # the exact tier finished its record


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished one-config report (streaming tier, about a second)."""
    out = tmp_path_factory.mktemp("finished")
    assert main([*TINY, "--repeats", "1", "--out", str(out)]) == 0
    return out


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) into a parsed JSON value, the root included."""
    paths, stack = [], [(value, prefix)]
    while stack:
        item, path = stack.pop()
        paths.append(path)
        if isinstance(item, (dict, list)):
            children = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((child, (*path, key)) for key, child in children)
    return paths


@st.composite
def mutated(draw, document: Any) -> Any:
    """``document`` with one place deleted or replaced by junk; one in four draws replaces
    the whole document (deep nesting there is what the parsers choke on)."""
    copy = json.loads(json.dumps(document))
    path = draw(st.sampled_from(_paths(copy)))
    if not path or draw(st.integers(0, 3)) == 0:
        return draw(st.just(DEEP_TOKEN) | JUNK)
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(JUNK | st.sampled_from(["kernel_vs_exact", "ok", "pass"]))
    return copy


@settings(max_examples=30)  # a resume example runs a one-config report
@given(data=st.data(), command=st.sampled_from(["diff", "diff-jsonl", "merge", "resume"]))
def test_diff_merge_resume_on_mutated_reports(finished: Path, data, command: str) -> None:
    report = json.loads((finished / "report.json").read_text())
    if command == "merge":
        report["shard"] = {"index": 0, "count": 1, "cuda_visible_devices": None}
    target = report if command in ("diff", "merge") else report["records"][0]
    bad = _junk_json(data.draw(mutated(target), label="mutated"))
    good = str(finished / "report.json")
    with tempfile.TemporaryDirectory() as folder:
        name = "report.json" if command in ("diff", "merge") else "records.jsonl"
        path = Path(folder) / name
        path.write_text(bad + "\n")
        argv = {
            "diff": ["diff", good, str(path)],
            "diff-jsonl": ["diff", str(path), good],
            "merge": ["merge", str(Path(folder) / "out"), folder],
            "resume": [*TINY, "--repeats", "1", "--out", folder],
        }[command]
        code, err = _run(main, argv)
    event(f"{command}: exit {code}")
    _assert_clean_exit(code, err, ok=(0, 1))  # diff: 1 is a regression found


@pytest.fixture(scope="module")
def saved_case(tmp_path_factory) -> bytes:
    """The bytes of a small saved case (3x5, varlen, causal)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, s, 2, 8)).astype(np.float16) for s in (3, 5, 5))
    case = AttentionCase(q, k, v, mask=Mask(causal=True, k_lengths=(4,)), label="tile_n=4")
    path = case.save(tmp_path_factory.mktemp("case") / "case.npz")
    return path.read_bytes()


def _rewrite(data: bytes, key: str, value: Any) -> bytes:
    """The case file with ``key`` replaced by ``value`` (None: removed)."""
    with np.load(io.BytesIO(data)) as arrays:
        fields = {name: arrays[name] for name in arrays.files if name != key}
    if value is not None:
        fields[key] = value
    out = io.BytesIO()
    np.savez(out, **fields)
    return out.getvalue()


FIELD_JUNK = st.sampled_from(
    [
        np.array("float64"),
        np.array([]),
        np.array([1, 2, 3]),
        np.array([[-1, 2]]),
        np.zeros((2, 2), np.float32),
        np.array(True),
        np.array("tile_n=0"),
        np.array("tile_n=x"),
        np.full((1, 3, 2, 8), np.nan, np.float16),
        np.array(10**18),
        # scalars out of every range: inf in window/lengths/page_size/num_splits raised
        # OverflowError (int(inf)) before the fields were checked
        np.array(np.inf),
        np.array(-np.inf),
        np.array(np.nan),
        np.array([np.inf, -1.0]),
        np.array([np.nan]),
        np.array(-5),
        np.array(2.5),
        np.array([2.5]),
        np.array([-3]),
        np.array(2**62),
        np.array([2**62, 0]),
        np.array(3e38, np.float32),
        np.full((1, 3, 2, 8), 1.0, ">f2"),
        np.array([3e38, -3e38], np.float32),  # as the sink: the exact tier's analytic branch
        np.array([1e12, 1e9], np.float32),
    ]
)
# Every field a saved case may hold.
CASE_FIELDS = ["q", "k", "v", "dtype", "softmax_scale", "causal", "alignment", "window"]
CASE_FIELDS += ["q_lengths", "k_lengths", "label", "explicit", "softcap", "sink", "page_size"]
CASE_FIELDS += ["num_splits", "layout", "page_fill"]


@given(
    data=st.data(),
    how=st.sampled_from(["truncate", "flip", "field", "drop", "missing", "directory", "valid"]),
    rows=st.none() | st.sampled_from(["0", "-1", "1", "2", "x", str(10**30)]),
    block=st.none() | st.sampled_from(["0", "4", "-4", str(10**9)]),
)
def test_replay_exits_0_or_2_with_one_line(saved_case: bytes, data, how, rows, block) -> None:
    content = saved_case
    keys = CASE_FIELDS
    if how == "truncate":
        content = content[: data.draw(st.integers(0, len(content) - 1))]
    elif how == "flip":
        index = data.draw(st.integers(0, len(content) - 1))
        content = content[:index] + bytes([content[index] ^ 0xFF]) + content[index + 1 :]
    elif how == "field":
        content = _rewrite(content, data.draw(st.sampled_from(keys)), data.draw(FIELD_JUNK))
    elif how == "drop":
        content = _rewrite(content, data.draw(st.sampled_from(keys)), None)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "case.npz"
        if how == "directory":
            path.mkdir()
        elif how != "missing":
            path.write_bytes(content)
        argv = (
            [str(path)] + (["--rows", rows] if rows else []) + (["--block-n", block] * bool(block))
        )
        code, err = _run(replay.main, argv)
    event(f"{how}: exit {code}")
    _assert_clean_exit(code, err)


@pytest.mark.parametrize("offset, bits", [(8, 0x20), (6, 0xFF)], ids=["patched-flag", "version"])
def test_replay_names_a_zip_header_it_cannot_read(
    saved_case: bytes, offset, bits, tmp_path
) -> None:
    """Regression (fuzzed, seed 302): one damaged byte in the central directory made zipfile
    raise NotImplementedError ("compressed patched data", "zip file version 21.0"), which
    escaped replay as a traceback instead of one line naming the file."""
    header = saved_case.index(b"PK\x01\x02")  # the first central-directory entry
    content = bytearray(saved_case)
    content[header + offset] |= bits
    path = tmp_path / "case.npz"
    path.write_bytes(bytes(content))
    code, err = _run(replay.main, [str(path)])
    _assert_clean_exit(code, err)
    assert code == 2 and "is not a case written by AttentionCase.save" in err, err


@given(name=st.text(max_size=8) | JUNK, timeout=JUNK | st.floats(allow_nan=True))
def test_kernel_names_and_timeouts_raise_only_value_error(name: Any, timeout: Any) -> None:
    """A bad name or timeout is refused before any process starts; what is accepted is well
    formed (a ``module:attr`` path, a finite positive time limit)."""
    try:
        path = factory_path(_real(name))
    except ValueError:
        pass
    else:
        module, _, attr = path.partition(":")
        assert module and attr, path
    try:
        kernel = IsolatedKernel("streaming-fa", timeout_s=_real(timeout))
    except ValueError:
        pass
    else:
        assert math.isfinite(kernel.timeout_s) and kernel.timeout_s > 0, kernel.timeout_s
        kernel.close()  # never started


@given(name=st.text(max_size=300) | st.sampled_from(["../../x", "a/b", "..", "", "x" * 300]))
def test_kernel_names_become_one_file_inside_the_folder(name: str) -> None:
    """Any kernel name gives one file name directly inside the folder (traversal, separators,
    unicode, empty, 300 characters), and a changed name never takes a safe name's place."""
    file_name = safe_file_name(name, "bound", "0123456789abcdef", suffix=".npz")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / file_name
        path.write_bytes(b"")
        assert [p.name for p in Path(folder).iterdir()] == [file_name]
    assert safe_part(name) == name or "~" in safe_part(name)


def _corrupt_member(data: bytes) -> bytes:
    """The case's zip with q.npy cut in half (BadZipFile / zlib.error when read)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            payload = source.read(name)
            target.writestr(name, payload[: len(payload) // 2] if name == "q.npy" else payload)
    return out.getvalue()


# (id, file content from the saved case's bytes or None for no file, extra argv, message part):
# malformed input to replay, each once a traceback.
REPLAY_INPUTS = [
    ("missing-path", None, [], "must be an existing .npz file"),
    ("empty-file", lambda data: b"", [], "is not a case written by AttentionCase.save"),
    ("truncated", lambda data: data[: len(data) // 2], [], "is not a case"),
    ("corrupt-member", _corrupt_member, [], "is not a case"),
    ("foreign-npz", lambda data: _rewrite(data, "dtype", None), [], "field dtype is missing"),
    (
        "nan-in-q",
        lambda data: _rewrite(data, "q", np.full((1, 3, 2, 8), np.nan, np.float16)),
        [],
        "q must be finite",
    ),
    ("tile-label", lambda data: _rewrite(data, "label", np.array("tile_n=0")), [], "tile_n"),
    *(
        (f"{key}-{text}", lambda data, key=key, value=value: _rewrite(data, key, value), [], rule)
        for key, rule in (
            ("window", "window"),
            ("q_lengths", "q_lengths"),
            ("k_lengths", "k_lengths"),
        )
        for text, value in (
            ("inf", np.array([np.inf, -1.0])),
            ("nan", np.array([np.nan, np.nan])),
            ("negative", np.array([-7, -7])),
            ("fraction", np.array([1.5, 2.0])),
        )
    ),
    *(
        (f"{key}-{text}", lambda data, key=key, value=value: _rewrite(data, key, value), [], rule)
        for key, rule in (("page_size", "page_size"), ("num_splits", "num_splits"))
        for text, value in (
            ("inf", np.array(np.inf)),
            ("nan", np.array(np.nan)),
            ("negative", np.array(-2)),
            ("fraction", np.array(1.5)),
            ("huge", np.array(2**62)),
            ("vector", np.array([2, 2])),
        )
    ),
    (
        "softmax-scale-inf",
        lambda data: _rewrite(data, "softmax_scale", np.array(np.inf)),
        [],
        "softmax_scale=inf must be > 0",
    ),
    (
        "causal-text",
        lambda data: _rewrite(data, "causal", np.array("yes")),
        [],
        "field causal must hold bool",
    ),
    (
        "q-float64",
        lambda data: _rewrite(data, "q", np.zeros((1, 3, 2, 8))),
        [],
        "field q must be a rank-4 array of float16 values",
    ),
    ("rows-0", lambda data: data, ["--rows", "0"], "--rows"),
    ("block-n-huge", lambda data: data, ["--block-n", str(10**9)], "--block-n"),
]


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [row[1:] for row in REPLAY_INPUTS],
    ids=[row[0] for row in REPLAY_INPUTS],
)
def test_replay_refuses_malformed_input(saved_case: bytes, tmp_path, content, extra, message):
    path = tmp_path / "case.npz"
    if content is not None:
        path.write_bytes(content(saved_case))
    code, err = _run(replay.main, [str(path), *extra])
    _assert_clean_exit(code, err)
    assert code == 2 and message in err.strip().splitlines()[-1]
