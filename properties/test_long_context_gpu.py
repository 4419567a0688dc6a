"""flash-attn-cute at long contexts on the GPU (docs/long-context.md): a 64k x 64k causal
prefill and decodes against 128k keys, through the report's checks. Skipped without CUDA or
without flash_attn.cute, with the reason. The CPU side of the same machinery is
``test_long_context.py``."""

from __future__ import annotations

import pytest

from attention_crossval.report.configs import preset

_TARGETS = {  # config of the gpu-long preset -> wall-time target in seconds (the issue's)
    "long-prefill-64k": 60.0,
    "long-decode-128k": 20.0,
    "long-decode-128k-b8": 20.0,
}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", list(_TARGETS))
def test_flash_attn_cute_at_long_context(name: str, tmp_path) -> None:
    """The report's checks (NaN prefill, guard bands, determinism, float64 and exact on an
    adversarial row plan with the derived bound) on flash-attn-cute at 64k prefill and 128k
    decode pass, and every phase is timed. The wall-time target is printed, not asserted: a
    cold compile or a loaded host must not turn a correct kernel into a failure."""
    from attention_crossval.kernel.isolation import IsolatedKernel
    from attention_crossval.kernel.registry import available
    from attention_crossval.report.cache import ExactCache
    from attention_crossval.report.runner import Kernel, RunOptions, evaluate

    if "flash-attn-cute" not in available(("flash-attn-cute",)):
        pytest.skip("flash_attn.cute is not installed")
    config = {c.name: c for c in preset("gpu-long")}[name]
    worker = IsolatedKernel("flash-attn-cute", timeout_s=600.0)
    try:
        kernel = Kernel("flash-attn-cute", worker, worker)
        options = RunOptions(rows=8)
        (record,) = evaluate(config, [kernel], options, ExactCache(tmp_path))
    finally:
        worker.close()
    timing = record["timing"]
    phases = ", ".join(f"{k} {v:.1f}" for k, v in timing.items())
    print(f"{name}: {record['verdict']} in {timing['total_s']:.1f} s (target {_TARGETS[name]:g})")
    print(f"  {phases}; sampling {record.get('sampling')}")
    assert record["verdict"] == "pass", (record.get("message"), record["findings"], record["pairs"])
    assert abs(timing["unaccounted_s"]) < 0.05 * timing["total_s"] + 1.0
