"""CuTe DSL device helpers shared by the project's own kernels (SM90 now, SM100 later).

``mask``: the visibility predicate of ``reference.masks.visible`` (bottom-right causal, seqlen_k
residue) on a register tile, plus the KV block range a query tile must visit.
``softmax``: the online softmax (running max, running sum, exp2 with the folded scale, the
empty-row guard and the natural-log LSE).

Importing this package needs ``cutlass`` (nvidia-cutlass-dsl); nothing here touches a GPU.
"""
