"""flash_attn.cute (flash-attn-4): the SM90 path on Hopper (H100/H200), SM100 on Blackwell.

Conventions: bottom-right causal and windows (FlashAttention's), LSE natural log in
``[B, Hq, Sq]``, empty rows O = 0 and LSE = -inf (the project's convention). Varlen is passed as
``seqused_q`` / ``seqused_k`` on the padded ``[B, S, H, D]`` layout, which is exactly the case
model's ``q_lengths`` / ``k_lengths``; rows past ``seqused_q`` are not written
(``padded_rows="unwritten"``).

Known finding (``padding-read``, measured on the H200 with flash-attn-4 4.0.0b36): with
``seqused_k`` the kernel reads the K/V rows of the last partial tile past the valid length, even
when that length is 0. Masking gives them weight 0, but ``0 * NaN = NaN``, so NaN there reaches
every row of that batch; large finite values do not.

The call goes through ``flash_attn.cute.interface._flash_attn_fwd`` (private) because only it
takes ``out=`` / ``lse=``: that is what lets the harness prefill outputs with NaN and surround
them with guard bands. The public ``flash_attn_varlen_func`` computes the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attention_crossval.kernel.adapters import _torch
from attention_crossval.kernel.adapters.flash_attn_cute_backward import CuteBackward, seqused
from attention_crossval.kernel.known_findings import KnownFinding
from attention_crossval.kernel.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, CausalAlignment


def _spec() -> KernelSpec:
    return KernelSpec(
        name="flash-attn-cute",
        dtypes=frozenset({"float16", "bfloat16"}),
        head_dims=frozenset({64, 128}),
        mask_kinds=frozenset({"causal", "window", "varlen"}),
        causal_alignment=CausalAlignment.BOTTOM_RIGHT,
        gqa=True,
        tile_m=128,
        tile_n=128,  # SM90 tiles: D=128 -> 128x128; D=64 -> 192x128
        # lengths travel as int32 (seqused_q/k, cu_seqlens) and no smaller limit is documented;
        # checked at 64k prefill and 128k decode by properties/test_long_context.py -m gpu
        max_seqlen=(1 << 31) - 1,
        returns_lse=True,
        deterministic=True,
        padded_rows="unwritten",
        known_findings=(
            KnownFinding(
                check="padding-read",
                mask_kinds=frozenset({"varlen"}),
                reason="with seqused_k it reads K/V past the valid length (the last partial "
                "tile, even for length 0): NaN there reaches every row of that batch, large "
                "finite values do not. Not yet reported upstream.",
                link="https://github.com/Dao-AILab/flash-attention",
            ),
            KnownFinding(  # measured on the H200, 2026-12-01 (test_kernels_backward.py -m gpu)
                check="padding-read",
                mask_kinds=frozenset({"varlen"}),
                reason="the backward with seqused_k reads K/V past the valid length as the "
                "forward does: NaN there makes dq non-finite. Not yet reported upstream.",
                link="https://github.com/Dao-AILab/flash-attention",
                backward=True,
            ),
        ),
        backward=True,  # kernel/adapters/flash_attn_cute_backward.py; atomic dQ adds by default
    )


@dataclass
class FlashAttnCuteAdapter(CuteBackward, _torch.GuardedOutputsAdapter):
    """``flash_attn.cute`` forward with guard-banded, prefilled ``out`` and ``lse`` (and its
    backward, :class:`~kernel.adapters.flash_attn_cute_backward.CuteBackward`)."""

    spec: KernelSpec = field(default_factory=_spec)

    def launch(self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
        from flash_attn.cute.interface import _flash_attn_fwd

        mask = case.mask
        _flash_attn_fwd(
            q,
            k,
            v,
            seqused_q=seqused(mask.q_lengths, q.device),
            seqused_k=seqused(mask.k_lengths, q.device),
            softmax_scale=case.softmax_scale,
            causal=mask.causal,
            window_size_left=mask.window_left,
            window_size_right=mask.window_right,
            return_lse=True,
            out=out,
            lse=lse,
        )


def create() -> FlashAttnCuteAdapter:
    return FlashAttnCuteAdapter()
