"""torch FlexAttention (``torch.nn.attention.flex_attention``), compiled with ``torch.compile``.

Masks go through a ``mask_mod`` built from the case's mask (causal in either alignment, window,
valid lengths, explicit mask as a captured boolean tensor) and ``create_block_mask``; softcap is
a ``score_mod`` on the scaled score, ``cap * tanh(score / cap)`` (FlexAttention scales before
``score_mod``, so the scale enters first, as the case model says); GQA is ``enable_gqa``; the
LSE comes back through ``return_aux=AuxRequest(lse=True)`` (the successor of the deprecated
``return_lse=True``) in natural log.

Declared, and checked on the H200 by the feature sweeps and the free test (torch 2.11: two
cases each of softcap, hidden keys, varlen batches and long decode, all within the bound;
docs/forward-surface.md, "On the H200"):

* the precision chain is FlashAttention's (fp32 scores, exp2 with the scale folded, P rounded to
  the input dtype before P V, the row sum of the unrounded P) without FA4's rescale threshold;
* its K block depends on the GPU and the head dim (32, 64 or 128), so the bound counts K blocks
  of 16 (``kv_blocks``), which divides each;
* its tanh is whatever Inductor lowers ``torch.tanh`` to; declared at ``tanh_error_ulp=4096``
  (``tanh.approx.f32``'s) until measured;
* its two known findings (measured there): a block the block mask marks partial is loaded
  whole, so NaN in padding or behind an explicit mask reaches the rows;
* no learnable sink (a sink would need an extra key column the adapter appends, which would test
  the adapter's arithmetic as much as the kernel's), no paged KV, no split-KV, no packed layout.

Compiles follow dynamo's automatic dynamic shapes (:func:`_flex`): static on a mask kind's first
case, dynamic in what changes after; the mask's lengths and window are captured tensors
(:func:`_mask_mod`), so their values do not recompile, but each new scale does.

``spec.device`` is where the tensors go: "cuda" for the registered kernel; a "cpu" copy
(:func:`on_cpu`) runs the adapter's code (masks, softcap, GQA, LSE) through FlexAttention's
uncompiled path, which materializes the scores: Inductor's CPU backend does not return the LSE
(torch 2.13: "torch.compile on CPU only supports inference and `return_lse` is not supported
yet"). Only the CUDA kernel is the kernel under test.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_crossval.kernel.adapters import _torch
from attention_crossval.kernel.contract.known_findings import KnownFinding
from attention_crossval.kernel.contract.public_call import (
    TORCH_RESULT,
    PublicCall,
    dense_visible_tensor,
)
from attention_crossval.kernel.contract.spec import MASK_KINDS, KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult, CausalAlignment
from attention_crossval.reference.precision import StreamingPrecision

_HALVES = ("float16", "bfloat16")
_HEAD_DIMS = frozenset({64, 128})


def _spec() -> KernelSpec:
    return KernelSpec(
        name="flex-attention",
        dtypes=frozenset(_HALVES),
        head_dims=_HEAD_DIMS,
        mask_kinds=MASK_KINDS,
        causal_alignment=CausalAlignment.BOTTOM_RIGHT,
        gqa=True,
        tile_m=128,
        tile_n=64,
        kv_blocks=dict.fromkeys(_HEAD_DIMS, 16),
        precision={
            d: dataclasses.replace(
                StreamingPrecision.flash_attention(d), rescale_threshold_log2=0.0
            )
            for d in _HALVES
        },
        returns_lse=True,
        deterministic=True,
        softcap=True,
        tanh_error_ulp=4096.0,
        known_findings=(
            KnownFinding(  # measured on the H200 (docs/results-h200.md)
                check="padding-read",
                mask_kinds=frozenset({"varlen"}),
                reason="valid lengths go through mask_mod, and a block the block mask marks "
                "partial is loaded whole: NaN past a sequence's length made 2304 of 3840 rows "
                "non-finite (5 sequences, lengths 0-255). The block mask skips only blocks "
                "it knows are empty, so this is how FlexAttention works, not a defect of one "
                "kernel; padding must be finite.",
                link="https://github.com/pytorch/pytorch",
            ),
            KnownFinding(  # measured on the H200 (docs/results-h200.md)
                check="hidden-nan",
                mask_kinds=frozenset({"explicit"}),
                reason="the same for keys an explicit mask hides from every query: NaN in one "
                "hidden K/V row made all 46 rows of a case non-finite.",
                link="https://github.com/pytorch/pytorch",
            ),
            KnownFinding(  # docs/results-h200.md, "Known findings, reproduced"
                check="hidden-nan",
                mask_kinds=frozenset({"window"}),
                reason="the same for keys a sliding window hides from every query: a causal "
                "decode with a left window of 0 over 2 keys came back non-finite with NaN in "
                "the hidden key.",
                link="https://github.com/pytorch/pytorch",
            ),
        ),
    )


@functools.cache
def _flex(backend: Any) -> Any:
    """``torch.compile(flex_attention)`` for ``backend`` (Inductor for the kernel, a counting
    backend in tests), or the uncompiled ``flex_attention`` for None.

    Static on the first call, then dynamic in whatever changed (dynamo's automatic dynamic
    shapes); with the mask's lengths and window in tensors (:func:`_mask_mod`) later cases of
    a dtype, head dims, head counts and mask kind mostly reuse a compile. Dynamic from the
    first call (``dynamic=True``, sizes of 1 kept symbolic) traced once on the CPU but failed
    Inductor's Triton lowering of every case on the H200 (torch 2.11, "unsupported operand
    type(s) for &: 'floor' and 'Add'"; docs/results-h200.md). Past dynamo's recompile limit
    (8) it would silently run the unfused eager path instead of the kernel under test: the
    limit is raised, and hitting it is an error."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if backend is None:
        return flex_attention
    torch._dynamo.config.recompile_limit = 1 << 12
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, backend=backend)


def _mask_mod(case: AttentionCase, device: str) -> Any:
    """The case's visibility (``reference/masks.py``'s rule) as a FlexAttention ``mask_mod``.

    Lengths, windows and the explicit mask are captured tensors, graph inputs to a compiled
    call, and only the mask kind is Python bools: a captured Python int is a constant dynamo
    specializes on, and recompiles for each new value."""
    import torch

    mask = case.mask
    q_len = _torch.int32_tensor([case.q_length(b) for b in range(case.B)], device)
    k_len = _torch.int32_tensor([case.k_length(b) for b in range(case.B)], device)
    offset = k_len - q_len if mask.alignment is CausalAlignment.BOTTOM_RIGHT else q_len * 0
    causal, left, right = mask.causal, mask.window_left, mask.window_right
    windows = _torch.int32_tensor([left or 0, right or 0], device)
    shape = (case.B, case.Hq, case.Sq, case.Sk)
    explicit = None
    if mask.explicit is not None:
        explicit = torch.from_numpy(np.broadcast_to(mask.explicit, shape).copy()).to(device)

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        ok = (q < q_len[b]) & (kv < k_len[b])
        diagonal = q + offset[b]
        if causal:
            ok = ok & (kv <= diagonal)
        if left is not None:
            ok = ok & (kv >= diagonal - windows[0])
        if right is not None:
            ok = ok & (kv <= diagonal + windows[1])
        if explicit is not None:
            ok = ok & explicit[b, h, q, kv]
        return ok

    return mask_mod


@dataclass
class FlexAttentionAdapter:
    """FlexAttention on ``[B, H, S, D]`` views of the NaN-guarded inputs; it allocates its own
    outputs, so the output guard and prefill checks do not apply."""

    spec: KernelSpec = field(default_factory=_spec)
    checks: frozenset[str] = frozenset({"padding-read", "hidden-nan", "determinism", "nonfinite"})
    backend: Any = "inductor"  # torch.compile's; None: the uncompiled path

    def __call__(self, case: AttentionCase) -> AttentionResult:
        import torch
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

        device = self.spec.device
        q, k, v = (_torch.to_device(getattr(case, n), device).transpose(1, 2) for n in "qkv")
        block_mask = create_block_mask(
            _mask_mod(case, device), case.B, case.Hq, case.Sq, case.Sk, device=device
        )
        score_mod = None
        if case.softcap is not None:
            # A captured tensor, not a Python float: dynamo turns a float into a CPU float64
            # input that Inductor cannot lower inside flex_attention ("unbacked_bindings",
            # torch 2.11 on the H200); one compiled kernel then serves every cap.
            cap = torch.tensor(case.softcap, dtype=torch.float32, device=device)
            score_mod = lambda s, b, h, q, kv: cap * torch.tanh(s / cap)  # noqa: E731
        with warnings.catch_warnings():  # the uncompiled path warns that it is not fused
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            o, aux = _flex(self.backend)(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_mask,
                scale=case.softmax_scale,
                enable_gqa=case.group_size > 1,
                return_aux=AuxRequest(lse=True),
            )
        if device == "cuda":
            torch.cuda.synchronize()
        return AttentionResult(o=_torch.to_host(o.transpose(1, 2)), lse=_torch.to_host(aux.lse))

    def repro_call(self, case: AttentionCase) -> PublicCall:
        """The public call a reproducer script makes (kernel/contract/public_call.py): compiled
        ``flex_attention`` with a block mask from the visible keys (a lookup ``mask_mod``: the
        same blocks as :func:`_mask_mod`'s), softcap as a ``score_mod``, the LSE through
        ``AuxRequest``."""
        cap = []
        score_mod = "None"
        if case.softcap is not None:
            cap = ["cap = torch.tensor(SOFTCAP, dtype=torch.float32, device='cuda')"]
            score_mod = "lambda s, b, h, i, j: cap * torch.tanh(s / cap)"
        gqa = ", enable_gqa=True" if case.group_size > 1 else ""
        return PublicCall(
            api="torch.nn.attention.flex_attention.flex_attention (torch.compile)",
            imports=(
                "import torch",
                "from torch.nn.attention.flex_attention import AuxRequest, create_block_mask",
                "from torch.nn.attention.flex_attention import flex_attention",
            ),
            lines=(
                "qt, kt, vt = (to_torch(x).transpose(1, 2) for x in (q, k, v))",
                dense_visible_tensor("seen"),
                "B, Hq, Sq, Sk = seen.shape",
                "block_mask = create_block_mask(",
                "    lambda b, h, i, j: seen[b, h, i, j], B, Hq, Sq, Sk, device='cuda'",
                ")",
                *cap,
                "out, aux = torch.compile(flex_attention)(",
                f"    qt, kt, vt, score_mod={score_mod}, block_mask=block_mask, scale=SCALE{gqa},",
                "    return_aux=AuxRequest(lse=True),",
                ")",
                "out = out.transpose(1, 2)",
                *TORCH_RESULT,
                "lse = aux.lse.double().cpu().numpy()",
            ),
            torch=True,
        )


def create() -> FlexAttentionAdapter:
    return FlexAttentionAdapter()


def on_cpu() -> FlexAttentionAdapter:
    """The same adapter on CPU tensors (Inductor's CPU backend), for tests without a GPU."""
    return FlexAttentionAdapter(spec=dataclasses.replace(_spec(), device="cpu"), backend=None)
