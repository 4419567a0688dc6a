"""TFLOP/s of the own SM90 kernel's variants, flash_attn.cute and cuDNN, on two clocks.

Run (on an H100/H200 with flash-attn-cute, from the repository root):
``python -m benchmarks.bench_own_sm90`` (``--variants overlap+lf+smem,default``: names from
:data:`VARIANTS`, :data:`DEFAULT_VARIANTS` when omitted; ``--rows 0,3``; ``--rounds N``;
``--clock both|graph|stream``; ``--warmup MS --rep MS``). For each row of :data:`ROWS` (bf16,
Hq = Hkv, Sq = Sk) it times each own variant (kernel/adapters/own_sm90.py ``launch`` with that
variant's knobs, exactly; ``default`` is the registered adapters' ``DEFAULT_KNOBS``),
flash_attn.cute's SM90 forward and cuDNN through torch SDPA, ``--rounds`` times in turn, and
prints the machine, then a markdown table: per kernel and clock the median TFLOP/s
(``4 B H S^2 D``, halved when causal), per clock the best own variant over flash_attn.cute,
the call-time ratio (the ``default`` variant over flash_attn.cute on the stream clock), the
host time to issue one call of the ``default`` variant and of flash_attn.cute, and per own
variant ``max|own - FA|`` over the outputs and the NaN count of its output (a fast wrong
kernel is no result).

The clocks (benchmarks/timing.py): ``graph`` times CUDA-graph replays, the kernels' device
time, for every kernel alike; ``stream`` times calls launched one after another from Python
(triton's ``do_bench``), what a Python caller pays, host launch work included: where the
launch's host work outlasts the kernel, this clock measures the host. ``both`` (the default)
prints the two side by side, so the gap between them shows what the launch path costs. The
host column is the wall time of issuing 200 calls in a row without waiting for the GPU,
per call (:func:`benchmarks.timing.host_us_per_call`).

A kernel that fails prints NaN in its cells and its traceback to stderr; the others go on.
Each measurement and each finished row are printed as they come, so a kernel that hangs under
``timeout`` loses only the rest. Compiles happen on first use (cached per dtype, D and causal),
outside the timing. torch, triton and flash_attn are imported only inside functions, so
``--help`` works on a machine without them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from attention_crossval.kernel.adapters.own_sm90 import DEFAULT_KNOBS
from benchmarks.machine import cpu_model
from benchmarks.peers import flash_attn_cute_forward
from benchmarks.timing import host_us_per_call, tflops

# (B, H, S, D, causal)
ROWS: tuple[tuple[int, int, int, int, bool], ...] = (
    (4, 16, 4096, 128, False),
    (4, 16, 4096, 128, True),
    (2, 16, 16384, 128, False),
    (2, 16, 16384, 128, True),
    (2, 16, 16384, 64, False),
    (2, 16, 16384, 64, True),
    (16, 16, 1024, 128, False),
    (16, 16, 1024, 128, True),
)
# Own variant -> the knobs of kernel/adapters/own_sm90.py launch(). ``default`` is what the
# registered adapters run (own_sm90.DEFAULT_KNOBS: overlap, pingpong, longest_first,
# smem_epilogue, m192, chosen from this benchmark on the H200: docs/results-h200.md);
# ``overlap+lf+smem`` was their default before; ``baseline`` is the kernel without knobs.
VARIANTS: dict[str, dict[str, bool]] = {
    "baseline": {},
    "overlap": {"overlap": True},
    "pingpong": {"overlap": True, "pingpong": True},
    "overlap+lf": {"overlap": True, "longest_first": True},
    "overlap+smem": {"overlap": True, "smem_epilogue": True},
    "overlap+lf+smem": {"overlap": True, "longest_first": True, "smem_epilogue": True},
    "all": {"overlap": True, "pingpong": True, "longest_first": True, "smem_epilogue": True},
    # 192-row query tiles (three consumer warpgroups) at D = 64; the same kernel at D = 128.
    "overlap+lf+smem+m192": {
        "overlap": True,
        "longest_first": True,
        "smem_epilogue": True,
        "m192": True,
    },
    "default": dict.fromkeys(DEFAULT_KNOBS, True),
    # persistent (run only here): one CTA per SM over the tiles, causal tiles longest-first with or
    # without longest_first, so overlap+lf+persist is the same kernel as overlap+persist (the
    # CPU tests check the PTX is equal); kept as a name for the comparison the knob list allows.
    "overlap+persist": {"overlap": True, "persistent": True},
    "overlap+lf+persist": {"overlap": True, "longest_first": True, "persistent": True},
}
# The variants run without --variants, each compiled once per (D, causal) of the rows: the
# earlier default (overlap+lf+smem), then pingpong and 192-row tiles each added to it, then
# both (the default), so the table shows what each step adds.
DEFAULT_VARIANTS = ("overlap+lf+smem", "all", "overlap+lf+smem+m192", "default")
# --clock -> the clocks timed, by name: graph (CUDA-graph replays: device time) or stream
# (do_bench of calls from Python: the caller's time per call).
CLOCKS = {"both": ("graph", "stream"), "graph": ("graph",), "stream": ("stream",)}
# The own variant whose host issue time the table shows next to flash_attn.cute's.
HOST_VARIANT = "default"
NAN = float("nan")


def row(
    B: int,
    H: int,
    S: int,
    D: int,
    causal: bool,
    variants: list[str],
    warmup: int,
    rep: int,
    rounds: int,
    clocks: tuple[str, ...],
) -> dict[str, Any]:
    """One table row: speeds per kernel and clock, keyed ``(kernel, clock)`` (the median of
    ``rounds`` rounds, each timing every kernel on every clock once in turn, so that a drift
    of the GPU's clock hits them alike), the host issue time of :data:`HOST_VARIANT` and FA
    (``host <name>``, microseconds), and per own variant its distance to FA and NaNs."""
    import torch

    from attention_crossval.kernel.adapters.own_sm90 import launch

    gen = torch.Generator(device="cuda").manual_seed(B * S + D)
    q, k, v = (
        torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    )
    scale = D**-0.5
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    outs = {name: torch.full_like(q, float("nan")) for name in [*variants, "fa"]}
    lses = {name: torch.zeros(B, H, S, device="cuda") for name in outs}
    calls: dict[str, Callable[[], object]] = {}  # the peers first, then the own variants
    for name in variants:

        def own(name: str = name) -> None:
            launch(q, k, v, outs[name], lses[name], scale, causal=causal, **VARIANTS[name])

        own.__name__ = f"own-sm90 {name} {B}x{H}x{S} D={D} causal={causal}"
        calls[name] = own

    def fa() -> None:
        flash_attn_cute_forward(q, k, v, outs["fa"], lses["fa"], scale, causal)

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D] views

    def cudnn() -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, scale=scale
            )

    calls = {"fa": fa, "cudnn": cudnn, **calls}
    fa.__name__ = f"flash_attn.cute {B}x{H}x{S} D={D} causal={causal}"
    cudnn.__name__ = f"cuDNN SDPA {B}x{H}x{S} D={D} causal={causal}"
    speeds: dict[tuple[str, str], list[float]] = {
        (name, clock): [] for name in calls for clock in clocks
    }
    for _ in range(rounds):
        for name, call in calls.items():
            for clock in clocks:
                speed = tflops(flops, call, warmup=warmup, rep=rep, graph=clock == "graph")
                speeds[name, clock].append(speed)
                print(f"  {call.__name__} ({clock}): {speed:.0f} TFLOP/s", flush=True)
    result: dict[Any, Any] = {key: statistics.median(s) for key, s in speeds.items()}
    for name in (HOST_VARIANT, "fa"):
        result[f"host {name}"] = host_us_per_call(calls[name]) if name in calls else NAN
    for name in variants:
        out = outs[name].float()
        result[f"nan {name}"] = int(out.isnan().sum().item())
        result[f"diff {name}"] = (out - outs["fa"].float()).abs().max().item()
    return result


def table_head(variants: list[str], clocks: tuple[str, ...]) -> str:
    """The markdown table's header (its rows: :func:`table_line`)."""
    kernels = [*(f"own {v}" for v in variants), "FA cute", "cuDNN"]
    head = ["shape (B, H, S, D)", "causal"]
    head += [f"{kernel} ({clock})" for kernel in kernels for clock in clocks]
    head += [f"best own / FA ({clock})" for clock in clocks]
    head += [f"call-time ratio own {HOST_VARIANT} / FA"] if "stream" in clocks else []
    head += [f"host us/call own {HOST_VARIANT}", "host us/call FA"]
    head += [f"max\\|{v}-FA\\|" for v in variants]
    head += [f"NaN {v}" for v in variants]
    return "| " + " | ".join(head) + " |\n" + "|" + "---|" * len(head)


def table_line(
    shape: tuple[int, int, int, int, bool], r: dict, variants: list[str], clocks: tuple[str, ...]
) -> str:
    """One markdown row of a :func:`row` result: per clock, the best own variant's TFLOP/s
    over flash_attn.cute's on that clock; on ``stream``, the call-time ratio of the variant
    the adapters run (:data:`HOST_VARIANT`) to flash_attn.cute (NaN when it was not timed)."""
    B, H, S, D, causal = shape
    cells = [f"{B}x{H}x{S}x{D}", "yes" if causal else "no"]
    cells += [f"{r[name, clock]:.0f}" for name in [*variants, "fa", "cudnn"] for clock in clocks]
    for clock in clocks:
        best = max((r[v, clock] for v in variants if r[v, clock] == r[v, clock]), default=NAN)
        cells.append(f"{best / r['fa', clock]:.2f}")
    if "stream" in clocks:
        cells.append(f"{r.get((HOST_VARIANT, 'stream'), NAN) / r['fa', 'stream']:.2f}")
    cells += [f"{r[f'host {name}']:.1f}" for name in (HOST_VARIANT, "fa")]
    cells += [f"{r[f'diff {v}']:.3g}" for v in variants]
    cells += [str(r[f"nan {v}"]) for v in variants]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"own variants, of {sorted(VARIANTS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--rows", default=None, help=f"comma-separated indices into the {len(ROWS)} rows"
    )
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition, ms")
    parser.add_argument(
        "--rounds", type=int, default=3, help="timing rounds per row; the table has the median"
    )
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="both",
        help="graph: CUDA-graph replays, the kernels' device time; stream: calls launched from "
        "Python, host launch work included (benchmarks/timing.py); both (default): side by side",
    )
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    rows = ROWS if args.rows is None else [ROWS[int(i)] for i in args.rows.split(",")]

    import torch

    start = time.perf_counter()
    print(
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; CPU: {cpu_model()}; "
        f"clock: {args.clock}, median of {args.rounds} rounds",
        flush=True,
    )
    clocks = CLOCKS[args.clock]
    lines = [table_head(variants, clocks)]
    for shape in rows:
        print(f"row {shape}:", flush=True)
        try:
            result = row(*shape, variants, args.warmup, args.rep, args.rounds, clocks)
            lines.append(table_line(shape, result, variants, clocks))
            print(lines[-1], flush=True)  # kept if a later kernel hangs
        except Exception:  # noqa: BLE001 - e.g. out of memory: the next row
            print(f"--- row {shape} failed:", file=sys.stderr)
            traceback.print_exc()
        print(f"row {shape} done at {time.perf_counter() - start:.0f} s", flush=True)
    print("\n".join(lines))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
