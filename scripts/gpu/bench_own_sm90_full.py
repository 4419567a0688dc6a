"""TFLOP/s of own-sm90, own-sm90-full and flash_attn.cute (bf16, D = 128) on three shapes, on
both clocks of benchmarks/timing.py (``graph``: device time; ``stream``: the Python caller's
time per call), with the largest difference of own-sm90-full's output from each peer's (a fast
wrong kernel is no result). Both own launches run the variant the registered adapters run
(:func:`knobs_from_env`: ``DEFAULT_KNOBS`` unless ``ATTENTION_CROSSVAL_SM90_OVERLAP`` picks
another). Lines starting with ``bench`` are the result."""

from __future__ import annotations

import traceback

import torch

from attention_crossval.kernel.adapters.own_sm90 import knobs_from_env, launch, launch_full
from benchmarks.peers import flash_attn_cute_forward
from benchmarks.timing import tflops


def shape(B: int, Hq: int, Hkv: int, S: int, D: int, causal: bool) -> str:
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    outs = {name: torch.zeros_like(q) for name in ("own", "full", "fa")}
    lses = {name: torch.zeros(B, Hq, S, device="cuda") for name in outs}
    lengths = torch.full((B,), S, dtype=torch.int32, device="cuda")
    scale = D**-0.5
    knobs = knobs_from_env()
    calls = {
        "full": lambda: launch_full(
            q, k, v, outs["full"], lses["full"], scale, causal, lengths, lengths, None, **knobs
        ),
        "fa": lambda: flash_attn_cute_forward(q, k, v, outs["fa"], lses["fa"], scale, causal),
    }
    if Hq == Hkv:
        calls["own"] = lambda: launch(
            q, k, v, outs["own"], lses["own"], scale, causal=causal, **knobs
        )
    flops = 4 * B * Hq * S * S * D / (2 if causal else 1)
    speeds = {
        (name, clock): tflops(flops, call, graph=clock == "graph")
        for name, call in calls.items()
        for clock in ("graph", "stream")
    }
    diffs = {
        name: (outs["full"].float() - outs[name].float()).abs().max().item()
        for name in calls
        if name != "full"
    }
    cells = " ".join(
        f"{name}({clock})={speeds.get((name, clock), float('nan')):.0f}"
        for name in ("own", "full", "fa")
        for clock in ("graph", "stream")
    )
    diff = " ".join(f"max|full-{name}|={value:.3g}" for name, value in diffs.items())
    return f"bench B={B} Hq={Hq} Hkv={Hkv} S={S} D={D} causal={causal}: TFLOP/s {cells}; {diff}"


for args in (
    (4, 16, 16, 4096, 128, False),
    (4, 16, 16, 4096, 128, True),
    (4, 32, 8, 4096, 128, True),
):
    try:
        print(shape(*args), flush=True)
    except Exception:  # noqa: BLE001 - e.g. out of memory: next shape
        traceback.print_exc()
        print(f"bench {args}: ERROR (traceback above)", flush=True)
