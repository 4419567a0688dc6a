"""Long contexts on the GPU (docs/long-context.md): flash-attn-cute at a 64k x 64k causal
prefill and decodes against 128k keys, and on a K of more than 2^31 elements (``gpu-huge``);
a Triton kernel whose bug shows only past 32k keys, caught at 64k. All through the report's
checks; skipped without CUDA, without the kernel's package, or (``gpu-huge``) without the host
and GPU memory, each with the reason. Marked ``long_context``: left out of ``pytest -m gpu``,
run by ``pytest -m long_context`` (properties/long_tests.py). The CPU side is
``test_long_context.py`` and ``test_huge_tensors.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attention_crossval.report.configs import Config, preset

pytestmark = pytest.mark.long_context

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
    from attention_crossval.kernel.harness.isolation import IsolatedKernel
    from attention_crossval.kernel.harness.registry import available
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


def _evaluate(config: Config, kernels: dict[str, str], tmp_path: Path, **options) -> dict:
    """The report's records of ``config`` for each ``kernels`` name -> path, each kernel in its
    own worker; the references are computed once and shared."""
    from attention_crossval.kernel.harness.isolation import IsolatedKernel
    from attention_crossval.report.cache import ExactCache
    from attention_crossval.report.runner import Kernel, RunOptions, evaluate

    workers = {name: IsolatedKernel(path, timeout_s=600.0) for name, path in kernels.items()}
    found = {}
    try:
        chosen = [Kernel(name, worker, worker) for name, worker in workers.items()]
        for record in evaluate(config, chosen, RunOptions(**options), ExactCache(tmp_path)):
            name, timing = record["kernel"]["name"], record.get("timing", {})
            phases = ", ".join(f"{k} {v:.1f}" for k, v in timing.items())
            print(f"{name}: {record['verdict']}; {record['message']}", flush=True)
            print(f"  {phases}\n  findings {record['findings']}", flush=True)
            found[name] = record
    finally:
        for worker in workers.values():
            worker.close()
    return found


_TRITON = "attention_crossval.testing.broken.triton_fa"


@pytest.mark.gpu
@pytest.mark.slow
def test_triton_late_rescale_is_caught_at_64k_keys(tmp_path) -> None:
    """A Triton FlashAttention that stops rescaling O after K block 512 (of 64 keys: key 32768)
    is exact on every row with fewer keys. On a 64k-key ramp (a new max in every block, so
    every late block needs its rescale) the long-context harness (row plan, worst-row scan,
    float64 and exact tiers with the derived bound) fails it; the unbroken kernel passes."""
    pytest.importorskip("triton", reason="triton is not installed")
    config = Config(
        "bfloat16", 64, 256, 65536, Hq=2, Hkv=1, distribution="ramp", name="triton-late-64k"
    )
    kernels = {"late": f"{_TRITON}:late_rescale", "correct": f"{_TRITON}:correct"}
    records = _evaluate(config, kernels, tmp_path, rows=4)
    late, correct = records["late"], records["correct"]
    assert correct["verdict"] == "pass", (correct["message"], correct["findings"])
    assert late["verdict"] == "fail", late
    assert not late["pairs"]["kernel_vs_exact"]["passed"]
    assert "sampling" in late  # checked as a long case


def _huge_memory_reason() -> str | None:
    """Why this host cannot hold gpu-huge (about 64 GiB of host memory at the build's peak and
    40 GiB on the GPU), or None."""
    import torch

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    device = torch.cuda.get_device_properties(0).total_memory / 2**30
    if host < 96 or device < 40:
        return f"gpu-huge needs 96 GiB of host and 40 GiB of GPU memory: {host:.0f}, {device:.0f}"
    return None


@pytest.mark.gpu
@pytest.mark.slow
def test_a_tensor_above_2_31_elements_is_checked(tmp_path, monkeypatch) -> None:
    """``gpu-huge``: a decode against 2^21 + 128 keys, K and V of 2^31 + 2^17 elements each,
    its largest logit on the last key (past element 2^31). flash-attn-cute is checked like any
    long case and must pass; with triton, the Triton kernel passes too (int64 offsets) and its
    int32-offset variant, whose offsets wrap there, must not."""
    from attention_crossval.kernel.harness.registry import available

    reason = _huge_memory_reason()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("ATTENTION_CROSSVAL_MAX_ELEMENTS", "2**32")
    kernels = {}
    if "flash-attn-cute" in available(("flash-attn-cute",)):
        kernels["flash-attn-cute"] = "flash-attn-cute"
    try:
        import triton  # noqa: F401

        kernels |= {"correct": f"{_TRITON}:correct", "int32": f"{_TRITON}:int32_offsets"}
    except ImportError:
        pass
    if not kernels:
        pytest.skip("neither flash_attn.cute nor triton is installed")
    (config,) = preset("gpu-huge")
    records = _evaluate(config, kernels, tmp_path, rows=2)
    for name in ("flash-attn-cute", "correct"):
        if name in records:
            record = records[name]
            assert record["verdict"] == "pass", (record["message"], record["findings"])
    if "int32" in records:
        assert records["int32"]["verdict"] != "pass", records["int32"]
