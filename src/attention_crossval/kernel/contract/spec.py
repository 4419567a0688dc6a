"""The plug-in contract: what a kernel declares it supports, and how it is called.

A kernel is any object satisfying :class:`KernelAdapter`: a ``spec`` plus ``__call__(case)``.
The framework only generates cases inside ``spec`` (:meth:`KernelSpec.supports`), so a kernel
is never failed for a feature it does not claim.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import numpy as np

from attention_crossval.kernel.contract.known_findings import KnownFinding
from attention_crossval.reference.case import (
    INPUT_DTYPES,
    LAYOUTS,
    MAX_SPLITS,
    AttentionCase,
    AttentionResult,
    CausalAlignment,
)
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.precision import BackwardPrecision, StreamingPrecision

MASK_KINDS = frozenset({"causal", "window", "varlen", "explicit"})
# The default ``max_seqlen``: the int32 length every kernel interface takes, i.e. no limit of
# its own. A smaller default hid real sizes (a 131072-key decode was reported "unsupported");
# a kernel with a real limit declares it, and long-context strategies and presets generate up
# to it (docs/long-context.md#max-seqlen).
MAX_SEQLEN = (1 << 31) - 1
_SETS = (frozenset, set, tuple, list)
# Set-valued fields and their item type; any of _SETS is accepted and stored as a frozenset.
_SET_FIELDS = {
    "dtypes": ((str,), "str names"),
    "mask_kinds": ((str,), "str names"),
    "head_dims": ((int, np.integer), "ints >= 1"),
    "head_dims_v": ((int, np.integer), "ints >= 1"),
}


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel supports and how its conventions read.

    * ``dtypes``, ``head_dims`` (D; ``head_dims_v`` for Dv, None = must equal D), ``mask_kinds``
      (subset of {causal, window, varlen, explicit}), ``gqa`` (Hq a multiple of Hkv > 1).
    * ``head_dim_pairs``: the (D, Dv) pairs it accepts, for a kernel whose D and Dv are not
      independent (flash_attn.cute on SM90 runs 192/128 but not 64/256); None: every D of
      ``head_dims`` with every Dv of ``head_dims_v``. Each pair lies in those sets and each D
      and Dv there is in some pair, so the sets stay what strategies and reports read.
    * ``causal_alignment``: the diagonal its causal/window masks use; cases with the other
      alignment are generated only where both agree (Sq == Sk).
    * ``tile_m`` / ``tile_n``: its block sizes; strategies draw lengths around their multiples.
    * ``max_seqlen``: its longest Sq or Sk (default :data:`MAX_SEQLEN`, no limit of its own).
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
    * ``known_findings``: checks it is known to fail on some cases (:class:`KnownFinding`):
      such cases stay in scope and are reported as "known" (pytest: xfail), not hidden by a
      narrower declaration.
    * ``backward``: it has a backward pass (``adapter.backward(case) -> Gradients``);
      ``backward_deterministic``: dq/dk/dv bitwise-repeatable run to run (no atomic adds);
      ``backward_precision``: its backward chain per input dtype, for the emulation and the
      gradient bounds (None = FlashAttention's, :meth:`backward_precision_for`);
      ``backward_head_dims``: the head dims (D = Dv) its backward is declared for (None: those
      of the forward), for a kernel whose backward covers less than its forward.
    * ``softcap``, ``sink``: it takes ``case.softcap`` / ``case.sink`` (default off, so those
      cases are never generated for it). ``tanh_error_ulp``: its tanh's relative error in ulps
      of the score dtype, for the softcap bound (2: an accurate tanh; ``tanh.approx.f32``:
      4096, that is 2^-11 / 2^-23).
    * ``descales``: it takes ``case.q_descale`` / ``k_descale`` / ``v_descale`` with FP8 inputs
      (default off, so descaled cases are never generated for it; docs/fp8.md).
    * Call options (``case.page_size``, ``case.num_splits``, ``case.layout``): ``paged`` (it
      reads K/V through a page table), ``max_splits`` (most split-KV splits; 1 = none),
      ``layouts`` (a subset of {padded, packed}).
    * ``kv_blocks``: per head dim D, a K block size that divides every K block the kernel uses
      at that D (e.g. 16 where its tiles are 64, 80 and 112), for the bound and the emulation;
      a D not listed uses ``tile_n``. Finer blocks only count more rescales, so the bound stays
      rigorous for any tiling whose edges fall on the declared block edges.
    * ``validates_lengths``: its API refuses (raises) valid lengths that disagree with its
      tensors: a length past the padded length, a negative one, a count other than B, and
      (packed layout) offsets past the packed rows. A kernel that trusts them reads past its
      tensors (xformers#1122); tests/kernel/test_length_validation.py hands such lengths to the
      kernels declaring it, with NaN guard bands past the tensors (docs/adapters.md).
    """

    name: str
    dtypes: frozenset[str] = frozenset({"float16", "bfloat16"})
    head_dims: frozenset[int] = frozenset({64, 128})
    head_dims_v: frozenset[int] | None = None
    head_dim_pairs: frozenset[tuple[int, int]] | None = None
    mask_kinds: frozenset[str] = frozenset({"causal"})
    causal_alignment: CausalAlignment = CausalAlignment.BOTTOM_RIGHT
    gqa: bool = True
    tile_m: int = 128
    tile_n: int = 128
    max_seqlen: int = MAX_SEQLEN
    precision: dict[str, StreamingPrecision] = field(default_factory=dict)
    returns_lse: bool = True
    device: str = "cuda"
    deterministic: bool = True
    empty_rows: str = "zero"
    padded_rows: str = "zero"
    known_findings: tuple[KnownFinding, ...] = ()
    backward: bool = False
    backward_deterministic: bool = False
    backward_precision: dict[str, BackwardPrecision] = field(default_factory=dict)
    backward_head_dims: frozenset[int] | None = None
    softcap: bool = False
    sink: bool = False
    descales: bool = False
    tanh_error_ulp: float = 2.0
    paged: bool = False
    max_splits: int = 1
    layouts: frozenset[str] = frozenset({"padded"})
    kv_blocks: dict[int, int] = field(default_factory=dict)
    validates_lengths: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"spec.name={self.name!r} must be a non-empty str")
        for name, (kinds, what) in _SET_FIELDS.items():
            value = getattr(self, name)
            if value is None and name == "head_dims_v":
                continue
            if not isinstance(value, _SETS):
                raise ValueError(
                    f"spec.{name}={value!r} must be a set (frozenset, set, tuple or list), "
                    f"not {type(value).__name__}"
                )
            if not all(isinstance(item, kinds) for item in value):  # before hashing: no TypeError
                raise ValueError(f"spec.{name}={value!r} must hold {what} only")
            object.__setattr__(self, name, frozenset(value))  # a list is read as its set
        for name in ("device", "empty_rows", "padded_rows"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"spec.{name}={getattr(self, name)!r} must be a str")
        for name in (
            "gqa", "returns_lse", "deterministic", "softcap", "sink", "paged", "validates_lengths",
            "descales",
        ):  # fmt: skip
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
        self._validate_head_dim_pairs()
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
        self._validate_backward()
        self._validate_call_options()
        self._validate_known_findings()  # after the call options: its features need them

    def _validate_head_dim_pairs(self) -> None:
        pairs = self.head_dim_pairs
        if pairs is None:
            return
        if (
            not isinstance(pairs, _SETS)
            or not pairs
            or not all(
                isinstance(p, tuple) and len(p) == 2 and all(_is_positive_int(d) for d in p)
                for p in pairs
            )
        ):
            raise ValueError(
                f"spec.head_dim_pairs={pairs!r} must be None or a non-empty set of (D, Dv) "
                "tuples of ints >= 1"
            )
        pairs = frozenset((int(d), int(dv)) for d, dv in pairs)
        dims_v = self.head_dims if self.head_dims_v is None else self.head_dims_v
        outside = sorted(p for p in pairs if p[0] not in self.head_dims or p[1] not in dims_v)
        if outside:
            raise ValueError(
                f"spec.head_dim_pairs has {outside} outside spec.head_dims x spec.head_dims_v "
                "(each pair's D must be in head_dims and its Dv in head_dims_v, or in head_dims "
                "when head_dims_v is None)"
            )
        if self.head_dims_v is None and any(d != dv for d, dv in pairs):
            raise ValueError(
                f"spec.head_dim_pairs={sorted(pairs)} has Dv != D but spec.head_dims_v is None "
                "(Dv must equal D): declare head_dims_v too"
            )
        unpaired = sorted(set(self.head_dims) - {d for d, _ in pairs})
        unpaired_v = sorted(set(dims_v) - {dv for _, dv in pairs})
        if unpaired or unpaired_v:
            raise ValueError(
                f"spec.head_dim_pairs={sorted(pairs)} must pair every declared head dim "
                f"(D without a pair: {unpaired}; Dv without a pair: {unpaired_v})"
            )
        object.__setattr__(self, "head_dim_pairs", pairs)

    def value_dims_for(self, D: int) -> tuple[int, ...]:
        """The Dv values declared with ``D``, sorted (what strategies draw Dv from)."""
        if self.head_dim_pairs is not None:
            return tuple(sorted(dv for d, dv in self.head_dim_pairs if d == D))
        return (D,) if self.head_dims_v is None else tuple(sorted(self.head_dims_v))

    def _validate_call_options(self) -> None:
        ulp = self.tanh_error_ulp
        if isinstance(ulp, bool) or not isinstance(ulp, (int, float)) or not 0 <= ulp < 2**20:
            raise ValueError(f"spec.tanh_error_ulp={ulp!r} must be a float in [0, 2^20)")
        if not _is_positive_int(self.max_splits) or self.max_splits > MAX_SPLITS:
            raise ValueError(f"spec.max_splits={self.max_splits!r} must be an int in [1, 256]")
        layouts = self.layouts
        if not isinstance(layouts, _SETS) or not layouts or not set(layouts) <= set(LAYOUTS):
            raise ValueError(
                f"spec.layouts={layouts!r} must be a non-empty set, a subset of {list(LAYOUTS)}"
            )
        object.__setattr__(self, "layouts", frozenset(layouts))
        blocks = self.kv_blocks
        if not isinstance(blocks, dict) or not all(
            _is_positive_int(d) and _is_positive_int(n) for d, n in blocks.items()
        ):
            raise ValueError(
                f"spec.kv_blocks={blocks!r} must be a dict head dim D -> K block size (ints >= 1)"
            )

    def block_n_for(self, case: AttentionCase) -> int:
        """The K block the bound and the emulation use for ``case`` (``kv_blocks``)."""
        return self.kv_blocks.get(case.D, self.tile_n)

    def _validate_precision(self) -> None:
        if not isinstance(self.precision, dict):
            raise ValueError(f"spec.precision={self.precision!r} must be a dict dtype -> chain")
        for dtype, chain in self.precision.items():
            if dtype not in INPUT_DTYPES or not isinstance(chain, StreamingPrecision):
                raise ValueError(
                    f"spec.precision[{dtype!r}]={chain!r}: keys must be input dtypes "
                    f"{sorted(INPUT_DTYPES)} and values StreamingPrecision chains"
                )

    def _validate_known_findings(self) -> None:
        known = self.known_findings
        if not isinstance(known, tuple) or not all(isinstance(k, KnownFinding) for k in known):
            raise ValueError(
                f"spec.known_findings={known!r} must be a tuple of KnownFinding "
                "(kernel.contract.known_findings)"
            )
        for index, finding in enumerate(known):
            if not finding.mask_kinds <= set(self.mask_kinds):
                raise ValueError(
                    f"spec.known_findings[{index}].mask_kinds={sorted(finding.mask_kinds)} must "
                    f"be a subset of spec.mask_kinds={sorted(self.mask_kinds)} (else it never "
                    "applies)"
                )
            if not finding.features <= self.surface_features:
                raise ValueError(
                    f"spec.known_findings[{index}].features={sorted(finding.features)} must be "
                    f"features the spec declares ({sorted(self.surface_features)}; else it "
                    "never applies)"
                )

    @property
    def surface_features(self) -> frozenset[str]:
        """The forward-surface features of a case's own fields that this spec declares
        (``kernel.contract.known_findings.FINDING_FEATURES``: softcap, sink, paged, splits,
        packed)."""
        declared = {
            "softcap": self.softcap,
            "sink": self.sink,
            "paged": self.paged,
            "splits": self.max_splits > 1,
            "packed": "packed" in self.layouts,
        }
        return frozenset(name for name, on in declared.items() if on)

    def _validate_backward(self) -> None:
        for name in ("backward", "backward_deterministic"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"spec.{name}={getattr(self, name)!r} must be a bool")
        if not isinstance(self.backward_precision, dict):
            raise ValueError(
                f"spec.backward_precision={self.backward_precision!r} must be a dict dtype -> chain"
            )
        for dtype, chain in self.backward_precision.items():
            if dtype not in INPUT_DTYPES or not isinstance(chain, BackwardPrecision):
                raise ValueError(
                    f"spec.backward_precision[{dtype!r}]={chain!r}: keys must be input dtypes "
                    f"{sorted(INPUT_DTYPES)} and values BackwardPrecision chains"
                )
        if not self.backward and (
            self.backward_deterministic or self.backward_precision or self.backward_head_dims
        ):
            raise ValueError(
                "spec.backward_deterministic, spec.backward_precision and spec.backward_head_dims "
                "need spec.backward=True"
            )
        dims = self.backward_head_dims
        if dims is not None:
            if (
                not isinstance(dims, _SETS)
                or not all(_is_positive_int(d) for d in dims)
                or not dims
            ):
                raise ValueError(
                    f"spec.backward_head_dims={dims!r} must be None or a non-empty set of ints >= 1"
                )
            if not set(dims) <= set(self.head_dims):
                raise ValueError(
                    f"spec.backward_head_dims={sorted(dims)} must be a subset of "
                    f"spec.head_dims={sorted(self.head_dims)}"
                )
            object.__setattr__(self, "backward_head_dims", frozenset(dims))

    def backward_precision_for(self, dtype: str) -> BackwardPrecision:
        """The declared backward chain for inputs of ``dtype``; by default FlashAttention's
        after the declared forward chain, dQ partials in a fixed order only when the backward
        is declared deterministic."""
        if dtype in self.backward_precision:
            return self.backward_precision[dtype]
        chain = BackwardPrecision.flash_attention(
            dtype, deterministic=bool(self.backward_deterministic)
        )
        return replace(chain, forward=self.precision_for(dtype))

    def precision_for(self, dtype: str) -> StreamingPrecision:
        """The declared precision chain for inputs of ``dtype``."""
        return self.precision.get(dtype) or StreamingPrecision.flash_attention(dtype)

    def unsupported(self, case: AttentionCase) -> str | None:
        """Why ``case`` is outside this declaration, or None if the kernel must handle it."""
        if case.dtype not in self.dtypes:
            return f"dtype {case.dtype} not in {sorted(self.dtypes)}"
        if case.descaled and not self.descales:
            return "q/k/v descales not declared (spec.descales)"
        chain_out = self.precision_for(case.dtype).output_dtype
        if case.output_dtype is not None and chain_out not in (None, case.output_dtype):
            return f"output_dtype {case.output_dtype} is not the chain's {chain_out}"
        if case.D not in self.head_dims:
            return f"head dim D={case.D} not in {sorted(self.head_dims)}"
        dims_v = self.head_dims_v if self.head_dims_v is not None else {case.D}
        if case.Dv not in dims_v:
            return f"value head dim Dv={case.Dv} not supported (allowed {sorted(dims_v)})"
        if self.head_dim_pairs is not None and (case.D, case.Dv) not in self.head_dim_pairs:
            return (
                f"head dims (D={case.D}, Dv={case.Dv}) not a declared pair "
                f"(head_dim_pairs {sorted(self.head_dim_pairs)})"
            )
        missing = case.mask.kinds - self.mask_kinds
        if missing:
            return f"mask kinds {sorted(missing)} not supported"
        if case.group_size > 1 and not self.gqa:
            return "GQA/MQA (Hq > Hkv) not supported"
        if case.softcap is not None and not self.softcap:
            return "softcap not supported"
        if case.sink is not None and not self.sink:
            return "learnable sink not supported"
        if case.page_size is not None and not self.paged:
            return "paged KV (page_size) not supported"
        if case.num_splits > self.max_splits:
            return f"num_splits={case.num_splits} above max_splits={self.max_splits}"
        if case.layout not in self.layouts:
            return f"layout {case.layout!r} not in {sorted(self.layouts)}"
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


@runtime_checkable
class BackwardKernelAdapter(KernelAdapter, Protocol):
    """A kernel whose ``spec.backward`` is True: it also computes dq, dk and dv."""

    def backward(self, case: BackwardCase) -> Gradients:
        """Forward then backward on ``case``; float64 host arrays in the project layout, dk/dv
        summed over each GQA group (conventions: :mod:`reference.gradients`)."""
        ...
