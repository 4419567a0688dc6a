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


def test_one_compile_serves_every_length_batch_scale_and_window_of_a_mask_kind() -> None:
    """The adapter's ``torch.compile`` (dynamic shapes, tensors in the mask_mod) traces once
    per mask kind and size-1 class, not per case: FlexAttention's GQA copy guards on a batch
    and a query length of 1 (one trace each), and every other batch, length, scale and window
    reuses a trace (dynamo's own counter, on the CPU; the masks' values are checked by the
    tests above through the same mask_mod)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch._dynamo.testing import CompileCounter

    from attention_crossval.kernel.adapters.flex import on_cpu

    counter = CompileCounter()
    adapter = dataclasses.replace(on_cpu(), backend=counter)

    def window(B: int, Sq: int, Sk: int, left: int, scale: float = 0.125) -> AttentionCase:
        mask = Mask(causal=True, window_left=left, alignment=CausalAlignment.TOP_LEFT)
        return _case(B, Sq, Sk, 4, 2, mask, softmax_scale=scale)

    def traces(cases: list[AttentionCase]) -> int:
        for case in cases:
            adapter(case)
        return counter.frame_count

    assert traces([window(2, 40, 70, 3), window(3, 33, 65, 5, 0.1), window(2, 129, 300, 0)]) == 1
    assert traces([window(1, 40, 70, 3), window(2, 1, 257, 7)]) == 3  # the size-1 classes
    assert traces([window(1, 64, 129, 9, 0.2), window(3, 1, 100, 2), window(2, 7, 8, 1)]) == 3
    lengths = Mask(q_lengths=(17, 3), k_lengths=(90, 20))
    assert traces([_case(2, 17, 90, 4, 2, lengths), _case(2, 17, 130, 4, 2, lengths)]) == 4


def test_the_sparse_block_size_is_a_constant_of_the_compiled_call() -> None:
    """Only tensors and lengths are inputs of the compiled call: a block size passed in with
    the BlockMask becomes a symbol under ``dynamic=True``, which Inductor's Triton lowering of
    flex_attention failed on (torch 2.11, every case on the H200)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from attention_crossval.kernel.adapters.flex import on_cpu

    inputs: list[str] = []

    def backend(graph, example_inputs):
        inputs.extend(node.name for node in graph.graph.nodes if node.op == "placeholder")
        return graph.forward

    dataclasses.replace(on_cpu(), backend=backend)(CASES["causal-varlen-gqa"])
    assert inputs and not [name for name in inputs if "block_size" in name.lower()], inputs
