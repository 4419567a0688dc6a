"""The peer kernels that the own kernels are timed against, each called one way everywhere.

Shared by benchmarks/bench_own_sm90.py, scripts/gpu/bench_own_sm90_full.py and
scripts/gpu/profile_own_sm90.py; flash_attn is imported only when a peer is called.
"""

from __future__ import annotations

from typing import Any


def flash_attn_cute_forward(
    q: Any, k: Any, v: Any, out: Any, lse: Any, softmax_scale: float, causal: bool
) -> None:
    """flash_attn.cute's forward (its ``_flash_attn_fwd``) on ``[B, S, H, D]`` torch tensors,
    writing into the caller's ``out`` and ``lse [B, H, Sq]``, so nothing is allocated per call."""
    from flash_attn.cute.interface import _flash_attn_fwd

    _flash_attn_fwd(
        q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True, out=out, lse=lse
    )
