"""The project's own SM90 (Hopper, WGMMA) kernels; ``fwd``: the FlashAttention forward."""
