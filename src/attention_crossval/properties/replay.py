"""Replay a saved case: ``python -m attention_crossval.properties.replay CASE.npz``.

A failing property saves its case (``AttentionCase.save``, or ``BackwardCase.save`` for the
backward suite) and prints this command. When the case was saved for a kernel, the file holds
the kernel's ``--kernel`` spelling and the replay reruns that kernel (``--kernel`` names another)
through the same harness checks as the suite, on the pass the case was saved for (forward, or
backward when the file holds dO), prints the findings, and exits 1 while any is not a known
finding, 0 when it passes. ``--references-only`` (and a case saved without a kernel) checks the
reference tiers on the case's forward pass instead. Cases go to ``$ATTENTION_REPORT_DIR`` (the
pytest plugin sets it from ``--report-dir``), else ``<tmp>/attention-cases``; file names are
content hashes. A failing property runs many failing cases while Hypothesis shrinks (one run saved
90), so :func:`save_failing_case` keeps at most :data:`CASES_PER_TEST` per test: the first ones,
and in the last slot always the latest case, which is the shrunk one (Hypothesis replays it last).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from attention_crossval.kernel.harness.saved_cases import KERNEL_FIELD, store_kernel
from attention_crossval.reference.bounds import error_bound
from attention_crossval.reference.case import MAX_ELEMENTS, AttentionCase
from attention_crossval.reference.compare import compare
from attention_crossval.reference.exact import exact_attention, sample_rows
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention


def case_directory() -> Path:
    """Where failing cases are written (``$ATTENTION_REPORT_DIR`` or a temp folder)."""
    configured = os.environ.get("ATTENTION_REPORT_DIR")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "attention-cases"


def save_case(
    case: AttentionCase | BackwardCase,
    directory: str | Path | None = None,
    *,
    kernel: str | None = None,
) -> Path:
    """Write ``case`` as ``case-<sha1 of its inputs and kernel>.npz`` under ``directory`` and
    return the path; ``kernel`` (the ``--kernel`` spelling) is stored in the file for
    :func:`main` to rerun."""
    directory = Path(directory) if directory is not None else case_directory()
    directory.mkdir(parents=True, exist_ok=True)
    forward = case.forward if isinstance(case, BackwardCase) else case
    digest = hashlib.sha1(f"{forward.describe()}|{kernel or ''}".encode())
    arrays = [forward.q, forward.k, forward.v, forward.mask.explicit]
    if isinstance(case, BackwardCase):
        arrays.append(case.do)
    for array in arrays:
        if array is not None:
            digest.update(array.tobytes())
    kind = "backward-" if isinstance(case, BackwardCase) else ""
    path = case.save(directory / f"case-{kind}{digest.hexdigest()[:16]}.npz")
    return path if kernel is None else store_kernel(path, kernel)


def saved_for(path: Path) -> tuple[str, str | None]:
    """``(pass, kernel)`` of a saved case: "backward" when the file holds dO, else "forward";
    the kernel it was saved for, or None. ValueError naming the file if it is not an .npz."""
    _require_file(path)
    try:
        with path.open("rb") as stream, np.load(stream) as data:
            kernel = str(data[KERNEL_FIELD]) if KERNEL_FIELD in data.files else None
            return ("backward" if "do" in data.files else "forward"), kernel
    except _NOT_A_CASE as error:
        raise _not_a_case(path, error) from None


CASES_PER_TEST = 5
_saved: dict[str, list[Path]] = {}


def current_test() -> str:
    """The running pytest test's id (``$PYTEST_CURRENT_TEST`` less its phase), or ""."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def save_failing_case(
    case: AttentionCase | BackwardCase,
    directory: str | Path | None = None,
    *,
    test: str | None = None,
    kernel: str | None = None,
) -> Path:
    """:func:`save_case`, keeping at most :data:`CASES_PER_TEST` files per ``test`` (default:
    the running pytest test): once full, the newest case replaces the previous newest, so the
    last failing case (Hypothesis' shrunk one) is always on disk. A file another test also
    saved is never deleted. ``kernel`` is stored with the case (:func:`save_case`)."""
    path = save_case(case, directory, kernel=kernel)
    kept = _saved.setdefault(current_test() if test is None else test, [])
    if path in kept:
        return path
    if len(kept) == CASES_PER_TEST:
        dropped = kept.pop()
        if not any(dropped in others for others in _saved.values()):
            dropped.unlink(missing_ok=True)
    kept.append(path)
    return path


def replay_command(path: str | Path) -> str:
    """The one-line shell command that replays the case saved at ``path``."""
    return f"python -m attention_crossval.properties.replay {path}"


REPRODUCE_NOTE = "reproduce: "  # the note :func:`reproducer_on_failure` adds to a failure


def noted_cases(error: BaseException) -> list[Path]:
    """The saved cases named by the ``reproduce:`` notes of ``error`` and of the exceptions an
    exception group holds (Hypothesis' distinct failures), in order, each once."""
    prefix = REPRODUCE_NOTE + replay_command("")
    found = [
        Path(note.removeprefix(prefix))
        for note in getattr(error, "__notes__", ())
        if isinstance(note, str) and note.startswith(prefix)
    ]
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found += noted_cases(inner)
    return list(dict.fromkeys(found))


@contextlib.contextmanager
def reproducer_on_failure(
    case: AttentionCase | BackwardCase,
    directory: str | Path | None = None,
    *,
    kernel: str | None = None,
) -> Iterator[None]:
    """On any exception inside the block, save ``case`` (:func:`save_failing_case`, with the
    ``kernel`` it failed for, whose rerun the replay then is) and add the replay command as a
    note (shown under the traceback), then re-raise. Costs nothing when the block passes."""
    try:
        yield
    except Exception as exc:
        path = save_failing_case(case, directory, kernel=kernel)
        exc.add_note(REPRODUCE_NOTE + replay_command(path))
        raise


def tile_from_label(case: AttentionCase, default: int) -> int:
    """The ``tile_n=<n>`` an ``attention_cases`` case was drawn around, else ``default``."""
    for part in case.label.split():
        if part.startswith("tile_n="):
            text = part.removeprefix("tile_n=")
            if not text.isdigit() or not 1 <= int(text) <= MAX_BLOCK:
                raise ValueError(
                    f"label {part!r} must give an integer tile_n in [1, {MAX_BLOCK}] "
                    "(or pass --block-n)"
                )
            return int(text)
    return default


def replay(case: AttentionCase, *, block_m: int, block_n: int, rows: int | None = None) -> str:
    """Exact tier vs the streaming tier (float64 mode, and the FlashAttention chain of the
    case's dtype with its derived bound); returns the report as text."""
    selected = None if rows is None else sample_rows(case, rows)
    exact = exact_attention(case, selected)
    lines = [case.describe()]
    for name, precision in (
        ("streaming float64", StreamingPrecision.float64()),
        (f"streaming {case.dtype} chain", StreamingPrecision.flash_attention(case.dtype)),
    ):
        result = streaming_attention(case, precision, block_m=block_m, block_n=block_n)
        bound = error_bound(case, exact.as_result(), precision, block_n=block_n)
        dtype = precision.output_dtype or precision.accum_dtype
        report = compare(result, exact, bound=bound, output_dtype=dtype, rows=selected)
        lines.append(f"{name} (block {block_m}x{block_n}): {report.summary()}")
    return "\n".join(lines)


# What reading a file that is not a saved case raises (missing keys, truncated or foreign zip,
# a field of the wrong type or shape); each becomes one line naming the file. zipfile raises
# NotImplementedError for a header it cannot read (a "zip version" or flag bit a damaged byte
# sets: found by test_replay_exits_0_or_2_with_one_line).
_NOT_A_CASE = (
    OSError,
    EOFError,
    MemoryError,
    KeyError,
    ValueError,
    TypeError,
    IndexError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)
MAX_BLOCK = 1 << 16  # --block-m / --block-n: larger tiles than any kernel's


def load_case(path: Path) -> AttentionCase:
    """``AttentionCase.load(path)``, or ValueError naming the file and why it is not a case."""
    _require_file(path)
    try:
        with path.open("rb") as stream:  # closed here when np.load fails half-way
            return AttentionCase.load(stream)
    except _NOT_A_CASE as error:
        raise _not_a_case(path, error) from None


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"{path} must be an existing .npz file written by AttentionCase.save")


def _not_a_case(path: Path, error: Exception) -> ValueError:
    """The one-line refusal of a file that did not read as a saved case."""
    reason = str(error).splitlines()[0] if str(error) else ""
    return ValueError(
        f"{path} is not a case written by AttentionCase.save ({type(error).__name__}: {reason})"
    )


def _positive(maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be an integer in [1, {maximum}]")
        return value

    return parse


@contextlib.contextmanager
def rerun_kernel(kernel: str) -> Iterator[Any]:
    """The adapter that reruns ``kernel`` on a saved case, as the suite runs it: in this process
    for the in-process built-ins, else in a worker process (closed on leaving). ValueError when
    the kernel cannot load."""
    from attention_crossval.kernel.harness.isolation import IsolatedKernel
    from attention_crossval.kernel.harness.registry import IN_PROCESS, resolve

    adapter = resolve(kernel) if kernel in IN_PROCESS else IsolatedKernel(kernel, timeout_s=300.0)
    try:
        yield adapter
    finally:
        if isinstance(adapter, IsolatedKernel):
            adapter.close()


def replay_kernel(path: Path, kernel: str, which: str) -> tuple[str, bool]:
    """Rerun ``kernel`` on the case saved at ``path`` through the suite's checks for pass
    ``which`` ("forward" or "backward"); returns ``(report text, failed)``. Known findings of
    the kernel do not fail, as in the suite. ValueError when the kernel cannot load."""
    from attention_crossval.kernel.harness.known import (
        covering,
        run_backward_with_known,
        run_with_known,
    )

    with rerun_kernel(kernel) as adapter:
        spec = adapter.spec
        if which == "backward":
            case = BackwardCase.load(path)
            forward = case.forward
            samples = 1 if spec.device == "cpu" else 2
            verdict = run_backward_with_known(adapter, case, samples=samples)
        else:
            forward = load_case(path)
            verdict = run_with_known(adapter, forward)
    lines = [forward.describe(), f"{which} pass of kernel {kernel}:"]
    if verdict.skipped is not None:
        return "\n".join([*lines, f"SKIPPED: {verdict.skipped}"]), False
    known = covering(spec, forward, verdict.findings, backward=which == "backward")
    if not verdict.findings:
        checks = ", ".join(sorted(verdict.applied))
        return "\n".join([*lines, f"PASS: every applied check passed ({checks})"]), False
    lines += [f"  {finding}" for finding in verdict.findings]
    if known:
        reasons = "; ".join(str(k) for k in known)
        return "\n".join([*lines, f"KNOWN: every finding is a known finding ({reasons})"]), False
    failed = ", ".join(dict.fromkeys(f.check for f in verdict.findings))
    return "\n".join([*lines, f"FAIL: {failed}"]), True


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the replay passes, 1 while the kernel fails a check, 2 with one line for a
    bad option, a file not a case or a kernel that cannot load."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_crossval.properties.replay", description=__doc__
    )
    parser.add_argument("case", type=Path, help="a case written by AttentionCase.save")
    parser.add_argument(
        "--kernel",
        default=None,
        metavar="NAME_OR_PATH",
        help="rerun this kernel (built-in name or package.module:attr) instead of the one "
        "saved with the case",
    )
    parser.add_argument(
        "--references-only",
        action="store_true",
        help="check the reference tiers on the case's forward pass; no kernel runs",
    )
    block = _positive(MAX_BLOCK)
    tiles = "reference tiers: default the case's tile_n"
    parser.add_argument("--block-m", type=block, default=None, help=tiles)
    parser.add_argument("--block-n", type=block, default=None, help=tiles)
    rows = _positive(MAX_ELEMENTS)
    parser.add_argument(
        "--rows", type=rows, default=None, help="reference tiers: exact tier on N sampled rows"
    )
    args = parser.parse_args(argv)
    try:
        which, saved_kernel = saved_for(args.case)
        kernel = args.kernel or saved_kernel
        if kernel is not None and not args.references_only:
            text, failed = replay_kernel(args.case, kernel, which)
            print(text)
            return 1 if failed else 0
        case = load_case(args.case)
        block_n = args.block_n or tile_from_label(case, 128)
        if which == "backward":
            print("reference tiers of the forward pass (the case was saved for the backward)")
        print(replay(case, block_m=args.block_m or block_n, block_n=block_n, rows=args.rows))
    except ValueError as error:
        print(f"{parser.prog}: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
