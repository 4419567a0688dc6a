"""flash-attn-cute's paged KV across head dims, head counts, lengths and page sizes: the verdict's
failed checks for one bf16 decode each (the run behind its paged D = 96 known finding).

    python3 scripts/gpu/flash_attn_paged_probe.py     # on the GPU machine, src/ on PYTHONPATH
"""

import numpy as np

from attention_crossval.kernel.harness.forward import run_case
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.precision import cast_input

adapter = resolve("flash-attn-cute")
rng = np.random.default_rng(0)
for D in (64, 96, 128):
    for H in (1, 2):
        for Sk in (25, 200):
            for page in (1, 2, 16):
                q, k, v = (rng.standard_normal((1, S, H, D)) for S in (1, Sk, Sk))
                arrays = (cast_input(a, "bfloat16") for a in (q, k, v))
                case = AttentionCase(*arrays, page_size=page)
                try:
                    verdict = run_case(adapter, case)
                    checks = sorted({f.check for f in verdict.findings})
                except Exception as error:  # noqa: BLE001 - a refusal is a result too
                    checks = [f"raised {type(error).__name__}: {str(error)[:80]}"]
                print(f"D={D} H={H} Sk={Sk} page={page}: {checks or 'pass'}", flush=True)
