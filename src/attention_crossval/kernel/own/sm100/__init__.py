"""The project's own SM100 (Blackwell, tcgen05) kernels; ``fwd``: the FlashAttention forward.

Compile-only: no Blackwell GPU is available, so these kernels have never run.
"""
