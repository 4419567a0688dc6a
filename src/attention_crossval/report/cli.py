"""``attention-report`` / ``python -m report``: run a report, or diff two.

attention-report                                  # CPU default: streaming-fa vs exact, ~1 min
attention-report --kernel sdpa-flash --kernel flash-attn-cute --preset gpu-small --out DIR
attention-report --kernel mypkg.fa:adapter --sample 50 --tier exact
attention-report --pass both                      # forward and backward (dq, dk, dv)
attention-report --config-file configs.toml
attention-report diff old/report.json new/report.json   # exit 1 on regressions, removed records
attention-report --preset gpu-small --kernel sdpa-flash --gpus all --out DIR   # one shard per GPU
attention-report merge OUT DIR/shard-0-of-2 DIR/shard-1-of-2   # merge --shard K/N runs
attention-report --shard auto/8 --out /shared/run   # scheduler array task: docs/campaigns.md
attention-report repro CASE.npz --out DIR          # standalone reproducer: docs/repro.md
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from threadpoolctl import threadpool_limits

from attention_crossval.kernel.harness.isolation import MAX_TIMEOUT_S
from attention_crossval.report.backward import PASSES
from attention_crossval.report.configs import (
    PRESETS,
    Config,
    load_config_file,
    preset,
    sampled_configs,
    unique,
)
from attention_crossval.report.runner import TIERS, RunOptions
from attention_crossval.report.shard import Shard, parse_shard

DEFAULT_OUT = "attention-report-out"
MAX_SAMPLE = 10_000  # --sample: Hypothesis draws this many cases up front
MAX_REPEATS = 100  # --repeats: kernel runs per case
INTERRUPTED = 130  # the exit status of a shell's command ended by SIGINT (128 + 2)


# Parse-time checks (argparse ``type=``): a bad value stops the command before any kernel is
# resolved or case run, with "argument --NAME: <rule>" and exit code 2.
def _int_in(minimum: int, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"{text!r} must be an integer in [{minimum}, {maximum}]"
            )
        return value

    return parse


def _run_option(field: str, maximum: int | None = None) -> Callable[[str], int]:
    """An integer that :class:`RunOptions` accepts as ``field`` (its rule, not a copy of it),
    and at most ``maximum`` when given (a bound on the run's length)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} must be an integer") from None
        try:
            RunOptions(**{field: value})
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {maximum}")
        return value

    return parse


def _finite_float(*, positive: bool, maximum: float = math.inf) -> Callable[[str], float]:
    rule = "a finite number > 0" if positive else "a finite number >= 0"
    rule += f" and <= {maximum:g}" if math.isfinite(maximum) else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (positive and value == 0) or value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
        return value

    return parse


def _shard(text: str) -> Shard:
    try:
        return parse_shard(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} must be an existing file")
    return text


def _directory(text: str) -> str:
    """An output folder: absent (created) or a directory, never an existing file."""
    if not text:
        raise argparse.ArgumentTypeError("'' must name a directory (use . for this one)")
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a directory (a file of that name exists)"
        )
    return text


def _not_directory(text: str) -> str:
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} must be a file path, not a directory")
    return text


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attention-report",
        description="Numerical-error report of attention kernels against the exact and streaming "
        "tiers (JSON, Markdown, HTML). `attention-report diff OLD NEW` compares two reports.",
    )
    parser.add_argument(
        "--kernel",
        action="append",
        default=[],
        metavar="NAME_OR_PATH",
        help="kernel under test: built-in name (--list-kernels) or package.module:attr; "
        "repeatable (default: streaming-fa, the NumPy streaming tier as a CPU kernel)",
    )
    parser.add_argument(
        "--tier",
        action="append",
        choices=TIERS,
        default=[],
        help="reference tier to compare against; repeatable (default: both)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset", choices=sorted(PRESETS), help="named config grid (default: default)"
    )
    source.add_argument(
        "--sample",
        type=_int_in(1, MAX_SAMPLE),
        metavar="N",
        help=f"N Hypothesis-sampled cases within the first kernel's spec (N <= {MAX_SAMPLE})",
    )
    source.add_argument(
        "--config-file",
        type=_existing_file,
        metavar="PATH",
        help="JSON or TOML list of configs (report/configs.py: Config)",
    )
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of --sample (default 0)")
    parser.add_argument("--only", metavar="TEXT", help="keep configs whose name contains TEXT")
    parser.add_argument(
        "--rows",
        type=_run_option("rows"),
        default=32,
        help="rows per case for the exact tier (default 32)",
    )
    parser.add_argument(
        "--prec-bits",
        type=_run_option("prec_bits"),
        default=128,
        help="exact-tier precision in bits, 64 to 960 (default 128)",
    )
    parser.add_argument(
        "--pass",
        dest="passes",
        choices=PASSES,
        default="forward",
        help="forward (O, LSE), backward (dq, dk, dv) or both (default forward)",
    )
    parser.add_argument(
        "--repeats",
        type=_run_option("repeats", MAX_REPEATS),
        default=2,
        help=f"kernel runs per case, >1 checks determinism (default 2, at most {MAX_REPEATS})",
    )
    parser.add_argument(
        "--out",
        type=_directory,
        default=DEFAULT_OUT,
        help=f"output directory (default {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--isolate",
        choices=("auto", "always", "never"),
        default="auto",
        help="run kernels (module, factory and calls) in a worker process that may crash or "
        "hang (auto: every kernel but the in-process built-in streaming-fa; never: all here)",
    )
    parser.add_argument(
        "--kernel-timeout",
        type=_finite_float(positive=True, maximum=MAX_TIMEOUT_S),
        default=300.0,
        help="seconds per kernel call when isolated (default 300)",
    )
    parser.add_argument(
        "--kernel-start-timeout",
        type=_finite_float(positive=True, maximum=MAX_TIMEOUT_S),
        default=600.0,
        help="seconds for an isolated kernel's worker to import and set up the kernel "
        "(default 600)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="discard finished records, reports and the exact cache in --out instead of resuming",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-html", action="store_true", help="write JSON and Markdown only")
    _exit_options(parser)
    shards = parser.add_mutually_exclusive_group()
    shards.add_argument(
        "--shard",
        type=_shard,
        metavar="K/N|auto[/N]",
        help="run only configs i with i %% N == K (merge the shards with `attention-report merge`);"
        " auto: K from SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX, N from SLURM_ARRAY_TASK_COUNT"
        " unless given, output in OUT/shard-K-of-N (docs/campaigns.md)",
    )
    shards.add_argument(
        "--gpus",
        metavar="all|ID,ID,...",
        help="one shard per GPU (CUDA_VISIBLE_DEVICES pinned) into OUT/shard-K-of-N, then merge "
        "into OUT; all: CUDA_VISIBLE_DEVICES or nvidia-smi -L",
    )
    parser.add_argument(
        "--list-kernels", action="store_true", help="list built-in kernels and exit"
    )
    parser.add_argument(
        "--list-presets", action="store_true", help="list presets with sizes and exit"
    )
    return parser


def _exit_options(parser: argparse.ArgumentParser) -> None:
    """``--exit-zero`` (the exit status of a finished report is 0 whatever its records) and
    ``--strict`` (accepted for older scripts: failing records exit 1 by default)."""
    parser.add_argument(
        "--exit-zero",
        action="store_true",
        help="exit 0 when the report is written, even if records fail or error (default: 1, "
        "like pytest)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when any record fails or errors (the default; kept for older scripts)",
    )


def _diff_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attention-report diff",
        description="Compare two reports (report.json or records.jsonl); exit 1 on regressions "
        "and on records that disappeared.",
    )
    parser.add_argument("old", type=_existing_file)
    parser.add_argument("new", type=_existing_file)
    parser.add_argument(
        "--rel-increase",
        type=_finite_float(positive=False),
        default=0.5,
        help="relative growth of error/bound that regresses (default 0.5)",
    )
    parser.add_argument(
        "--min-increase",
        type=_finite_float(positive=False),
        default=0.05,
        help="absolute growth needed as well (default 0.05)",
    )
    parser.add_argument(
        "--out", type=_not_directory, metavar="FILE", help="also write the Markdown diff here"
    )
    return parser


def _merge_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attention-report merge",
        description="Merge shard reports (--shard K/N runs: their folders or report.json) into "
        "one report in OUT; a record key with two different results is refused.",
    )
    parser.add_argument("out", type=_directory, help="output directory of the merged report")
    parser.add_argument("shards", nargs="+", help="shard folders or their report.json")
    parser.add_argument("--no-html", action="store_true", help="write JSON and Markdown only")
    _exit_options(parser)
    return parser


def _configs(args: argparse.Namespace, kernels: list) -> list:
    if args.config_file:
        configs = load_config_file(args.config_file)
    elif args.sample is not None:
        configs = sampled_configs(args.sample, args.sample_seed, spec=kernels[0].spec)
    else:
        configs = preset(args.preset or "default")
    if args.only:
        configs = [c for c in configs if args.only in c.name]
        if not configs:
            raise ValueError(f"--only={args.only!r} matches no config name")
    for config in configs:  # the run's element budget, before any config is built
        if isinstance(config, Config):
            config.check_budget()
    return unique(configs)


def run_main(argv: Sequence[str]) -> int:
    args = _run_parser().parse_args(argv)
    from attention_crossval.kernel.harness.registry import BUILTIN, available

    if args.list_kernels:
        here = set(available())
        for name, (path, _) in BUILTIN.items():
            print(f"{name:18} {path:45} {'available' if name in here else 'package missing'}")
        return 0
    if args.list_presets:
        for name in PRESETS:
            print(f"{name:10} {len(preset(name)):4} configs")
        return 0
    from attention_crossval.report.session import output_lock
    from attention_crossval.report.shard import parse_gpus

    gpus = None if args.gpus is None else parse_gpus(args.gpus)  # refused before --out is touched
    if args.shard is not None:  # auto: OUT/shard-K-of-N, locked on its own
        args.out = str(args.shard.folder(args.out))
    with output_lock(args.out):
        return _run_locked(args, argv, gpus)


def _run_locked(args: argparse.Namespace, argv: Sequence[str], gpus: list[str] | None) -> int:
    """The run, holding the lock on ``--out``; ``gpus``: one shard per GPU (``--gpus``)."""
    from attention_crossval.report.session import (
        clear_outputs,
        close_kernels,
        resolve_kernels,
        run_report,
    )
    from attention_crossval.report.shard import run_on_gpus, shard_configs, shard_provenance

    options = RunOptions(
        tiers=tuple(dict.fromkeys(args.tier)) or TIERS,  # --tier exact twice: one exact tier
        rows=args.rows,
        prec_bits=args.prec_bits,
        repeats=args.repeats,
        passes=args.passes,
    )
    if args.fresh:
        clear_outputs(args.out)
    kernels = resolve_kernels(
        args.kernel or ["streaming-fa"],
        isolate=args.isolate,
        timeout_s=args.kernel_timeout,
        start_timeout_s=args.kernel_start_timeout,
    )
    try:
        configs = _configs(args, kernels)
    except ValueError:
        close_kernels(kernels)
        raise
    provenance = None
    if gpus is not None:
        close_kernels(kernels)  # the shards run their own
        report = run_on_gpus(argv, gpus, args.out, html=not args.no_html)
        return _summary_line(report, args.out, exit_zero=args.exit_zero)
    if args.shard is not None:
        configs = shard_configs(configs, args.shard.index, args.shard.count)
        provenance = {"shard": shard_provenance(args.shard.index, args.shard.count)}
    report = run_report(
        configs,
        kernels,
        options,
        args.out,
        progress=not args.no_progress,
        html=not args.no_html,
        command=["attention-report", *argv],
        provenance=provenance,
    )
    return _summary_line(report, args.out, exit_zero=args.exit_zero)


def _summary_line(report: dict, out: str, *, exit_zero: bool) -> int:
    """Print where the report went; the exit status: 1 when a record failed or errored (as
    pytest's), unless ``exit_zero``."""
    verdicts = report["summary"]["verdicts"]
    written = [n for n in ("report.json", "report.md", "report.html") if (Path(out) / n).exists()]
    print(
        f"attention-report: {report['summary']['records']} records {verdicts} in "
        f"{report['elapsed_s']:.1f} s -> {out}/ ({', '.join(written)})"
    )
    return 0 if exit_zero or not (verdicts.get("fail") or verdicts.get("error")) else 1


def diff_main(argv: Sequence[str]) -> int:
    from attention_crossval.report.diff import diff_records, failed, load_records, render_diff

    args = _diff_parser().parse_args(argv)
    rows = diff_records(
        load_records(args.old),
        load_records(args.new),
        rel_increase=args.rel_increase,
        min_increase=args.min_increase,
    )
    text = render_diff(rows, args.old, args.new)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 1 if failed(rows) else 0


def merge_main(argv: Sequence[str]) -> int:
    from attention_crossval.report.session import output_lock
    from attention_crossval.report.shard import merge_reports

    args = _merge_parser().parse_args(argv)
    with output_lock(args.out):
        report = merge_reports(
            args.shards,
            args.out,
            html=not args.no_html,
            command=["attention-report", "merge", *argv],
        )
    return _summary_line(report, args.out, exit_zero=args.exit_zero)


def _repro_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attention-report repro",
        description="Write a standalone reproducer folder for a saved failing case: repro.py "
        "(numpy and the kernel's public call, exit 1 while the bug is there), case.npz and "
        "REPORT.md, a bug-report draft (docs/repro.md).",
    )
    parser.add_argument(
        "case",
        type=_existing_file,
        nargs="?",
        help="a case saved by a failing test (.npz); or --known KERNEL",
    )
    parser.add_argument(
        "--known",
        default=None,
        metavar="NAME_OR_PATH",
        help="instead of a case: one folder per forward known finding this kernel declares, "
        "from the finding's trigger case, under --out",
    )
    parser.add_argument(
        "--out",
        type=_directory,
        default=None,
        metavar="DIR",
        help="the folder to write (default: repro-<case name> beside the case; with --known, "
        "repro-<kernel name>)",
    )
    parser.add_argument(
        "--kernel",
        default=None,
        metavar="NAME_OR_PATH",
        help="the kernel to reproduce with (default: the one saved with the case)",
    )
    parser.add_argument(
        "--check",
        default=None,
        help="the failed check to reproduce (default: the first one a script can apply)",
    )
    return parser


def repro_main(argv: Sequence[str]) -> int:
    from attention_crossval.report.repro import write_repro_for_file

    parser = _repro_parser()
    args = parser.parse_args(argv)
    if (args.case is None) == (args.known is None):
        parser.error("give a case or --known KERNEL (one of them)")
    if args.known is not None:
        from attention_crossval.report.repro import write_known_repros

        lines, all_failed = write_known_repros(args.known, args.out)
        print("\n".join(f"attention-report repro: {line}" for line in lines))
        return 0 if all_failed else 1
    folder = write_repro_for_file(args.case, args.out, kernel=args.kernel, check=args.check)
    print(f"attention-report repro: wrote {folder}/ (run: python {folder}/repro.py)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # BLAS on one thread: its default pool makes the tiers' small GEMMs far slower
        with threadpool_limits(limits=1, user_api="blas"):  # (docs/numerics.md#small-gemms)
            if argv[:1] == ["diff"]:
                return diff_main(argv[1:])
            if argv[:1] == ["merge"]:
                return merge_main(argv[1:])
            if argv[:1] == ["repro"]:
                return repro_main(argv[1:])
            return run_main(argv[1:] if argv[:1] == ["run"] else argv)
    except (ValueError, OSError) as error:  # bad options or inputs: a message, not a traceback
        message = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
        print(f"attention-report: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: finished records stay in --out, a rerun resumes there
        print("attention-report: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
