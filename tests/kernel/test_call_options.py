"""Call options (paged KV, split-KV, packed varlen) through the case model and the kernel tier.

The CPU ``streaming-fa`` kernel reads each sequence through the layouts
(:mod:`kernel.contract.call_options`); it must give bitwise what the split-KV streaming tier gives
on the
logical case, and pass the harness. One deliberately broken kernel per option
(``testing/broken/cpu_call_options.py``) fails its named checks on a trigger case, where the
correct kernel passes.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from attention_crossval.kernel.adapters.streaming import StreamingAdapter
from attention_crossval.kernel.contract.call_options import paged_layout
from attention_crossval.kernel.harness.forward import fill_padding, run_case
from attention_crossval.kernel.harness.isolation import IsolatedKernel
from attention_crossval.reference.case import AttentionCase, Mask
from attention_crossval.reference.splitkv import splitkv_attention
from attention_crossval.testing.broken import cpu_call_options

pytestmark = pytest.mark.cpu

OPTIONS = [
    dict(page_size=3),
    dict(page_size=64),
    dict(num_splits=5),
    dict(layout="packed"),
    dict(page_size=17, num_splits=3, layout="packed"),
]


def _case(**options: object) -> AttentionCase:
    """Three sequences of different lengths, one with no keys, GQA, a sink."""
    rng = np.random.default_rng(11)
    B, Sq, Sk, Hq, Hkv, D = 3, 70, 150, 4, 2, 32
    q, k, v = (
        rng.standard_normal(shape).astype(np.float16)
        for shape in ((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D))
    )
    mask = Mask(causal=True, q_lengths=(70, 5, 33), k_lengths=(150, 0, 100))
    sink = np.float32([0.5, -1.0, 2.0, 0.0])
    return AttentionCase(q, k, v, mask=mask, sink=sink, label="call options", **options)


def test_call_options_are_saved_and_loaded(tmp_path) -> None:
    case = _case(page_size=17, num_splits=3, layout="packed")
    loaded = AttentionCase.load(case.save(tmp_path / "case.npz"))
    assert (loaded.page_size, loaded.num_splits, loaded.layout) == (17, 3, "packed")
    assert loaded.call_options == {"paged", "splits", "packed"}
    plain = AttentionCase.load(_case().save(tmp_path / "plain.npz"))
    assert (plain.page_size, plain.num_splits, plain.layout) == (None, 1, "padded")
    assert np.isnan(loaded.page_fill) and np.isnan(plain.page_fill)  # NaN: the default
    clean = dataclasses.replace(case, page_fill=0)
    assert AttentionCase.load(clean.save(tmp_path / "clean.npz")).page_fill == 0.0
    assert "page_size=17 num_splits=3 layout=packed" in case.describe()


def test_page_fill_is_what_unused_page_slots_hold() -> None:
    """NaN by default in every slot no sequence may read; ``fill_padding`` sets it with the
    padding, so the harness's clean run hands a paged kernel zeros there."""
    case = _case(page_size=64)
    slots = [paged_layout(c).k_pages for c in (case, fill_padding(case, 0.0))]
    poisoned, clean = (np.isnan(s.astype(np.float32)) for s in slots)
    assert poisoned.any() and not clean.any()
    assert np.isnan(fill_padding(case, np.nan).page_fill)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_streaming_fa_through_the_layouts_is_the_split_tier(options: dict) -> None:
    """Read through pages and offsets, the kernel gives bitwise the split-KV tier's result on
    the logical case, and passes every check of the harness."""
    adapter = StreamingAdapter()
    case = _case(**options)
    got = adapter(case)
    want = splitkv_attention(
        case,
        adapter.spec.precision_for(case.dtype),
        block_m=adapter.spec.tile_m,
        block_n=adapter.spec.tile_n,
        num_splits=case.num_splits,
    )
    np.testing.assert_array_equal(got.o, want.o)
    np.testing.assert_array_equal(got.lse, want.lse)
    run_case(adapter, case).raise_for()


# A trigger per broken kernel: its option, on the three-sequence case (more splits than the
# two K blocks of the longest sequence, so trailing splits are empty).
TRIGGERS = {
    "page_lookup_off_by_one": dict(page_size=16),
    "empty_split_lse_zero": dict(num_splits=5),
    "packed_offset_overrun": dict(layout="packed"),
}


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_broken_call_option_kernel_is_caught(name: str) -> None:
    """In its worker, as the kernel suite runs it: the named checks fail on the trigger, and
    neither the correct kernel on the trigger nor the broken one without the option fails."""
    case = _case(**TRIGGERS[name])
    worker = IsolatedKernel(f"attention_crossval.testing.broken.cpu_call_options:{name}")
    try:
        assert worker.spec.supports(case)
        failed = {f.check for f in run_case(worker, case).findings}
        assert failed and failed <= cpu_call_options.EXPECTED[name], failed
        plain = dataclasses.replace(case, page_size=None, num_splits=1, layout="padded")
        run_case(worker, plain).raise_for()  # the bug is in the option's path only
    finally:
        worker.close()
    run_case(StreamingAdapter(), case).raise_for()


def test_report_configs_carry_the_call_options_and_keep_old_digests() -> None:
    from attention_crossval.report.configs import Config, preset

    plain = Config("bfloat16", 64, 10, 10)
    assert not {"page_size", "num_splits", "layout"} & set(plain.fields())
    assert plain.digest == Config("bfloat16", 64, 10, 10, page_size=None).digest
    paged = Config("bfloat16", 64, 10, 10, page_size=3, num_splits=2, layout="packed")
    case = paged.build()
    assert (case.page_size, case.num_splits, case.layout) == (3, 2, "packed")
    assert paged.name.endswith("-page3-splits2-packed") and paged.digest != plain.digest
    cases = [c.build() for c in preset("surface")]
    assert set().union(*(c.call_options for c in cases)) == {"paged", "splits", "packed"}
    assert any(c.softcap for c in cases) and any(c.sink is not None for c in cases)
    for bad, message in (
        (dict(page_size=0), "config.page_size=0 must be None or an int >= 1"),
        (dict(num_splits=300), "config.num_splits=300 must be None or an int in [1, 256]"),
        (dict(layout="ragged"), "config.layout='ragged' must be None or one of"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            Config("bfloat16", 64, 10, 10, **bad)
