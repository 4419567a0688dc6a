"""Run the Triton FP8 forward (testing/broken/triton_fp8.py) with the fixed constants and with
FA4's on FA4's trigger, and print one table row per (kernel, case).

    python scripts/gpu/fp8_check.py              # on the GPU; exit 1 on an unexpected verdict
    python scripts/gpu/fp8_check.py --interpret  # Triton's interpreter on the CPU

The trigger (:func:`triton_fp8.creep_case`) is a row max creeping up by just under FA4's lazy
threshold of 4 (log2 units) per K block, over 16 K blocks (:data:`triton_fp8.TRIGGERS`).
Columns: the constants the kernel runs (offset + threshold) and the chain it declares; the
kernel's largest |O error| against float64 on every row and its largest fraction of the
declared chain's bound; the P elements that clamp and the rescales skipped, counted by the
streaming tier (the NumPy emulation of the chain the kernel runs, block for block); the
harness's findings (every check); and the verdict:
``ok`` when the findings are the adapter's ``expected_check`` (none for ``triton-fp8``,
``bound`` for ``triton-fp8-fa4``).
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true", help="run Triton's interpreter")
    args = parser.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
        from attention_crossval.properties.triton_interpreter import patch_interpreter

        patch_interpreter()
    from attention_crossval.kernel.harness.forward import run_case
    from attention_crossval.kernel.harness.references import CaseReferences
    from attention_crossval.reference.precision import StreamingPrecision
    from attention_crossval.reference.streaming import RescaleTrace, streaming_attention
    from attention_crossval.testing.broken.triton_fp8 import (
        BLOCK_M,
        BLOCK_N,
        TRIGGERS,
        creep_case,
        fa4_constants,
        fixed,
    )

    header = (
        "kernel", "case", "runs", "declares", "max |O err|", "/ bound", "clamped P",
        "skipped", "findings", "verdict",
    )  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    unexpected = 0
    for dtype, options in TRIGGERS:
        case = creep_case(dtype, **options)
        for adapter in (fixed(), fa4_constants()):
            if args.interpret:
                adapter.device = "cpu"
            spec = adapter.spec
            if spec.unsupported(case) is not None:
                continue
            offset, threshold = adapter.constants[dtype]
            runs = StreamingPrecision.fp8_attention(
                dtype, max_offset_log2=offset, rescale_threshold_log2=threshold
            )
            declared = spec.precision_for(dtype)
            trace = RescaleTrace()
            streaming_attention(case, runs, block_m=BLOCK_M, block_n=BLOCK_N, trace=trace)
            verdict = run_case(adapter, case)
            checks = sorted({finding.check for finding in verdict.findings})
            expected = [adapter.expected_check] if adapter.expected_check else []
            error, fraction = "-", "-"
            if verdict.result is not None:
                references = CaseReferences(
                    case, rows=4, device=spec.device, tile_m=spec.tile_m, tile_n=spec.tile_n
                ).focus(verdict.result)
                report = references.compare(verdict.result, "float64", spec)
                error, fraction = f"{report.max_abs:.3g}", f"{report.max_bound_fraction:.3g}"
            ok = checks == expected
            unexpected += not ok
            shape = f"{dtype} Sq={case.Sq} Sk={case.Sk} D={case.D} Hq={case.Hq} {case.label}"
            shape += " causal" if case.mask.causal else ""
            row = (
                spec.name, shape, f"{offset:g}+{threshold:g}",
                f"{declared.max_offset_log2:g}+{declared.rescale_threshold_log2:g}", error,
                fraction, str(int(trace.clamped_p.sum())), str(int(trace.skipped_rescales.sum())),
                ", ".join(checks) or "none", "ok" if ok else "UNEXPECTED",
            )  # fmt: skip
            print("| " + " | ".join(row) + " |", flush=True)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
