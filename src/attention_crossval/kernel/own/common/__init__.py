"""CuTe DSL helpers shared by the project's own kernels (SM90 and SM100).

``mask``: the visibility predicate of ``reference.masks.visible`` (bottom-right causal, sliding
windows, the seqlen_k residue) on a register tile, plus the KV block range a query tile must
visit. ``softmax``: the online softmax (running max, running sum, exp2 with the folded scale,
the empty-row guard and the natural-log LSE). ``host``: the kernels' views of the project
layout and the compile-only build on fake tensors. ``params``: the parameter objects the
kernels' roles take (MMAs, TMA operands, output, pipeline sides, the query tile).

Importing this package needs ``cutlass`` (nvidia-cutlass-dsl); nothing here touches a GPU.
"""
