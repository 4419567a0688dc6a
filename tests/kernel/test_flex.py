"""The flex-attention adapter's own logic on CPU: its mask_mod (causal in both alignments,
windows, valid lengths, explicit masks), softcap score_mod, GQA and natural-log LSE against the
references, through FlexAttention's uncompiled CPU path (``kernel.adapters.flex.on_cpu``).

Skipped without torch (CI has none). The GPU kernel itself runs under ``pytest -m gpu``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.registry import BUILTIN, GPU_BUILTIN
from attention_crossval.reference.case import AttentionCase, CausalAlignment, Mask

pytestmark = pytest.mark.cpu


def _case(B: int, Sq: int, Sk: int, Hq: int, Hkv: int, mask: Mask, **options) -> AttentionCase:
    rng = np.random.default_rng(Sq * Sk)
    q, k, v = (
        rng.standard_normal(shape).astype(np.float16)
        for shape in ((B, Sq, Hq, 64), (B, Sk, Hkv, 64), (B, Sk, Hkv, 64))
    )
    return AttentionCase(q, k, v, mask=mask, **options)


CASES = {
    "causal-varlen-gqa": _case(
        2, 40, 70, 4, 2, Mask(causal=True, q_lengths=(40, 5), k_lengths=(70, 0))
    ),
    "window-top-left": _case(
        1, 30, 50, 2, 1, Mask(window_left=5, window_right=2, alignment=CausalAlignment.TOP_LEFT)
    ),
    "softcap-explicit": _case(
        2,
        20,
        36,
        2,
        2,
        Mask(explicit=np.random.default_rng(1).random((2, 1, 20, 36)) < 0.3),
        softcap=2.0,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flex_adapter_matches_the_references_on_cpu(name: str) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    from attention_crossval.kernel.adapters.flex import on_cpu

    # The uncompiled path multiplies masked V by zero weights (0 * NaN): the NaN checks are the
    # compiled kernel's, on the GPU.
    adapter = dataclasses.replace(on_cpu(), checks=frozenset({"determinism", "nonfinite"}))
    case = CASES[name]
    spec = dataclasses.replace(adapter.spec, causal_alignment=case.mask.alignment)
    run_case(dataclasses.replace(adapter, spec=spec), case).raise_for()


def test_flex_attention_is_a_registered_gpu_builtin() -> None:
    assert BUILTIN["flex-attention"][1] == "torch" and "flex-attention" in GPU_BUILTIN
