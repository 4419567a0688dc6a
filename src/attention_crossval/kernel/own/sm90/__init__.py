"""The project's own SM90 (Hopper, WGMMA) kernels; ``fwd``: the FlashAttention forward,
``schedule``: which query tile each of its CTAs computes and which KV blocks that tile visits."""
