"""The attention problem every tier consumes: exact inputs, scale, mask, and the result type.

An ``AttentionCase`` is immutable and validated on construction, so a tier never has to guess
what a field means: a malformed case raises ``ValueError`` naming the field and the rule.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from attention_crossval.reference.alignment import CausalAlignment
from attention_crossval.reference.masks import hidden_keys

# Element budget per array (q, k, v and the output o each) of a case or a report config: the
# tiers' float64 copies of a larger case exhaust a workstation, so it is refused up front instead
# of failing with MemoryError. 2**28 is 2 GiB as float64, ten times the largest CPU preset. A
# bigger host raises it for one run through $ATTENTION_CROSSVAL_MAX_ELEMENTS (docs/long-context.md,
# "Tensors above 2^31 elements"), up to MAX_ELEMENTS_CEILING.
MAX_ELEMENTS = 1 << 28
ELEMENTS_ENV = "ATTENTION_CROSSVAL_MAX_ELEMENTS"
# Largest budget the variable may set: keeps Sk * 2**prec_bits of the exact tier below 2**1024
# (reference.exact.MAX_PREC_BITS) and refuses configs no machine holds before anything is built.
MAX_ELEMENTS_CEILING = 1 << 40
# Most splits a split-KV case may ask for (flash_attn.cute's combine takes at most 256).
MAX_SPLITS = 256
# How a kernel is handed q, k, v: padded [B, S, H, X] with valid lengths, or packed varlen
# (concatenated valid rows and cu_seqlens offsets, reference/varlen.py).
LAYOUTS = ("padded", "packed")
# Largest window, in keys: windows wider than any sequence mean "unbounded" (use None); the bound
# keeps ``i + offset +- window`` inside int64 in every tier.
MAX_WINDOW = (1 << 31) - 1

INPUT_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
# FP8 inputs (docs/fp8.md): they alone take descales, and their output is a wider format.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# The 16/32-bit inputs, which are also the output dtypes a case may ask for.
WIDE_DTYPES = ("float16", "bfloat16", "float32")
# The input dtypes NumPy has only through ml_dtypes: saved, and handed to torch, as their bits.
BIT_VIEWED = ("bfloat16", *FP8_DTYPES)
DESCALES = ("q_descale", "k_descale", "v_descale")


def dtype_name(dtype: np.dtype | str) -> str:
    """Canonical name of a supported input dtype (``float16``, ``bfloat16``, ``float32``, or an
    FP8 format of :data:`FP8_DTYPES`)."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in INPUT_DTYPES:
        raise ValueError(f"dtype={name!r} must be one of {sorted(INPUT_DTYPES)}")
    return name


def element_budget() -> int:
    """Elements allowed per array: ``$ATTENTION_CROSSVAL_MAX_ELEMENTS`` (an int, or ``2**N``)
    when set, else :data:`MAX_ELEMENTS`. Read at each check, so a run can raise it."""
    text = os.environ.get(ELEMENTS_ENV, "").strip()
    if not text:
        return MAX_ELEMENTS
    power = re.fullmatch(r"2\*\*(\d{1,3})", text)
    value = 2 ** int(power[1]) if power else int(text) if text.isdigit() else 0
    if not 1 <= value <= MAX_ELEMENTS_CEILING:
        raise ValueError(
            f"{ELEMENTS_ENV}={text!r} must be an int (or 2**N) in [1, 2**40]: elements per array"
        )
    return value


def _power(count: int) -> str:
    return f"2**{count.bit_length() - 1}" if count & (count - 1) == 0 else str(count)


def check_element_budget(
    where: str, shapes: dict[str, tuple[int, ...]], budget: int | None = None
) -> None:
    """ValueError naming the first array of ``shapes`` above ``budget`` elements (default:
    :func:`element_budget`), the limit and how to raise it."""
    limit = element_budget() if budget is None else budget
    for name, shape in shapes.items():
        count = math.prod(shape)
        if count > limit:
            how = (
                f"the most {ELEMENTS_ENV} may allow"
                if limit == MAX_ELEMENTS_CEILING
                else f"{ELEMENTS_ENV} raises it, default MAX_ELEMENTS=2**28"
            )
            raise ValueError(
                f"{where}{name} {list(shape)} has {count} elements: above the element budget "
                f"{_power(limit)} per array ({how})"
            )


def frozen(array: np.ndarray) -> np.ndarray:
    """``array`` as a case holds it: read-only and owning its memory. An array that already is
    both (a case's own, handed on by ``dataclasses.replace`` or
    :func:`kernel.harness.forward.fill_padding`)
    is taken as it is, anything else copied: a derived case of a 4 GiB K costs no copy."""
    if array.flags.owndata and not array.flags.writeable:
        return array
    copy = np.array(array, copy=True)
    copy.setflags(write=False)
    return copy


# Exponent bits of each input dtype: all set means inf or NaN (e4m3fn has no inf: its one NaN
# pattern per sign sets exponent and mantissa, 0x7F).
_EXPONENT = {
    "float16": 0x7C00,
    "bfloat16": 0x7F80,
    "float32": 0x7F800000,
    "float8_e4m3fn": 0x7F,
    "float8_e5m2": 0x7C,
}
_FINITE_CHUNK = 1 << 24  # elements tested at once


def native_byte_order(array: np.ndarray) -> np.ndarray:
    """``array`` in the machine's byte order: the same values, read-only.

    A big-endian (``>f2``, ``>f4``) input is converted rather than refused: the values are
    what the caller meant, and every tier, the bit-level checks and a kernel's buffers assume
    native order (read as native, finite inputs raised IndexError and inf/NaN passed the
    finiteness check). An array already native is returned as it is."""
    if array.dtype.isnative:
        return array
    native = array.astype(array.dtype.newbyteorder("="))
    native.setflags(write=False)
    return native


def as_bits(array: np.ndarray) -> np.ndarray:
    """``array`` viewed as the unsigned integers of its width (no copy): how a
    :data:`BIT_VIEWED` array is stored in an ``.npz`` or passed to ``torch.from_numpy``, which
    know none of those dtypes, bit for bit."""
    return array.view(f"u{array.dtype.itemsize}")


def nonfinite_rows(array: np.ndarray) -> np.ndarray:
    """Bool ``[B, S, H]``: rows of a ``[B, S, H, X]`` input holding an inf or NaN, read from
    the exponent bits in chunks of the sequence axis (no float copy of the input)."""
    B, S, H, X = array.shape
    exponent = _EXPONENT[array.dtype.name]
    unsigned = np.dtype(f"u{array.dtype.itemsize}").newbyteorder(array.dtype.byteorder)
    bits = array.view(unsigned)  # the same byte order as the input's
    bad = np.zeros((B, S, H), dtype=bool)
    step = max(1, _FINITE_CHUNK // max(1, B * H * X))
    for start in range(0, S, step):
        chunk = bits[:, start : start + step]
        bad[:, start : start + step] = ((chunk & exponent) == exponent).any(axis=-1)
    return bad


# The largest softmax_scale a case takes: 1/sqrt(D) is at most 1, and past this the softmax is
# a hard max while the fp32 emulation and the bound overflow.
MAX_SOFTMAX_SCALE = 2.0**20


def default_softmax_scale(D: int) -> float:
    """``1/sqrt(D)``, the scale of a case that names none (D of q and k, not Dv)."""
    return 1.0 / math.sqrt(D)


@dataclass(frozen=True, eq=False)
class Mask:
    """Which keys each query row may see. All constraints combine with AND.

    * ``causal``: key j visible iff ``j <= i + offset`` where ``offset = Sk_b - Sq_b`` for
      ``BOTTOM_RIGHT`` and 0 for ``TOP_LEFT`` (``Sq_b``, ``Sk_b`` the valid lengths of batch b).
    * ``window_left`` / ``window_right``: sliding window, key j visible iff
      ``i + offset - window_left <= j <= i + offset + window_right``; ``None`` = unbounded.
    * ``q_lengths`` / ``k_lengths``: per-batch valid lengths (varlen / padding); zero allowed.
      Query rows past ``q_lengths[b]`` and keys past ``k_lengths[b]`` are padding: a kernel must
      never read them, and padded query rows are empty rows.
    * ``explicit``: boolean array broadcastable to ``[B, Hq, Sq, Sk]``, True = visible.
    """

    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    alignment: CausalAlignment = CausalAlignment.BOTTOM_RIGHT
    q_lengths: tuple[int, ...] | None = None
    k_lengths: tuple[int, ...] | None = None
    explicit: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.alignment, CausalAlignment):
            raise ValueError(f"mask.alignment={self.alignment!r} must be a CausalAlignment")
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"mask.causal={self.causal!r} must be a bool")
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_WINDOW):
                raise ValueError(
                    f"mask.{name}={value!r} must be None (unbounded) or an int in [0, 2**31 - 1]"
                )
        for name in ("q_lengths", "k_lengths"):
            value = getattr(self, name)
            if value is None:
                continue
            sequence = isinstance(value, (tuple, list)) or (
                isinstance(value, np.ndarray) and value.ndim == 1
            )
            lengths = tuple(value) if sequence else (None,)
            if not all(is_int(n) and n >= 0 for n in lengths):
                raise ValueError(f"mask.{name}={value!r} must be a sequence of ints >= 0")
            object.__setattr__(self, name, tuple(int(n) for n in lengths))
        if self.explicit is not None:
            explicit = np.asarray(self.explicit)
            if explicit.dtype != np.bool_ or explicit.ndim != 4:
                raise ValueError(
                    f"mask.explicit must be a bool array of rank 4 broadcastable to "
                    f"[B, Hq, Sq, Sk], got dtype={explicit.dtype} shape={explicit.shape}"
                )
            explicit.setflags(write=False)
            object.__setattr__(self, "explicit", explicit)

    @property
    def kinds(self) -> frozenset[str]:
        """The mask features in use: subsets of {causal, window, varlen, explicit}."""
        kinds = set()
        if self.causal:
            kinds.add("causal")
        if self.window_left is not None or self.window_right is not None:
            kinds.add("window")
        if self.q_lengths is not None or self.k_lengths is not None:
            kinds.add("varlen")
        if self.explicit is not None:
            kinds.add("explicit")
        return frozenset(kinds)

    def describe(self) -> str:
        """Short human-readable summary, e.g. ``causal(bottom_right)+window(16,0)``."""
        parts = []
        if self.causal:
            parts.append(f"causal({self.alignment.value})")
        if "window" in self.kinds:
            parts.append(f"window({self.window_left},{self.window_right})")
        if self.q_lengths is not None:
            parts.append(f"q_lengths={list(self.q_lengths)}")
        if self.k_lengths is not None:
            parts.append(f"k_lengths={list(self.k_lengths)}")
        if self.explicit is not None:
            parts.append("explicit")
        return "+".join(parts) or "none"


def is_int(value: object) -> bool:
    """True for a Python or NumPy integer, False for a bool (which is an int to Python)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True, eq=False)
class AttentionCase:
    """One attention problem with exact inputs; see ``reference`` for the layout glossary.

    ``q``, ``k``, ``v`` hold values of one input dtype (float16, ml_dtypes.bfloat16, float32);
    every tier sees exactly these values. They must be finite except in padding (positions past
    ``mask.q_lengths`` / ``mask.k_lengths``) and, for ``k`` and ``v``, at keys that no query
    can see (:func:`reference.masks.hidden_keys`): no kernel may read those.

    Forward-surface options (flash_attn.cute's ``softcap`` and ``learnable_sink``; both default
    off, docs/forward-surface.md):

    * ``softcap``: logits are ``softcap * tanh(softmax_scale * q.k / softcap)``: the scale enters
      *before* the cap, and the LSE is the log-sum-exp of the capped logits. None = no cap.
    * ``sink``: float32 ``[Hq]``, one extra logit per query head in the softmax denominator that
      carries no value (natural-log units: neither scaled nor capped). A row that sees no key
      then has ``O = 0`` and ``lse = sink[h]``. None = no sink.

    Call options: how the kernel is called, not what it computes (docs/forward-surface.md,
    "Call options"). The exact tier ignores them; the split-KV bound and emulation read
    ``num_splits``; an adapter builds the layout from the logical q, k, v
    (:mod:`kernel.contract.call_options`):

    * ``page_size``: K/V handed over in pages of this many keys through a page table
      (:func:`reference.paged.page_kv`). None = contiguous K/V.
    * ``num_splits``: the keys split over this many partial results and a combine
      (:mod:`reference.splitkv`); 1 = no split.
    * ``layout``: ``"padded"`` (``[B, S, H, X]`` with valid lengths) or ``"packed"`` (the valid
      rows concatenated with ``cu_seqlens``, :mod:`reference.varlen`; with ``page_size`` only q
      is packed and K/V come through the pages).
    * ``page_fill``: what the paged layout holds where no sequence may read (the tail of a
      partly filled last page, unused pages): the paged analogue of padding. NaN by default, so
      a read shows; the harness's clean run puts 0 there as it does in padding
      (:func:`kernel.harness.forward.fill_padding`), which tells such a read (``padding-read``)
      from a
      non-finite result on clean inputs.

    FP8 inputs (``float8_e4m3fn``, ``float8_e5m2``; docs/fp8.md): the case means attention of
    the *dequantized* values ``q q_descale``, ``k k_descale``, ``v v_descale``:

    * ``q_descale``, ``k_descale``, ``v_descale``: float32 ``[B, Hkv]`` (flash_attn.cute's
      convention: query head h reads its kv head's entry), finite and > 0, only with FP8
      inputs; None = 1. A kernel applies ``softmax_scale q_descale k_descale`` to ``Q K^T`` of
      the raw FP8 values and ``v_descale`` at the final normalization.
    * ``output_dtype``: the dtype O is written in. None = the input dtype for 16/32-bit inputs,
      ``bfloat16`` for FP8 inputs (:attr:`out_dtype`); FP8 outputs are not allowed.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    softmax_scale: float | None = None
    mask: Mask = field(default_factory=Mask)
    label: str = ""
    softcap: float | None = None
    sink: np.ndarray | None = None
    page_size: int | None = None
    num_splits: int = 1
    layout: str = "padded"
    page_fill: float = math.nan
    q_descale: np.ndarray | None = None
    k_descale: np.ndarray | None = None
    v_descale: np.ndarray | None = None
    output_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("q", "k", "v"):
            array = getattr(self, name)
            if not isinstance(array, np.ndarray):
                raise ValueError(f"{name} must be a numpy array, got {type(array).__name__}")
            if array.ndim != 4:
                raise ValueError(
                    f"{name} must have rank 4 ({_LAYOUT[name]}), got shape {array.shape}"
                )
            if array.dtype.name not in INPUT_DTYPES:
                raise ValueError(
                    f"{name}.dtype={array.dtype.name} must be one of {sorted(INPUT_DTYPES)}"
                )
            object.__setattr__(self, name, native_byte_order(array))
        (b, sq, hq, _), v_shape = self.q.shape, self.v.shape
        check_element_budget(
            "", {"q": self.q.shape, "k": self.k.shape, "v": v_shape, "o": (b, sq, hq, v_shape[3])}
        )
        if not (self.q.dtype == self.k.dtype == self.v.dtype):
            raise ValueError(
                f"q, k, v must share one dtype, got {self.q.dtype.name}, "
                f"{self.k.dtype.name}, {self.v.dtype.name}"
            )
        self._check_shapes()
        self._check_scale()
        self._check_mask()
        self._check_surface()
        self._check_call_options()
        self._check_quantization()
        for name in ("q", "k", "v"):
            object.__setattr__(self, name, frozen(getattr(self, name)))
        self._check_finite()

    def _check_shapes(self) -> None:
        (B, _, Hq, D), (Bk, Sk, Hkv, Dk), (Bv, Skv, Hv, _) = (
            self.q.shape,
            self.k.shape,
            self.v.shape,
        )
        if (Bk, Bv) != (B, B):
            raise ValueError(f"batch sizes must match: q B={B}, k B={Bk}, v B={Bv}")
        if Skv != Sk:
            raise ValueError(f"k and v must have the same Sk, got k Sk={Sk}, v Sk={Skv}")
        if Hv != Hkv:
            raise ValueError(f"k and v must have the same Hkv, got k Hkv={Hkv}, v Hkv={Hv}")
        if Dk != D:
            raise ValueError(f"q and k must have the same head dim D, got q D={D}, k D={Dk}")
        if min(B, Hq, Hkv, D, self.v.shape[3]) < 1:
            raise ValueError(
                f"B, Hq, Hkv, D, Dv must be >= 1, got q {self.q.shape}, v {self.v.shape}"
            )
        if Hq % Hkv:
            raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv} (GQA/MQA head ratio)")

    def _check_scale(self) -> None:
        scale = self.softmax_scale
        if scale is None:
            object.__setattr__(self, "softmax_scale", default_softmax_scale(self.D))
            return
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
            raise ValueError(f"softmax_scale={scale!r} must be a float")
        try:
            value = float(scale)
        except OverflowError:  # an int beyond the float range
            value = math.inf
        if not (math.isfinite(value) and 0 < value <= MAX_SOFTMAX_SCALE):
            raise ValueError(
                f"softmax_scale={scale!r} must be > 0 and <= 2^20 (a larger scale turns every "
                "softmax into a hard max, and the fp32 emulation and the bound overflow)"
            )
        object.__setattr__(self, "softmax_scale", value)

    def _check_mask(self) -> None:
        mask = self.mask
        if not isinstance(mask, Mask):
            raise ValueError(f"mask must be a reference.case.Mask, got {type(mask).__name__}")
        for name, limit in (("q_lengths", self.Sq), ("k_lengths", self.Sk)):
            lengths = getattr(mask, name)
            if lengths is None:
                continue
            if len(lengths) != self.B:
                raise ValueError(f"mask.{name} must have B={self.B} entries, got {len(lengths)}")
            if max(lengths) > limit:
                raise ValueError(
                    f"mask.{name}={list(lengths)} must not exceed {limit} (padded length)"
                )
        if mask.explicit is not None:
            target = (self.B, self.Hq, self.Sq, self.Sk)
            try:
                broadcasts = np.broadcast_shapes(mask.explicit.shape, target) == target
            except ValueError:
                broadcasts = False
            if not broadcasts:
                raise ValueError(
                    f"mask.explicit shape {mask.explicit.shape} must broadcast to "
                    f"[B, Hq, Sq, Sk]={target}"
                )

    def _check_surface(self) -> None:
        cap = self.softcap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float, np.floating)):
                raise ValueError(f"softcap={cap!r} must be None or a float")
            if not (math.isfinite(float(cap)) and float(cap) > 0):
                raise ValueError(f"softcap={cap!r} must be finite and > 0 (None = no cap)")
            object.__setattr__(self, "softcap", float(cap))
        if self.sink is not None:
            sink = np.asarray(self.sink)
            if sink.shape != (self.Hq,) or sink.dtype.kind != "f":
                raise ValueError(
                    f"sink must be a float array of shape [Hq]=({self.Hq},), "
                    f"got dtype={sink.dtype} shape={sink.shape}"
                )
            sink32 = sink.astype(np.float32)
            if not (np.isfinite(sink32).all() and (sink32 == sink).all()):
                raise ValueError(f"sink={sink.tolist()} must hold finite float32 values")
            sink32.setflags(write=False)
            object.__setattr__(self, "sink", sink32)

    def _check_call_options(self) -> None:
        page_size, num_splits = self.page_size, self.num_splits
        if page_size is not None and (not is_int(page_size) or page_size < 1):
            raise ValueError(
                f"page_size={page_size!r} must be None (contiguous K/V) or an int >= 1"
            )
        if not is_int(num_splits) or not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits={num_splits!r} must be an int in [1, {MAX_SPLITS}]")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {list(LAYOUTS)}")
        if page_size is not None:  # the paged layout's pages (reference.paged.page_kv)
            pages = self.B * -(-self.Sk // page_size) + 1
            check_element_budget(
                f"page_size={page_size}: the paged layout's ",
                {
                    "k_pages": (pages, page_size, self.Hkv, self.D),
                    "v_pages": (pages, page_size, self.Hkv, self.Dv),
                },
            )
        object.__setattr__(self, "page_size", None if page_size is None else int(page_size))
        object.__setattr__(self, "num_splits", int(num_splits))
        fill = self.page_fill
        if isinstance(fill, (bool, np.bool_)) or not isinstance(fill, (int, float, np.number)):
            raise ValueError(f"page_fill={fill!r} must be a float (NaN: a read shows)")
        object.__setattr__(self, "page_fill", float(fill))

    def _check_quantization(self) -> None:
        """Descales only with FP8 inputs, float32 ``[B, Hkv]``, finite and > 0; an output dtype
        of 16 or 32 bits."""
        fp8 = self.dtype in FP8_DTYPES
        for name in DESCALES:
            value = getattr(self, name)
            if value is None:
                continue
            if not fp8:
                raise ValueError(
                    f"{name} is allowed only with FP8 inputs {list(FP8_DTYPES)}, "
                    f"not {self.dtype} (None = no descale)"
                )
            if not isinstance(value, np.ndarray) or value.dtype != np.float32:
                kind = getattr(value, "dtype", type(value).__name__)
                raise ValueError(f"{name} must be a float32 numpy array, got {kind}")
            if value.shape != (self.B, self.Hkv):
                raise ValueError(
                    f"{name} must have shape [B, Hkv]={(self.B, self.Hkv)}, got {value.shape}"
                )
            if not (np.isfinite(value).all() and (value > 0).all()):
                raise ValueError(f"{name}={value.tolist()} must be finite and > 0")
            object.__setattr__(self, name, frozen(native_byte_order(value)))
        out = self.output_dtype
        if out is not None and out not in WIDE_DTYPES:
            raise ValueError(
                f"output_dtype={out!r} must be None or one of {list(WIDE_DTYPES)} "
                "(FP8 outputs are not allowed)"
            )

    @property
    def out_dtype(self) -> str:
        """The dtype O is written in: ``output_dtype``, else the input dtype (16/32-bit
        inputs) or ``bfloat16`` (FP8 inputs)."""
        if self.output_dtype is not None:
            return self.output_dtype
        return "bfloat16" if self.dtype in FP8_DTYPES else self.dtype

    @property
    def descaled(self) -> bool:
        """True when any of q, k, v carries a descale."""
        return any(getattr(self, name) is not None for name in DESCALES)

    def descale(self, name: str, b: int, kv_head: int) -> float:
        """The descale of ``name`` ("q", "k" or "v") for batch ``b`` and ``kv_head``: a float32
        value as a float, 1.0 without one. An FP8 value (at most 4 significant bits) times it
        (24) is exact in float64: the dequantized input the exact tiers read."""
        value = getattr(self, f"{name}_descale")
        return 1.0 if value is None else float(value[b, kv_head])

    def unit_descales(self, b: int, kv_head: int) -> dict[str, np.ndarray | None]:
        """The descales of batch ``b`` and ``kv_head`` as ``[1, 1]`` arrays (None stays None),
        keyword arguments for a case of that batch and kv head alone."""
        return {
            name: None if value is None else value[b : b + 1, kv_head : kv_head + 1].copy()
            for name in DESCALES
            for value in (getattr(self, name),)
        }

    @property
    def call_options(self) -> frozenset[str]:
        """The call options in use: a subset of {paged, splits, packed}."""
        options = {"paged"} if self.page_size is not None else set()
        options |= {"splits"} if self.num_splits > 1 else set()
        return frozenset(options | ({"packed"} if self.layout == "packed" else set()))

    def _check_finite(self) -> None:
        """Chunked over the sequence axis on the bit patterns: no float32 copy of a 4 GiB K."""
        for name, lengths in (
            ("q", self.mask.q_lengths),
            ("k", self.mask.k_lengths),
            ("v", self.mask.k_lengths),
        ):
            array = getattr(self, name)
            bad = nonfinite_rows(array)  # [B, S, H]
            if lengths is not None:
                positions = np.arange(array.shape[1])[None, :]
                bad &= (positions < np.asarray(lengths)[:, None])[:, :, None]
            if bad.any() and name != "q":  # K/V behind a mask may hold anything, as padding
                bad &= ~hidden_keys(self)
            if bad.any():
                b, s, h = (int(i) for i in np.argwhere(bad)[0])
                row = array[b, s, h].astype(np.float32)
                x = int(np.flatnonzero(~np.isfinite(row))[0])
                raise ValueError(
                    f"{name} must be finite outside padding, found {row[x]} at {name}{[b, s, h, x]}"
                )

    # Shape letters, as in the glossary.
    B = property(lambda self: self.q.shape[0])
    Sq = property(lambda self: self.q.shape[1])
    Hq = property(lambda self: self.q.shape[2])
    D = property(lambda self: self.q.shape[3])
    Sk = property(lambda self: self.k.shape[1])
    Hkv = property(lambda self: self.k.shape[2])
    Dv = property(lambda self: self.v.shape[3])

    @property
    def dtype(self) -> str:
        """Input dtype name: ``float16``, ``bfloat16``, ``float32`` or an FP8 format."""
        return self.q.dtype.name

    @property
    def group_size(self) -> int:
        """Query heads per kv head (1 = MHA, Hq = MQA)."""
        return self.Hq // self.Hkv

    def kv_head(self, h: int) -> int:
        """The kv head read by query head ``h``."""
        return h // self.group_size

    def q_length(self, b: int) -> int:
        return self.Sq if self.mask.q_lengths is None else self.mask.q_lengths[b]

    def k_length(self, b: int) -> int:
        return self.Sk if self.mask.k_lengths is None else self.mask.k_lengths[b]

    def describe(self) -> str:
        """One line: shapes, dtype, mask, label."""
        shape = (
            f"B={self.B} Sq={self.Sq} Sk={self.Sk} Hq={self.Hq} Hkv={self.Hkv} "
            f"D={self.D} Dv={self.Dv}"
        )
        label = f" [{self.label}]" if self.label else ""
        mask = self.mask.describe()
        surface = "" if self.softcap is None else f" softcap={self.softcap:.6g}"
        surface += "" if self.sink is None else f" sink={self.sink.tolist()}"
        surface += "" if self.page_size is None else f" page_size={self.page_size}"
        surface += "" if self.num_splits == 1 else f" num_splits={self.num_splits}"
        surface += "" if self.layout == "padded" else f" layout={self.layout}"
        for name in DESCALES:
            value = getattr(self, name)
            surface += "" if value is None else f" {name}={np.round(value, 6).tolist()}"
        surface += "" if self.output_dtype is None else f" output_dtype={self.output_dtype}"
        scale = f"scale={self.softmax_scale:.6g}"
        return f"{shape} {self.dtype} mask={mask} {scale}{surface}{label}"

    def save(self, path: str | Path) -> Path:
        """Write the case to ``.npz`` (bf16 and FP8 stored as unsigned-int bits) so it can be
        replayed."""
        path = Path(path)
        mask = self.mask
        bits = self.dtype in BIT_VIEWED
        arrays = {
            name: as_bits(getattr(self, name)) if bits else getattr(self, name) for name in "qkv"
        }
        extras = {} if mask.explicit is None else {"explicit": mask.explicit}
        if self.softcap is not None:
            extras["softcap"] = self.softcap
        if self.sink is not None:
            extras["sink"] = self.sink
        if self.page_size is not None:
            extras["page_size"] = self.page_size
        if self.num_splits != 1:
            extras["num_splits"] = self.num_splits
        if self.layout != "padded":
            extras["layout"] = self.layout
        if not math.isnan(self.page_fill):
            extras["page_fill"] = self.page_fill
        for name in DESCALES:
            if getattr(self, name) is not None:
                extras[name] = getattr(self, name)
        if self.output_dtype is not None:
            extras["output_dtype"] = self.output_dtype
        np.savez_compressed(
            path,
            **arrays,
            **extras,
            dtype=self.dtype,
            softmax_scale=self.softmax_scale,
            causal=mask.causal,
            alignment=mask.alignment.value,
            window=np.array(
                [-1 if w is None else w for w in (mask.window_left, mask.window_right)]
            ),
            q_lengths=np.array(mask.q_lengths if mask.q_lengths is not None else [-1]),
            k_lengths=np.array(mask.k_lengths if mask.k_lengths is not None else [-1]),
            label=self.label,
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> AttentionCase:
        """Read a case written by :meth:`save`. Every field is checked as it is read: a file
        that is not a saved case raises ValueError ``not a case: field X must be ...``."""
        with np.load(path) as data:
            fields = SavedFields(data)
            dtype = INPUT_DTYPES[fields.text("dtype", tuple(INPUT_DTYPES))]
            q, k, v = (fields.bits(name, dtype) for name in "qkv")
            left, right = fields.window()
            mask = Mask(
                causal=fields.flag("causal"),
                window_left=left,
                window_right=right,
                alignment=CausalAlignment(
                    fields.text("alignment", tuple(a.value for a in CausalAlignment))
                ),
                q_lengths=fields.lengths("q_lengths"),
                k_lengths=fields.lengths("k_lengths"),
                explicit=fields.array("explicit", "b") if "explicit" in data else None,
            )
            return cls(
                q,
                k,
                v,
                fields.number("softmax_scale"),
                mask,
                fields.text("label"),
                softcap=fields.number("softcap") if "softcap" in data else None,
                sink=fields.array("sink", "f") if "sink" in data else None,
                page_size=fields.integer("page_size") if "page_size" in data else None,
                num_splits=fields.integer("num_splits") if "num_splits" in data else 1,
                layout=fields.text("layout", LAYOUTS) if "layout" in data else "padded",
                page_fill=fields.number("page_fill") if "page_fill" in data else math.nan,
                **{name: fields.array(name, "f") for name in DESCALES if name in data},
                output_dtype=(
                    fields.text("output_dtype", WIDE_DTYPES) if "output_dtype" in data else None
                ),
            )


class SavedFields:
    """The arrays of a saved case (:meth:`AttentionCase.save`), each read with its type and
    shape checked: a foreign or damaged file gives one ValueError naming the field and the rule
    (``not a case: field window must hold int or uint``), never an OverflowError from
    ``int(inf)``. The values' ranges are checked once, by :class:`Mask` and
    :class:`AttentionCase`, as for any other caller."""

    def __init__(self, data: np.lib.npyio.NpzFile) -> None:
        self.data = data

    def array(self, name: str, kinds: str) -> np.ndarray:
        """Field ``name`` in native byte order; its dtype kind must be one of ``kinds``."""
        if name not in self.data.files:
            raise ValueError(f"not a case: field {name} is missing")
        value = self.data[name]
        if value.dtype.kind not in kinds:
            names = {"b": "bool", "i": "int", "u": "uint", "f": "float", "U": "str"}
            wanted = " or ".join(names[kind] for kind in kinds)
            raise ValueError(f"not a case: field {name} must hold {wanted}, got {value.dtype}")
        return native_byte_order(value)

    def _scalar(self, name: str, kinds: str, rule: str) -> np.ndarray:
        value = self.array(name, kinds)
        if value.shape != ():
            raise ValueError(f"not a case: field {name} must be {rule}, got shape {value.shape}")
        return value

    def text(self, name: str, choices: tuple[str, ...] | None = None) -> str:
        """A string field, one of ``choices`` when given."""
        value = str(self._scalar(name, "U", "a string"))
        if choices is not None and value not in choices:
            raise ValueError(f"not a case: field {name}={value!r} must be one of {list(choices)}")
        return value

    def flag(self, name: str) -> bool:
        return bool(self._scalar(name, "b", "a bool"))

    def number(self, name: str) -> float:
        """A float (or int) field; its range is the case's to check (NaN is a valid fill)."""
        return float(self._scalar(name, "fiu", "a number"))

    def integer(self, name: str) -> int:
        """An int field; its range is the case's to check."""
        return int(self._scalar(name, "iu", "an int"))

    def bits(self, name: str, dtype: np.dtype) -> np.ndarray:
        """A rank-4 array of ``dtype`` values, stored as such or as unsigned ints of the same
        width (bfloat16 always, ``do`` of a backward case)."""
        value = self.array(name, "fu")
        if value.dtype.itemsize != dtype.itemsize or value.ndim != 4:
            raise ValueError(
                f"not a case: field {name} must be a rank-4 array of {dtype.name} values, "
                f"got {value.dtype} {value.shape}"
            )
        return value.view(dtype)

    def window(self) -> tuple[int | None, int | None]:
        """``(window_left, window_right)`` from two ints, -1 for unbounded (:class:`Mask`
        checks the range)."""
        value = self.array("window", "iu")
        if value.shape != (2,):
            raise ValueError(f"not a case: field window must be 2 ints, got shape {value.shape}")
        left, right = (None if w == -1 else int(w) for w in value)
        return left, right

    def lengths(self, name: str) -> tuple[int, ...] | None:
        """Valid lengths from a 1-d int array, ``[-1]`` for None (:class:`Mask` and the case
        check the values)."""
        value = self.array(name, "iu")
        if value.ndim != 1:
            raise ValueError(f"not a case: field {name} must be 1-d, got shape {value.shape}")
        return None if value.tolist() == [-1] else tuple(int(n) for n in value)


_LAYOUT = {"q": "[B, Sq, Hq, D]", "k": "[B, Sk, Hkv, D]", "v": "[B, Sk, Hkv, Dv]"}


@dataclass(frozen=True, eq=False)
class AttentionResult:
    """Output of any tier: ``o [B, Sq, Hq, Dv]`` and ``lse [B, Hq, Sq]`` (natural log).

    Arrays are float64 holding the values the tier produced (already rounded to its output
    dtype where it emulates one). ``lse`` is None when the tier or kernel does not provide it.
    """

    o: np.ndarray
    lse: np.ndarray | None = None
