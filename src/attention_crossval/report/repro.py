"""``attention-report repro CASE.npz``: a standalone reproducer folder for one finding.

The folder holds ``repro.py`` (numpy, the kernel's public call and torch where that call needs
it; :mod:`report.repro_script`), ``case.npz`` beside it unless the case is small enough to sit
in the script, and ``REPORT.md``, a bug-report draft: environment, the case in words, what the
kernel returned against float64 attention and the bound derived from its declared chain, the
one-line triage and how to run the script. The case is first trimmed to what the failure needs
(:mod:`report.repro_case`). docs/repro.md describes it.
"""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from attention_crossval.kernel.contract.public_call import PublicCall, public_call
from attention_crossval.reference.case import AttentionCase
from attention_crossval.report.repro_case import Evidence, gather
from attention_crossval.report.repro_script import (
    SCRIPT_CHECKS,
    ScriptCase,
    case_arrays,
    npz_bytes,
    render,
)

# Why each check's failure matters, for the report's "why it triggers".
WHY = {
    "bound": "O differs from exact attention by more than the rigorous error bound derived from "
    "the kernel's declared precision chain",
    "lse": "the LSE differs from exact attention by more than the derived bound",
    "empty-rows": "query rows that see no key must give O = 0 and LSE = -inf (or the sink)",
    "nonfinite": "finite inputs give non-finite outputs",
    "padding-read": "the kernel reads K/V (or q) past the valid lengths, or the unused tail of "
    "a K/V page, and what it reads reaches the output: NaN there (any value a cache may hold) "
    "turns rows non-finite, 0 * NaN = NaN",
    "hidden-nan": "the kernel loads K/V rows that the mask hides from every query and weights "
    "them by 0: NaN there (a KV cache holds anything outside the mask) turns rows non-finite",
    "determinism": "runs on the same inputs give different bits",
    "error": "the call raises on a case inside the kernel's declaration",
}
# The one-line triage of a check other than bound (whose finding carries its own).
TRIAGE = {
    "lse": "implementation bug in the LSE (the reference tiers agree within the bound)",
    "empty-rows": "implementation bug: the kernel's convention for rows that see no key",
    "nonfinite": "implementation bug: overflow or an uninitialised value on finite inputs",
    "padding-read": "implementation bug: reads past the valid lengths reach the output",
    "hidden-nan": "implementation bug: masked K/V rows are read and reach the output",
    "determinism": "implementation bug: a race or an order that changes run to run",
    "error": "the kernel refuses a case it is declared for (or the declaration is too wide)",
}


def write_repro(
    adapter: Any,
    case: AttentionCase,
    out: str | Path,
    *,
    kernel: str | None,
    spelling: Any = None,
    check: str | None = None,
    trimmed: bool = True,
    run: bool = True,
    attempts: int = 1,
) -> Path:
    """Write the reproducer folder ``out`` for ``adapter`` failing ``case`` (``check``, or the
    first failed check a script can apply) and return it. ``adapter`` runs the case (a worker
    for a user's kernel); ``spelling`` is the in-process adapter whose ``repro_call`` spells
    the public call (default ``adapter``), ``kernel`` its ``--kernel`` spelling for the
    fallback. ValueError when the kernel passes, or no failed check has a standalone script.
    Without ``run`` the kernel is not called; ``attempts``: runs a wanted ``check`` gets to
    fail (:func:`report.repro_case.gather`)."""
    evidence = gather(adapter, case, check=check, trimmed=trimmed, run=run, attempts=attempts)
    call = public_call(spelling if spelling is not None else adapter, evidence.case, kernel)
    spec = adapter.spec
    script_case = ScriptCase(
        case=evidence.case,
        check=evidence.check,
        call=call,
        title=f"{spec.name} fails {evidence.check} on {evidence.case.describe()}",
        recorded=evidence.recorded,
        empty_rows_nan=spec.empty_rows == "nan",
        padded_rows_unwritten=spec.padded_rows == "unwritten",
    )
    data = npz_bytes(case_arrays(evidence.case, evidence.arrays))
    script, inline = render(script_case, data)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "case.npz").unlink(missing_ok=True)
    if not inline:
        (folder / "case.npz").write_bytes(data)
    (folder / "repro.py").write_text(script)
    (folder / "REPORT.md").write_text(report_text(spec, evidence, call, inline))
    return folder


def write_repro_for_file(
    path: str | Path,
    out: str | Path | None = None,
    *,
    kernel: str | None = None,
    check: str | None = None,
) -> Path:
    """:func:`write_repro` for a saved case (``AttentionCase.save``; the kernel saved with it
    unless ``kernel``), into ``out`` (default ``repro-<case file stem>`` beside the case)."""
    from attention_crossval.kernel.harness.registry import resolve
    from attention_crossval.properties.replay import load_case, rerun_kernel, saved_for

    path = Path(path)
    which, saved_kernel = saved_for(path)
    if which == "backward":
        raise ValueError(
            f"{path} is a backward case (it holds dO): standalone reproducers cover the forward "
            "pass only"
        )
    kernel = kernel or saved_kernel
    if kernel is None:
        raise ValueError(f"{path} was saved without a kernel: name one with --kernel")
    case = load_case(path)
    folder = Path(out) if out is not None else path.with_name(f"repro-{path.stem}")
    with rerun_kernel(kernel) as adapter:
        spelling = resolve(kernel)
        return write_repro(adapter, case, folder, kernel=kernel, spelling=spelling, check=check)


# Runs a known finding's trigger gets to fail its check: a race (flash-attn-cute's paged
# nondeterminism) passed a single harness run of its trigger on the H200 (docs/results-h200.md).
KNOWN_ATTEMPTS = 5


def write_known_repros(kernel: str, out: str | Path | None = None) -> tuple[list[str], bool]:
    """A reproducer folder per forward known finding ``kernel`` declares, from the finding's
    trigger case (:func:`kernel.known_findings.trigger_case`; up to :data:`KNOWN_ATTEMPTS`
    runs to fail), trimmed and run, under ``out``
    (default ``repro-<kernel>``). Returns one line per finding (where it went, or why none was
    written: the trigger passes, the kernel skips it) and whether every finding still fails."""
    from attention_crossval.kernel.contract.known_findings import trigger_case
    from attention_crossval.kernel.harness.registry import resolve
    from attention_crossval.properties.replay import rerun_kernel
    from attention_crossval.reference.file_names import safe_file_name

    spelling = resolve(kernel)
    spec = spelling.spec
    directory = Path(out) if out is not None else Path(safe_file_name("repro", spec.name))
    lines, all_failed = [], True
    with rerun_kernel(kernel) as adapter:
        for index, known in enumerate(spec.known_findings):
            if known.backward:
                continue
            features = "".join(f"-{f}" for f in sorted(known.features))
            folder = directory / safe_file_name(f"{index}", known.check + features)
            try:
                case = trigger_case(spec, known)
                write_repro(
                    adapter,
                    case,
                    folder,
                    kernel=kernel,
                    spelling=spelling,
                    check=known.check,
                    attempts=KNOWN_ATTEMPTS,
                )
            except ValueError as reason:
                all_failed = False
                lines.append(f"{known.name} ({known.when}): none: {str(reason).splitlines()[0]}")
                continue
            lines.append(f"{known.name} ({known.when}): python {folder / 'repro.py'}")
    return lines, all_failed


def write_reproducers(error: BaseException, directory: str | Path) -> str:
    """For the pytest plugin's ``--repro-dir``: a reproducer folder under ``directory`` for each
    saved case a failure names (:func:`properties.replay.noted_cases`), named after the case
    file; returns one line per case (where it went, or why none was written)."""
    from attention_crossval.properties.replay import noted_cases

    lines = []
    for path in noted_cases(error):
        folder = Path(directory) / f"repro-{path.stem}"
        try:
            write_repro_for_file(path, folder)
        except Exception as reason:  # noqa: BLE001 - never break the report of the failure
            why = f"{type(reason).__name__}: {str(reason).splitlines()[0] if str(reason) else ''}"
            lines.append(f"no reproducer for {path}: {why}")
            continue
        lines.append(f"reproducer: python {folder / 'repro.py'} (bug report draft: REPORT.md)")
    return "\n".join(lines)


def report_text(spec: Any, evidence: Evidence, call: PublicCall, inline: bool) -> str:
    """REPORT.md: the bug-report draft."""
    case, recorded = evidence.case, evidence.recorded
    lines = [
        f"# {spec.name}: `{evidence.check}` fails on a {case.dtype} case",
        "",
        "Draft bug report written by attention-crossval (`attention-report repro`); "
        "edit before filing.",
        "",
        "## Environment",
        "",
        *(f"- {line}" for line in environment(call)),
        "",
        "## The case",
        "",
        f"- shape: B={case.B} Sq={case.Sq} Sk={case.Sk} Hq={case.Hq} Hkv={case.Hkv} "
        f"D={case.D} Dv={case.Dv}, {case.dtype}, softmax scale {case.softmax_scale:.6g}",
        f"- mask: {mask_words(case)}",
        f"- inputs: {inputs_words(case)}",
        *surface_words(case),
        f"- why it triggers: {WHY[evidence.check]}",
        *(f"- known finding: {known.reason} ({known.link})" for known in evidence.known),
        f"- {_trim_words(evidence)}",
        "",
        "## What the kernel returned",
        "",
        f"- {recorded['finding']}",
    ]
    if "worst" in recorded:
        lines += [
            f"- worst element {recorded['worst']}: kernel {recorded['kernel_value']!r}, "
            f"float64 attention {recorded['float64_value']!r}",
            f"- bound there {recorded['bound_at_worst']:.6g} (the error is "
            f"{recorded['error_over_bound']:.4g}x it; {recorded['outside']} values outside), "
            f"derived from the declared precision chain: {recorded['chain']}",
        ]
    triage = _triage_line(evidence)
    lines += [
        "",
        "## Triage",
        "",
        triage,
        "",
        "## Run it",
        "",
        "```",
        "python repro.py   # exit 1 while the bug is there, 0 once it is fixed",
        "```",
        "",
        f"It checks {SCRIPT_CHECKS[evidence.check]}; it calls the kernel through `{call.api}` "
        "and computes attention in float64 with numpy; the inputs are "
        + ("inline in the script." if inline else "in `case.npz` beside it."),
        "",
    ]
    return "\n".join(lines)


def _trim_words(evidence: Evidence) -> str:
    """What the trim did, in words."""
    if evidence.original is None:
        return "not trimmed: the case as built"
    dropped = ", ".join(evidence.trims) if evidence.trims else "nothing could be dropped"
    return (
        f"trimmed from {evidence.original}: {dropped} (each trim kept only when the kernel, "
        "rerun, still failed the check)"
    )


def _triage_line(evidence: Evidence) -> str:
    """The finding's own triage line (a ``bound`` finding carries the three-tier one), else
    the check's."""
    for line in evidence.finding.message.splitlines():
        if line.strip().startswith("triage:"):
            return line.strip().removeprefix("triage:").strip()
    return TRIAGE.get(evidence.check, evidence.check)


def mask_words(case: AttentionCase) -> str:
    """The case's mask in words."""
    mask = case.mask
    parts = []
    if mask.causal:
        parts.append(f"causal ({mask.alignment.value.replace('_', '-')} diagonal)")
    if "window" in mask.kinds:
        left = "unbounded" if mask.window_left is None else mask.window_left
        right = "unbounded" if mask.window_right is None else mask.window_right
        parts.append(f"sliding window {left} keys left, {right} right of the diagonal")
    if mask.q_lengths is not None:
        parts.append(f"valid query lengths {list(mask.q_lengths)} of {case.Sq}")
    if mask.k_lengths is not None:
        parts.append(f"valid key lengths {list(mask.k_lengths)} of {case.Sk}")
    if mask.explicit is not None:
        seen = np.broadcast_to(mask.explicit, (case.B, case.Hq, case.Sq, case.Sk))
        parts.append(f"an explicit boolean mask showing {int(seen.sum())} of {seen.size} pairs")
    from attention_crossval.reference.masks import empty_rows

    empty = int(empty_rows(case).sum())
    words = ", ".join(parts) or "none (every query sees every key)"
    return words + (f"; {empty} query rows see no key" if empty else "")


def inputs_words(case: AttentionCase) -> str:
    """Where the inputs came from: the label's score distribution and what it targets."""
    fields = dict(part.split("=", 1) for part in case.label.split() if "=" in part)
    name = fields.get("dist")
    if name is not None:
        from attention_crossval.properties._strategies.scores import DISTRIBUTIONS

        if name in DISTRIBUTIONS:
            return f"score distribution `{name}` ({DISTRIBUTIONS[name].targets})"
        return f"score distribution `{name}`"
    if case.label.startswith("trigger:"):
        return (
            "the known finding's trigger case (kernel/contract/known_findings.py): N(0, 1) inputs"
        )
    return f"as saved ({case.label or 'no label'})"


def surface_words(case: AttentionCase) -> list[str]:
    """Softcap, sink and call options in words, one line each where the case has them."""
    lines = []
    if case.softcap is not None:
        lines.append(f"- softcap {case.softcap:.6g} (logits cap * tanh(scale q.k / cap))")
    if case.sink is not None:
        lines.append(f"- learnable sink per query head {[float(x) for x in case.sink]}")
    if case.page_size is not None:
        lines.append(f"- paged K/V, pages of {case.page_size} keys")
    if case.num_splits > 1:
        lines.append(f"- split-KV over {case.num_splits} splits")
    return lines


def environment(call: PublicCall) -> list[str]:
    """Python, numpy, torch (with its CUDA, the GPU and its driver) when the call needs it, and
    the version of the kernel's package, as far as this machine can tell."""
    lines = [f"Python {platform.python_version()} on {platform.platform()}"]
    lines.append(f"numpy {np.__version__}")
    if call.torch:
        try:
            import torch
        except ImportError:
            return [*lines, "torch: not installed where this folder was written"]
        lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
        if torch.cuda.is_available():
            lines.append(f"GPU {torch.cuda.get_device_name(0)}, driver {_driver() or 'unknown'}")
        else:
            lines.append("GPU: none visible to torch")
    package = _package_version(call)
    if package:
        lines.append(package)
    return lines


def _driver() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi``, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def _package_version(call: PublicCall) -> str | None:
    """``<distribution> <version>`` of the top-level package the call imports, if installed."""
    names = [line.split()[1].split(".")[0] for line in call.imports if line.startswith("import ")]
    names += [line.split()[1].split(".")[0] for line in call.imports if line.startswith("from ")]
    mapping = importlib.metadata.packages_distributions()
    for name in dict.fromkeys(names):
        if name in ("torch", "numpy"):
            continue
        for dist in mapping.get(name, ()):
            return f"{dist} {importlib.metadata.version(dist)}"
    return None
