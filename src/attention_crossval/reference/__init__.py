"""Reference tiers for cross-validating softmax-attention kernels.

Glossary (used everywhere in this project):

* Layout as FlashAttention: ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``,
  ``o [B, Sq, Hq, Dv]``, ``lse [B, Hq, Sq]``. Query head ``h`` reads kv head ``h // (Hq // Hkv)``.
* ``softmax_scale``: multiplies the scores ``q . k``; defaults to ``1/sqrt(D)``.
* ``LOG2_E``, ``scale_log2 = LOG2_E * softmax_scale``: the one constant folded into ``exp2``.
* ``row_max``: running maximum of the *unscaled* scores of a query row; ``row_sum``: the running
  sum of ``exp2((s - row_max) * scale_log2)``.
* ``lse``: log-sum-exp of the scaled scores, always the natural log. A query row that sees no key
  (an *empty row*) has ``O = 0`` and ``lse = -inf``.
* Suffixes: ``_bits`` (binary precision), ``_ulp`` (units in the last place of a named dtype),
  ``_bound`` (a certified or derived upper bound on an absolute error).

Tiers: ``exact`` (mpmath, certified), ``streaming`` (NumPy online softmax emulating a kernel's
precision chain), and the kernels in the ``kernel`` package.
"""
