"""The plug-in contract: what a kernel declares it supports, and how it is called.

A kernel is any object satisfying :class:`KernelAdapter`: a ``spec`` plus ``__call__(case)``.
The framework only generates cases inside ``spec`` (:meth:`KernelSpec.supports`), so a kernel
is never failed for a feature it does not claim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from attention_crossval.reference.case import (
    INPUT_DTYPES,
    AttentionCase,
    AttentionResult,
    CausalAlignment,
)
from attention_crossval.reference.precision import StreamingPrecision

MASK_KINDS = frozenset({"causal", "window", "varlen", "explicit"})
_SETS = (frozenset, set, tuple, list)


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel supports and how its conventions read.

    * ``dtypes``, ``head_dims`` (D; ``head_dims_v`` for Dv, None = must equal D), ``mask_kinds``
      (subset of {causal, window, varlen, explicit}), ``gqa`` (Hq a multiple of Hkv > 1).
    * ``causal_alignment``: the diagonal its causal/window masks use; cases with the other
      alignment are generated only where both agree (Sq == Sk).
    * ``tile_m`` / ``tile_n``: its block sizes; strategies draw lengths around their multiples.
    * ``precision``: its precision chain per input dtype, for the streaming emulation and the bound
      (None = FlashAttention's chain, ``StreamingPrecision.flash_attention(dtype)``).
    * ``returns_lse``: it returns an LSE (natural log: adapters convert a base-2 LSE); a kernel
      declaring it that returns none fails the ``lse`` check.
    * ``device``: "cpu" or "cuda"; ``deterministic``: bitwise-repeatable run to run.
    * ``empty_rows``: what it writes in a valid query row that sees no key: "zero" (O = 0,
      LSE = -inf, the project convention) or "nan" (e.g. a dense softmax over an all-masked row).
    * ``padded_rows``: query rows past ``q_lengths``: "zero" (written as empty rows) or
      "unwritten" (left as they were). Declared differences are checked and translated by the
      harness, never reported as failures.
    * ``softcap``, ``sink``: it takes ``case.softcap`` / ``case.sink`` (default off, so those
      cases are never generated for it).
    """

    name: str
    dtypes: frozenset[str] = frozenset({"float16", "bfloat16"})
    head_dims: frozenset[int] = frozenset({64, 128})
    head_dims_v: frozenset[int] | None = None
    mask_kinds: frozenset[str] = frozenset({"causal"})
    causal_alignment: CausalAlignment = CausalAlignment.BOTTOM_RIGHT
    gqa: bool = True
    tile_m: int = 128
    tile_n: int = 128
    max_seqlen: int = 1 << 16
    precision: dict[str, StreamingPrecision] = field(default_factory=dict)
    returns_lse: bool = True
    device: str = "cuda"
    deterministic: bool = True
    empty_rows: str = "zero"
    padded_rows: str = "zero"
    softcap: bool = False
    sink: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"spec.name={self.name!r} must be a non-empty str")
        for name in ("dtypes", "mask_kinds", "head_dims", "head_dims_v"):
            value = getattr(self, name)
            if not (value is None and name == "head_dims_v") and not isinstance(value, _SETS):
                raise ValueError(
                    f"spec.{name}={value!r} must be a set (frozenset, set, tuple or list), "
                    f"not {type(value).__name__}"
                )
        for name in ("gqa", "returns_lse", "deterministic", "softcap", "sink"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"spec.{name}={getattr(self, name)!r} must be a bool")
        if not isinstance(self.causal_alignment, CausalAlignment):
            raise ValueError(
                f"spec.causal_alignment={self.causal_alignment!r} must be a CausalAlignment "
                f"({', '.join(f'CausalAlignment.{a.name}' for a in CausalAlignment)})"
            )
        if not _is_positive_int(self.max_seqlen):
            raise ValueError(f"spec.max_seqlen={self.max_seqlen!r} must be an int >= 1")
        self._validate_precision()
        unknown = set(self.dtypes) - set(INPUT_DTYPES)
        if unknown or not self.dtypes:
            raise ValueError(
                f"spec.dtypes={sorted(self.dtypes)} must be a non-empty subset of "
                f"{sorted(INPUT_DTYPES)}"
            )
        if set(self.mask_kinds) - MASK_KINDS:
            raise ValueError(
                f"spec.mask_kinds={sorted(self.mask_kinds)} must be a subset of "
                f"{sorted(MASK_KINDS)}"
            )
        for name in ("head_dims", "head_dims_v"):
            dims = getattr(self, name)
            if dims is None and name == "head_dims_v":
                continue
            if not dims or not all(_is_positive_int(d) for d in dims):
                raise ValueError(f"spec.{name}={dims!r} must be a non-empty set of ints >= 1")
        if not (_is_positive_int(self.tile_m) and _is_positive_int(self.tile_n)):
            raise ValueError(
                f"spec.tile_m={self.tile_m!r}, tile_n={self.tile_n!r} must be ints >= 1"
            )
        if self.empty_rows not in ("zero", "nan"):
            raise ValueError(f"spec.empty_rows={self.empty_rows!r} must be 'zero' or 'nan'")
        if self.padded_rows not in ("zero", "unwritten"):
            raise ValueError(f"spec.padded_rows={self.padded_rows!r} must be 'zero' or 'unwritten'")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"spec.device={self.device!r} must be 'cpu' or 'cuda'")

    def _validate_precision(self) -> None:
        if not isinstance(self.precision, dict):
            raise ValueError(f"spec.precision={self.precision!r} must be a dict dtype -> chain")
        for dtype, chain in self.precision.items():
            if dtype not in INPUT_DTYPES or not isinstance(chain, StreamingPrecision):
                raise ValueError(
                    f"spec.precision[{dtype!r}]={chain!r}: keys must be input dtypes "
                    f"{sorted(INPUT_DTYPES)} and values StreamingPrecision chains"
                )

    def precision_for(self, dtype: str) -> StreamingPrecision:
        """The declared precision chain for inputs of ``dtype``."""
        return self.precision.get(dtype) or StreamingPrecision.flash_attention(dtype)

    def unsupported(self, case: AttentionCase) -> str | None:
        """Why ``case`` is outside this declaration, or None if the kernel must handle it."""
        if case.dtype not in self.dtypes:
            return f"dtype {case.dtype} not in {sorted(self.dtypes)}"
        if case.D not in self.head_dims:
            return f"head dim D={case.D} not in {sorted(self.head_dims)}"
        dims_v = self.head_dims_v if self.head_dims_v is not None else {case.D}
        if case.Dv not in dims_v:
            return f"value head dim Dv={case.Dv} not supported (allowed {sorted(dims_v)})"
        missing = case.mask.kinds - self.mask_kinds
        if missing:
            return f"mask kinds {sorted(missing)} not supported"
        if case.group_size > 1 and not self.gqa:
            return "GQA/MQA (Hq > Hkv) not supported"
        if case.softcap is not None and not self.softcap:
            return "softcap not supported"
        if case.sink is not None and not self.sink:
            return "learnable sink not supported"
        if max(case.Sq, case.Sk) > self.max_seqlen:
            return f"sequence length above max_seqlen={self.max_seqlen}"
        aligned = case.mask.causal or "window" in case.mask.kinds
        if (
            aligned
            and case.mask.alignment is not self.causal_alignment
            and not _alignments_agree(case)
        ):
            theirs, ours = case.mask.alignment.value, self.causal_alignment.value
            return f"{theirs} alignment differs from the kernel's {ours}"
        return None

    def supports(self, case: AttentionCase) -> bool:
        return self.unsupported(case) is None


def _is_positive_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def _alignments_agree(case: AttentionCase) -> bool:
    """Both diagonals coincide when every batch has equal valid q and k lengths."""
    return all(case.q_length(b) == case.k_length(b) for b in range(case.B))


@runtime_checkable
class KernelAdapter(Protocol):
    """A kernel plugged into the framework: a declaration plus a call on one case."""

    spec: KernelSpec

    def __call__(self, case: AttentionCase) -> AttentionResult:
        """Run on ``case``; return float64 host arrays in the project layout, lse natural log."""
        ...
