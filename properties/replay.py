"""Replay a saved case through the reference tiers:
``python -m attention_crossval.properties.replay CASE.npz``.

A failing property saves its case (``AttentionCase.save``) and prints this command, so the
exact inputs can be rerun, attached to a report, or loaded with ``AttentionCase.load``. Cases
go to ``$ATTENTION_REPORT_DIR`` (the pytest plugin sets it from ``--report-dir``), else
``<tmp>/attention-cases``; file names are content hashes. A failing property runs many failing
cases while Hypothesis shrinks (one run saved 90), so :func:`save_failing_case` keeps at most
:data:`CASES_PER_TEST` per test: the first ones, and in the last slot always the latest case,
which is the shrunk one (Hypothesis replays it last).
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

from attention_crossval.reference.bounds import error_bound
from attention_crossval.reference.case import MAX_ELEMENTS, AttentionCase
from attention_crossval.reference.compare import compare
from attention_crossval.reference.exact import exact_attention, sample_rows
from attention_crossval.reference.precision import StreamingPrecision
from attention_crossval.reference.streaming import streaming_attention


def case_directory() -> Path:
    """Where failing cases are written (``$ATTENTION_REPORT_DIR`` or a temp folder)."""
    configured = os.environ.get("ATTENTION_REPORT_DIR")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "attention-cases"


def save_case(case: AttentionCase, directory: str | Path | None = None) -> Path:
    """Write ``case`` as ``<sha1 of its inputs>.npz`` under ``directory`` and return the path."""
    directory = Path(directory) if directory is not None else case_directory()
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(case.describe().encode())
    for array in (case.q, case.k, case.v, case.mask.explicit):
        if array is not None:
            digest.update(array.tobytes())
    return case.save(directory / f"case-{digest.hexdigest()[:16]}.npz")


CASES_PER_TEST = 5
_saved: dict[str, list[Path]] = {}


def current_test() -> str:
    """The running pytest test's id (``$PYTEST_CURRENT_TEST`` less its phase), or ""."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def save_failing_case(
    case: AttentionCase, directory: str | Path | None = None, *, test: str | None = None
) -> Path:
    """:func:`save_case`, keeping at most :data:`CASES_PER_TEST` files per ``test`` (default:
    the running pytest test): once full, the newest case replaces the previous newest, so the
    last failing case (Hypothesis' shrunk one) is always on disk. A file another test also
    saved is never deleted."""
    path = save_case(case, directory)
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


@contextlib.contextmanager
def reproducer_on_failure(
    case: AttentionCase, directory: str | Path | None = None
) -> Iterator[None]:
    """On any exception inside the block, save ``case`` (:func:`save_failing_case`) and add the
    replay command as a note (shown under the traceback), then re-raise. Costs nothing when the
    block passes."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"reproduce: {replay_command(save_failing_case(case, directory))}")
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
    if not path.is_file():
        raise ValueError(f"{path} must be an existing .npz file written by AttentionCase.save")
    try:
        with path.open("rb") as stream:  # closed here when np.load fails half-way
            return AttentionCase.load(stream)
    except _NOT_A_CASE as error:
        reason = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(
            f"{path} is not a case written by AttentionCase.save ({type(error).__name__}: {reason})"
        ) from None


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


def main(argv: list[str] | None = None) -> int:
    """Exit 0 with the report; exit 2 with one line for a bad option or a file not a case."""
    parser = argparse.ArgumentParser(
        prog="python -m attention_crossval.properties.replay", description=__doc__
    )
    parser.add_argument("case", type=Path, help="a case written by AttentionCase.save")
    block = _positive(MAX_BLOCK)
    parser.add_argument("--block-m", type=block, default=None, help="default: the case's tile_n")
    parser.add_argument("--block-n", type=block, default=None, help="default: the case's tile_n")
    rows = _positive(MAX_ELEMENTS)
    parser.add_argument("--rows", type=rows, default=None, help="exact tier on N sampled rows")
    args = parser.parse_args(argv)
    try:
        case = load_case(args.case)
        block_n = args.block_n or tile_from_label(case, 128)
        print(replay(case, block_m=args.block_m or block_n, block_n=block_n, rows=args.rows))
    except ValueError as error:
        print(f"{parser.prog}: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
