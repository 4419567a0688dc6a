"""A CPU kernel whose bug shows only past 32k keys: the O rescale is skipped after K block 256.

Long-context kernels switch code paths at long KV lengths (split heuristics, a second loop, a
wider counter); a bug there is invisible on every case a short-context suite draws. This NumPy
kernel is the streaming tier with one textual mutation (as :mod:`testing.mutants` makes
them): ``O = O * alpha + P V`` drops ``alpha`` for key blocks at or past ``LATE_KEYS`` (block 256
of 128 keys), while ``row_sum`` is still rescaled. Any row that sees more than 32768 keys and
whose running max rises after them gets a wrong O; every shorter row is exact.

``--kernel kernel.broken.cpu_long:late_rescale`` is the broken one, ``:correct`` the same
adapter with the unmutated tier (the control: it must pass the same checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.precision import StreamingPrecision

LATE_KEYS = 256 * 128  # the first key whose block skips the O rescale
TILE = 128
_RESCALE = "O = O * alpha[:, None] + P_mma.astype(accum_dtype) @ V  # O = O * alpha + P V"
_LATE = (
    f"O = O * np.where(cols.start < {LATE_KEYS}, alpha, 1)[:, None] + P_mma.astype(accum_dtype) @ V"
)


def _spec(name: str) -> KernelSpec:
    return KernelSpec(
        name=name,
        dtypes=frozenset({"float16", "bfloat16"}),
        head_dims=frozenset({64, 128}),
        mask_kinds=frozenset({"causal", "window", "varlen"}),
        tile_m=TILE,
        tile_n=TILE,
        device="cpu",
    )


@dataclass
class LongContextKernel:
    """The streaming tier as a CPU kernel, mutated (``late=True``) or not."""

    late: bool
    spec: KernelSpec = field(default_factory=lambda: _spec("cpu-long"))
    _attention: Any = field(default=None, repr=False)

    def __call__(self, case: AttentionCase) -> AttentionResult:
        if self._attention is None:
            self._attention = _attention(self.late)
        precision = StreamingPrecision.flash_attention(case.dtype)
        return self._attention(case, precision, block_m=TILE, block_n=TILE)


def _attention(late: bool) -> Any:
    """``streaming_attention``, with the late-rescale mutation when ``late``."""
    if not late:
        from attention_crossval.reference.streaming import streaming_attention

        return streaming_attention
    from attention_crossval.testing.mutants import Mutation, mutated_module

    module = "attention_crossval.reference.streaming"
    mutation = Mutation(module, _RESCALE, _LATE)
    return mutated_module(module, [mutation], "late_rescale").streaming_attention


def late_rescale() -> LongContextKernel:
    return LongContextKernel(late=True, spec=_spec("cpu-long-late-rescale"))


def correct() -> LongContextKernel:
    return LongContextKernel(late=False, spec=_spec("cpu-long-correct"))
