"""Report configurations: one frozen value per attention problem, built into a case on demand.

A :class:`Config` names everything that fixes an :class:`~reference.case.AttentionCase`
(dtype, shapes, mask kind, score distribution, seed), so the same config always builds the same
inputs: a report can be resumed, diffed against an older one, and any row replayed. Three sources
of configs: named preset grids (:data:`PRESETS`), a JSON/TOML file (:func:`load_config_file`),
and a Hypothesis-sampled set drawn from ``properties.strategies.attention_cases``
(:func:`sampled_configs`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# The builders of properties.strategies, from its private modules: the public module also loads
# the pytest coverage plugin, and the report must run where pytest is not installed.
from attention_crossval.properties._strategies.fp8 import (
    DESCALE_KINDS,
    fp8_arrays,
    quantized_inputs,
)
from attention_crossval.properties._strategies.gradients import GRADIENT_DISTRIBUTIONS
from attention_crossval.properties._strategies.scores import DISTRIBUTIONS, BuildContext
from attention_crossval.properties._strategies.shapes import Shape
from attention_crossval.reference.case import (
    FP8_DTYPES,
    INPUT_DTYPES,
    LAYOUTS,
    MAX_ELEMENTS_CEILING,
    MAX_SOFTMAX_SCALE,
    MAX_SPLITS,
    WIDE_DTYPES,
    AttentionCase,
    CausalAlignment,
    Mask,
    check_element_budget,
    default_softmax_scale,
)
from attention_crossval.reference.precision import cast_input

MASK_KINDS = (
    "none",
    "causal",
    "causal-top-left",
    "window",
    "varlen",
    "varlen-causal",
    "varlen-window",
    "varlen-long",
    "explicit",
)
# Recipe fields added after reports existed: left out of fields() while None, so older recipes
# keep their digest (resume keys) and their inputs (the NumPy seed hashes the recipe).
_OPTIONAL = (
    "Dv",
    "softmax_scale",
    "softcap",
    "sink",
    "page_size",
    "num_splits",
    "layout",
    "do_distribution",
    "descales",
    "output_dtype",
)


@dataclass(frozen=True)
class Config:
    """One attention problem of a report, by recipe rather than by arrays.

    * ``dtype``: input dtype name; ``D`` head dim of q/k, ``Dv`` of v (None: D); ``Sq``/``Sk``
      padded lengths; ``B``, ``Hq``, ``Hkv`` batch and heads (Hq a multiple of Hkv: GQA when
      larger); ``softmax_scale`` (None: ``1/sqrt(D)``).
    * ``mask``: one of :data:`MASK_KINDS`. ``window`` is a causal band of width ``Sk // 4``
      (bottom-right diagonal); ``varlen*`` gives batch b valid lengths shrinking with b, with
      the causal mask or that window on top; ``varlen-long`` (causal) keeps batch 0 at the
      full lengths and gives the others short ones (``S // 64 + b``): one long sequence packed
      with short ones, as a long-context server batches them. ``explicit``: a fixed boolean
      pattern (:func:`explicit_pattern`) that hides about a fifth of the keys and every key of
      every fourth query row, so those rows are empty (O = 0, LSE = -inf).
    * ``distribution``: a score distribution of ``properties.strategies`` (its builder makes
      the inputs); ``tile_n`` the K block its patterns align to (e.g. ``ramp``: a new max in
      every block); ``noise`` the scale of the non-pattern key coordinates.
    * ``seed``: the NumPy seed the inputs are drawn from.
    * ``softcap``: the case's softcap (None = none); ``sink``: one sink logit for every query
      head, rounded to float32 (None = none). Left out of :meth:`fields` when None, so configs
      without them keep their digests and inputs.
    * Call options, as ``AttentionCase`` has them (left out of :meth:`fields` when None, too):
      ``page_size`` (None: contiguous K/V), ``num_splits`` (None: 1), ``layout`` (None:
      "padded"; or "packed"). A kernel that does not declare one records the config as
      unsupported.
    * ``do_distribution``: the backward pass's dO, a name of
      ``properties.strategies.GRADIENT_DISTRIBUTIONS`` seeded with ``seed`` (None: gaussian);
      left out of :meth:`fields` when None. The forward inputs do not depend on it.
    * FP8 inputs (``dtype`` ``float8_e4m3fn`` / ``float8_e5m2``, docs/fp8.md): the
      distribution's inputs for FP8 (``properties._strategies.fp8.fp8_arrays``: the ramp is
      the creeping ramp) quantized with ``descales``, a kind of
      ``properties._strategies.fp8.DESCALE_KINDS`` for q, k and v alike (None: "none", no
      descales), and ``output_dtype`` the case's (None: bf16). Both left out of :meth:`fields`
      when None, and refused for 16/32-bit inputs.
    * ``name``: unique within a report; derived from the fields when left empty.
    """

    dtype: str
    D: int
    Sq: int
    Sk: int
    B: int = 1
    Hq: int = 2
    Hkv: int = 1
    mask: str = "none"
    distribution: str = "gaussian"
    tile_n: int = 128
    noise: float = 0.0
    seed: int = 0
    Dv: int | None = None
    softmax_scale: float | None = None
    name: str = ""
    softcap: float | None = None
    sink: float | None = None
    page_size: int | None = None
    num_splits: int | None = None
    layout: str | None = None
    do_distribution: str | None = None
    descales: str | None = None
    output_dtype: str | None = None

    def __post_init__(self) -> None:
        # isinstance first: a list or dict value would make the membership tests raise TypeError.
        if not isinstance(self.dtype, str) or self.dtype not in INPUT_DTYPES:
            raise ValueError(f"config.dtype={self.dtype!r} must be one of {sorted(INPUT_DTYPES)}")
        for key in ("D", "Sq", "Sk", "B", "Hq", "Hkv", "tile_n"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.{key}={value!r} must be an int >= 1")
        if self.Dv is not None and (
            not isinstance(self.Dv, int) or isinstance(self.Dv, bool) or self.Dv < 1
        ):
            raise ValueError(f"config.Dv={self.Dv!r} must be None (= D) or an int >= 1")
        scale = self.softmax_scale
        if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not (math.isfinite(scale) and 0 < scale <= MAX_SOFTMAX_SCALE)
        ):
            raise ValueError(
                f"config.softmax_scale={scale!r} must be None (= 1/sqrt(D)) or a number > 0 and "
                "<= 2^20"
            )
        if self.Hq % self.Hkv:
            raise ValueError(f"config.Hq={self.Hq} must be a multiple of config.Hkv={self.Hkv}")
        # the run's budget applies when configs are chosen (check_budget) and built; here only
        # the ceiling, so a preset above the default budget can still be listed and sharded
        check_element_budget("config: ", self.shapes(), MAX_ELEMENTS_CEILING)
        if not isinstance(self.mask, str) or self.mask not in MASK_KINDS:
            raise ValueError(f"config.mask={self.mask!r} must be one of {list(MASK_KINDS)}")
        if not isinstance(self.distribution, str) or self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"config.distribution={self.distribution!r} must be one of {distribution_names()}"
            )
        if DISTRIBUTIONS[self.distribution].needs_key_padding and not self.mask.startswith(
            "varlen"
        ):
            raise ValueError(f"config.distribution={self.distribution!r} needs a varlen mask")
        noise = self.noise
        if isinstance(noise, bool) or not isinstance(noise, (int, float)):
            raise ValueError(f"config.noise={noise!r} must be a finite number >= 0")
        if not (math.isfinite(noise) and noise >= 0):  # 1e400 in JSON/TOML parses as inf
            raise ValueError(f"config.noise={noise!r} must be a finite number >= 0")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"config.seed={self.seed!r} must be an int >= 0 (a NumPy seed)")
        for key in ("softcap", "sink"):
            value = getattr(self, key)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or (key == "softcap" and value <= 0)
            ):
                rule = "> 0" if key == "softcap" else "(a float32 logit)"
                raise ValueError(f"config.{key}={value!r} must be None or a finite number {rule}")
        if self.sink is not None and abs(self.sink) > float(np.finfo(np.float32).max):
            raise ValueError(f"config.sink={self.sink!r} must be within the float32 range")
        for key, low, high in (("page_size", 1, None), ("num_splits", 1, MAX_SPLITS)):
            value = getattr(self, key)
            if value is not None and (
                not isinstance(value, int)
                or isinstance(value, bool)
                or value < low
                or (high is not None and value > high)
            ):
                rule = f"an int in [{low}, {high}]" if high else f"an int >= {low}"
                raise ValueError(f"config.{key}={value!r} must be None or {rule}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(
                f"config.layout={self.layout!r} must be None or one of {list(LAYOUTS)}"
            )
        if self.do_distribution is not None and (
            not isinstance(self.do_distribution, str)
            or self.do_distribution not in GRADIENT_DISTRIBUTIONS
        ):
            raise ValueError(
                f"config.do_distribution={self.do_distribution!r} must be None (= gaussian) or "
                f"one of {list(GRADIENT_DISTRIBUTIONS)}"
            )
        self._check_fp8()
        if not isinstance(self.name, str):
            raise ValueError(f"config.name={self.name!r} must be a string (empty: derived)")
        if not self.name:
            short = _SHORT_DTYPES[self.dtype]
            name = f"{short}-d{self.D}-q{self.Sq}-k{self.Sk}-{self.mask}-{self.distribution}"
            name += "" if self.Dv is None else f"-dv{self.Dv}"
            name += "" if self.softmax_scale is None else f"-scale{self.softmax_scale:g}"
            name += "" if self.softcap is None else f"-cap{self.softcap:g}"
            name += "" if self.sink is None else f"-sink{self.sink:g}"
            name += "" if self.page_size is None else f"-page{self.page_size}"
            name += "" if self.num_splits is None else f"-splits{self.num_splits}"
            name += "" if self.layout is None else f"-{self.layout}"
            name += "" if self.do_distribution is None else f"-do_{self.do_distribution}"
            name += "" if self.descales is None else f"-descales_{self.descales}"
            name += "" if self.output_dtype is None else f"-out_{self.output_dtype}"
            object.__setattr__(self, "name", name if self.seed == 0 else f"{name}-s{self.seed}")

    def _check_fp8(self) -> None:
        """``descales`` and ``output_dtype``: only with FP8 inputs, each a known name."""
        for key, names in (("descales", DESCALE_KINDS), ("output_dtype", WIDE_DTYPES)):
            value = getattr(self, key)
            if value is None:
                continue
            if self.dtype not in FP8_DTYPES:
                raise ValueError(
                    f"config.{key}={value!r} is allowed only with FP8 dtypes {list(FP8_DTYPES)}"
                )
            if not isinstance(value, str) or value not in names:
                raise ValueError(f"config.{key}={value!r} must be None or one of {list(names)}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The layouts of q, k, v and o this recipe builds."""
        q, k = (self.B, self.Sq, self.Hq, self.D), (self.B, self.Sk, self.Hkv, self.D)
        v, o = (*k[:3], self.Dv or self.D), (*q[:3], self.Dv or self.D)
        return {"q": q, "k": k, "v": v, "o": o}

    def check_budget(self) -> None:
        """ValueError naming this config, its first array above the run's element budget
        (:func:`reference.case.element_budget`) and how to raise it."""
        check_element_budget(f"config {self.name}: ", self.shapes())

    def fields(self) -> dict:
        """The recipe as plain JSON values (what the report records and config files hold);
        :data:`_OPTIONAL` fields only when set."""
        fields = dataclasses.asdict(self)
        return {k: v for k, v in fields.items() if not (k in _OPTIONAL and v is None)}

    @property
    def digest(self) -> str:
        """Short hash of the recipe: a resumed run only reuses records with the same digest."""
        text = json.dumps(self.fields(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def build(self) -> AttentionCase:
        """The case this recipe describes (deterministic in the fields); refused under the
        run's element budget before any array is drawn."""
        self.check_budget()
        recipe = {
            key: value
            for key, value in self.fields().items()
            if key not in ("name", "do_distribution")  # the backward's dO, not an input
        }
        rng = np.random.default_rng([self.seed, _stable_int(json.dumps(recipe, sort_keys=True))])
        mask = _mask(self)
        context = BuildContext(
            rng=rng,
            shape=Shape(self.B, self.Sq, self.Sk, self.Hq, self.Hkv, self.D, self.Dv or self.D),
            dtype=self.dtype,
            mask=mask,
            softmax_scale=self.softmax_scale or default_softmax_scale(self.D),
            tile_n=self.tile_n,
            noise=self.noise,
        )
        with np.errstate(all="ignore"):  # huge or non-finite values in padding are intended
            if self.dtype in FP8_DTYPES:
                kinds = (self.descales or "none",) * 3
                built = fp8_arrays(self.distribution, context)
                inputs = quantized_inputs(built, self.dtype, kinds, self.Hkv)
            else:
                built = DISTRIBUTIONS[self.distribution].build(context)
                inputs = {n: cast_input(a, self.dtype) for n, a in zip("qkv", built, strict=True)}
        for name in "qkv":  # owned and read-only: the case takes them without a copy
            inputs[name].setflags(write=False)
        sink = None if self.sink is None else np.full(self.Hq, self.sink, np.float32)
        return AttentionCase(
            softmax_scale=context.softmax_scale,
            mask=mask,
            label=f"report:{self.name}",
            softcap=self.softcap,
            sink=sink,
            page_size=self.page_size,
            num_splits=self.num_splits or 1,
            layout=self.layout or "padded",
            output_dtype=self.output_dtype,
            **inputs,
        )


_SHORT_DTYPES = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}


@dataclass(frozen=True, eq=False)
class SampledConfig:
    """A config drawn by Hypothesis: it carries its case, since no recipe reproduces it
    outside Hypothesis. ``fields()`` records the shapes so plots can place it."""

    name: str
    case: AttentionCase = field(repr=False)
    distribution: str = "sampled"

    def fields(self) -> dict:
        case = self.case
        return {
            "name": self.name,
            "dtype": case.dtype,
            "D": case.D,
            "Sq": case.Sq,
            "Sk": case.Sk,
            "B": case.B,
            "Hq": case.Hq,
            "Hkv": case.Hkv,
            "Dv": case.Dv,
            "softmax_scale": case.softmax_scale,
            "page_size": case.page_size,
            "num_splits": case.num_splits,
            "layout": case.layout,
            "mask": "+".join(sorted(case.mask.kinds)) or "none",
            "distribution": _label_part(case.label, "dist") or self.distribution,
            "seed": None,
        }

    @property
    def digest(self) -> str:
        hasher = hashlib.sha256()
        for array in (self.case.q, self.case.k, self.case.v):
            hasher.update(np.ascontiguousarray(array).tobytes())
        hasher.update(self.case.describe().encode())
        return hasher.hexdigest()[:16]

    def build(self) -> AttentionCase:
        return self.case


def _label_part(label: str, part: str) -> str | None:
    """``value`` of ``part=value`` in a strategies label (``dist=ramp shape=... ``)."""
    for item in label.split():
        name, _, value = item.partition("=")
        if name == part:
            return value
    return None


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _mask(config: Config) -> Mask:
    kind = config.mask
    if kind == "none":
        return Mask()
    if kind == "causal":
        return Mask(causal=True)
    if kind == "causal-top-left":
        return Mask(causal=True, alignment=CausalAlignment.TOP_LEFT)
    if kind == "explicit":
        return Mask(explicit=explicit_pattern(config.Sq, config.Sk))
    if kind == "varlen-long":
        short = lambda n, b: n if b == 0 else min(n, n // 64 + b)  # noqa: E731
        return Mask(
            causal=True,
            q_lengths=tuple(short(config.Sq, b) for b in range(config.B)),
            k_lengths=tuple(short(config.Sk, b) for b in range(config.B)),
        )
    window = {"window_left": max(1, config.Sk // 4), "window_right": 0}
    if kind == "window":
        return Mask(causal=True, **window)
    # varlen: batch b keeps a shrinking prefix; with B > 1 the last batch has no keys at all
    # (every row empty: O = 0, LSE = -inf) and half its queries.
    last = max(1, config.B - 1)
    q_lengths = tuple(config.Sq - (b * config.Sq) // (2 * last) for b in range(config.B))
    k_lengths = tuple(config.Sk - (b * config.Sk) // last for b in range(config.B))
    on_top = {"varlen-causal": {}, "varlen-window": window}.get(kind)
    return Mask(
        causal=on_top is not None, q_lengths=q_lengths, k_lengths=k_lengths, **(on_top or {})
    )


def explicit_pattern(Sq: int, Sk: int) -> np.ndarray:
    """Bool ``[1, 1, Sq, Sk]`` (True = visible): key j hidden from row i where ``(7i + 3j) % 5
    == 0``, the same for every batch and head, and rows ``i % 4 == 3`` hidden entirely: an
    explicit mask that empties rows, which no causal, window or length mask does in a row
    inside its lengths."""
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    visible = ((7 * i + 3 * j) % 5 != 0) & (i % 4 != 3)
    return visible[None, None]


def distribution_names() -> list[str]:
    """Score distributions a config may name: those of ``properties.strategies``."""
    return list(DISTRIBUTIONS)


def grid(
    *,
    dtypes: Iterable[str],
    head_dims: Iterable[int],
    lengths: Iterable[tuple[int, int]],
    masks: Iterable[str],
    distributions: Iterable[str],
    heads: Iterable[tuple[int, int]] = ((2, 1),),
    value_dims: Iterable[int | None] = (None,),
    full: bool = False,
) -> list[Config]:
    """Configs over dtype x mask x distribution; head dims and (Sq, Sk) pairs either form a full
    product with them (``full``) or rotate through it, so every value appears without the
    product's size. ``heads`` (Hq, Hkv) pairs and ``value_dims`` (Dv; None = D) rotate too, so
    kernels without GQA or Dv != D still get configs when an MHA pair or None is listed.
    varlen masks get B = 3 (one batch empty), others B = 1."""
    heads, value_dims = list(heads), list(value_dims)
    head_dims, lengths = list(head_dims), list(lengths)
    combos = list(itertools.product(dtypes, masks, distributions))
    shapes = list(itertools.product(head_dims, lengths))
    # A rotation stride coprime with the shape count visits every shape.
    stride = next(s for s in itertools.count(7) if math.gcd(s, len(shapes)) == 1)
    configs = []
    for index, (dtype, mask, dist) in enumerate(combos):
        chosen = shapes if full else [shapes[(index * stride) % len(shapes)]]
        for D, (Sq, Sk) in chosen:
            B = 3 if mask.startswith("varlen") else 1
            Hq, Hkv = heads[index % len(heads)]
            Dv = value_dims[index // len(heads) % len(value_dims)]
            configs.append(Config(dtype, D, Sq, Sk, B, Hq, Hkv, mask, dist, Dv=Dv))
    return configs


_CPU_DISTS = ("gaussian", "ramp", "near_ties", "large_v", "last_block_spike", "subnormal_p")
# causal-top-left: torch SDPA's is_causal diagonal, so SDPA backends get causal cases with Sq != Sk.
_GPU_MASKS = ("none", "causal", "causal-top-left", "window", "varlen")


def _surface() -> list[Config]:
    """The forward surface on GPU-sized shapes: each config of a small grid (long decode with
    GQA, a varlen batch of 3 with an empty sequence, prefill) takes one option in turn:
    softcap, sink, page sizes off and on the 128 tile, split-KV, packed, paged and packed."""
    options = [
        {"softcap": 30.0},
        {"sink": 2.0},
        {"page_size": 16},
        {"page_size": 128},
        {"num_splits": 3},
        {"layout": "packed"},
        {"page_size": 64, "layout": "packed"},
        {"softcap": 5.0, "sink": -1.0, "layout": "packed"},
    ]
    base = grid(
        dtypes=["bfloat16", "float16"],
        head_dims=[64, 128],
        lengths=[(1, 4097), (100, 300), (255, 1025)],
        masks=["causal", "window", "varlen-causal"],
        distributions=["gaussian", "ramp", "near_ties"],
        heads=[(4, 1), (8, 2)],
    )
    return [
        dataclasses.replace(config, name="", **options[index % len(options)])
        for index, config in enumerate(base)
    ]


def _long_context() -> list[Config]:
    """``gpu-long``: what long-context kernels ship for (docs/long-context.md), bf16, D = 128,
    GQA 8/2: causal prefill at 32k, 64k and 128k, decode of one query against 128k keys (B = 1
    and a batch of 8), ramps that force a rescale in every K block (hundreds per row) in both,
    and a varlen batch of one long sequence with short ones."""
    long = {"dtype": "bfloat16", "D": 128, "Hq": 8, "Hkv": 2}
    return [
        Config(**long, Sq=32768, Sk=32768, mask="causal", name="long-prefill-32k"),
        Config(**long, Sq=65536, Sk=65536, mask="causal", name="long-prefill-64k"),
        Config(**long, Sq=131072, Sk=131072, mask="causal", name="long-prefill-128k"),
        Config(**long, Sq=1, Sk=131072, name="long-decode-128k"),
        Config(**long, Sq=1, Sk=131072, B=8, name="long-decode-128k-b8"),
        Config(
            **long,
            Sq=32768,
            Sk=32768,
            mask="causal",
            distribution="ramp",
            name="long-prefill-32k-ramp",
        ),  # fmt: skip
        Config(**long, Sq=1, Sk=131072, distribution="ramp", name="long-decode-128k-ramp"),
        Config(**long, Sq=32768, Sk=32768, B=4, mask="varlen-long", name="long-varlen-32k"),
    ]


# Keys of the gpu-huge decode: K and V hold (2^21 + 128) * 8 * 128 = 2^31 + 2^17 elements each, so
# the last K block starts past element 2^31 (an int32 element offset wraps there) and its byte
# offsets past 2^32. 4 GiB per bf16 tensor.
HUGE_KEYS = (1 << 21) + 128


def _huge() -> list[Config]:
    """``gpu-huge``: one tensor above 2^31 elements (docs/long-context.md). A decode (Sq = 1)
    against 2^21 + 128 keys, Hq = Hkv = 8, D = 128, bf16: K and V of 4 GiB each. The
    ``last_block_spike`` distribution puts each row's largest logit on its last key, past
    element 2^31 of K, so a kernel that wraps its offsets there reads the wrong keys and its
    output is far off. Above the default element budget: run it with
    ``ATTENTION_CROSSVAL_MAX_ELEMENTS=2**32`` on a host with about 64 GiB of free memory."""
    return [
        Config(
            "bfloat16",
            128,
            1,
            HUGE_KEYS,
            Hq=8,
            Hkv=8,
            distribution="last_block_spike",
            name="huge-decode-2g",
        )
    ]


def _rotated() -> list[Config]:
    """The default grid's rotated part: 84 configs over dtype x mask x distribution, shapes
    rotating, with GQA with 1 < Hkv < Hq, Dv != D, key lengths below 64, scores beyond the
    fp16 range (huge) and varlen under causal and window masks with q and k lengths that
    differ."""
    return grid(
        dtypes=["bfloat16", "float16"],
        head_dims=[64, 128],
        lengths=[(128, 128), (100, 300), (1, 257), (200, 129), (64, 512), (50, 37), (16, 48)],
        masks=["none", "causal", "window", "varlen", "varlen-causal", "varlen-window"],
        distributions=(*_CPU_DISTS, "huge"),
        heads=[(2, 1), (4, 2)],
        value_dims=[None, 32],
    )


def _crossed() -> list[Config]:
    """The default grid's crossed part: distributions with the shapes their bugs need, which
    the rotation of :func:`grid` ties to one shape each. Decode with several distributions
    (its largest logit below -30 with ``below_sentinel`` and ``huge``), half-tile lengths (1.5
    tiles of 128 and of 64) with the families whose LSE is very negative (``huge``,
    ``below_sentinel``), uniform logits (``constant``, ``tiny_variance``), an explicit mask
    that empties rows, and GQA decodes of 4096 keys and more."""
    dtypes = itertools.cycle(["bfloat16", "float16"])
    decode = [
        Config(next(dtypes), 64, 1, 257, Hq=4, Hkv=2, distribution=dist)
        for dist in (
            "gaussian", "below_sentinel", "huge", "last_block_spike", "near_ties", "constant",
            "descending",
        )
    ]  # fmt: skip
    half_tile = [
        Config(next(dtypes), 64, Sq, Sk, Hq=4, Hkv=2, mask=mask, distribution=dist)
        for (Sq, Sk), mask in (((64, 192), "causal"), ((32, 96), "none"))
        for dist in ("huge", "below_sentinel")
    ]
    uniform = [
        Config(next(dtypes), D, Sq, Sk, B=B, mask=mask, distribution=dist)
        for dist in ("constant", "tiny_variance")
        for D, Sq, Sk, B, mask in ((64, 100, 300, 3, "varlen-causal"), (128, 128, 128, 1, "window"))
    ]
    explicit = [
        Config("float16", 64, 50, 130, Hq=4, Hkv=2, mask="explicit"),
        Config("bfloat16", 128, 64, 192, mask="explicit", distribution="near_ties"),
    ]
    long_decode = [
        Config("bfloat16", 64, 1, 4096, Hq=8, Hkv=2),
        Config("float16", 64, 2, 4097, Hq=4, Hkv=1, distribution="ramp"),
        Config("bfloat16", 64, 1, 4096, Hq=8, Hkv=2, distribution="below_sentinel"),
    ]
    return [*decode, *half_tile, *uniform, *explicit, *long_decode]


def _fp8() -> list[Config]:
    """FP8 inputs (docs/fp8.md): both formats, the creeping ramp over 16 K blocks of 128 (FA4's
    saturation trigger) and other families, honest and adversarial descales, a GQA decode,
    causal and varlen masks, an fp16 output. Kernels without FP8 (or without descales) record
    them as unsupported."""
    configs = []
    for dtype in FP8_DTYPES:
        configs += [
            Config(dtype, 64, 128, 2048, Hq=4, Hkv=2, distribution="ramp", descales="amax"),
            Config(dtype, 128, 256, 1024, mask="causal", distribution="ramp"),
            Config(dtype, 64, 1, 4096, Hq=8, Hkv=2, distribution="ramp", descales="amax_pow2"),
            Config(dtype, 64, 200, 300, mask="varlen-causal", B=3, descales="squeezed"),
            Config(dtype, 64, 64, 512, distribution="large_v", descales="clipping"),
            Config(dtype, 128, 128, 384, distribution="last_block_spike", output_dtype="float16"),
        ]
    return configs


def _backward_rows() -> list[Config]:
    """Rows for ``--pass backward|both`` that the rest of the default grid lacks: softmax
    scales 0.5 and 1.0 (a scale applied wrongly in dk), every non-gaussian dO, fp32 inputs, and
    keys to 4096 (dq summed over many key blocks). They run in the forward pass too."""
    return [
        Config("bfloat16", 64, 100, 300, mask="causal", softmax_scale=0.5),
        Config("float16", 64, 128, 128, Hq=4, Hkv=2, distribution="ramp", softmax_scale=1.0,
               do_distribution="large"),
        Config("bfloat16", 64, 65, 200, mask="causal", do_distribution="one_hot"),
        Config("float16", 64, 64, 129, mask="window", softmax_scale=1.0, do_distribution="large"),
        Config("bfloat16", 64, 100, 300, B=3, mask="varlen-causal", do_distribution="orthogonal"),
        Config("float16", 64, 1, 257, Hq=4, Hkv=2, do_distribution="aligned"),
        Config("float16", 64, 64, 200, mask="causal", do_distribution="tiny"),
        Config("bfloat16", 64, 33, 129, Hq=4, Hkv=2, distribution="ramp", do_distribution="ones"),
        Config("float32", 64, 128, 128, mask="causal"),
        Config("float32", 32, 100, 300, B=3, mask="varlen-causal", do_distribution="one_hot"),
        Config("float32", 64, 64, 200, distribution="near_ties", softmax_scale=0.5,
               do_distribution="large"),
        Config("bfloat16", 64, 64, 2048, Hq=4, Hkv=2, mask="causal"),
        Config("float16", 64, 16, 4096, do_distribution="one_hot"),
    ]  # fmt: skip


PRESETS: dict[str, Callable[[], list[Config]]] = {
    # Smoke test: two tiny configs (tests and a first look).
    "tiny": lambda: grid(
        dtypes=["bfloat16"],
        head_dims=[64],
        lengths=[(33, 70)],
        masks=["none", "causal"],
        distributions=["gaussian"],
    ),
    # CPU default, with the NumPy streaming tier as the kernel: the rotated grid, the crossed
    # configs and the backward rows. It reaches the input classes of report.grid_classes
    # (tests/report/test_report_grid.py).
    "default": lambda: _rotated() + _crossed() + _backward_rows(),
    "gpu-small": lambda: grid(
        dtypes=["bfloat16", "float16"],
        head_dims=[64, 128],
        lengths=[(128, 128), (1, 1000), (255, 1025), (512, 2048)],
        masks=_GPU_MASKS,
        distributions=_CPU_DISTS,
        heads=[(4, 2), (4, 4)],
    ),
    "gpu-large": lambda: grid(
        dtypes=["bfloat16", "float16"],
        head_dims=[64, 128],
        lengths=[(1, 8192), (1024, 4097), (2048, 8192), (4096, 4096)],
        masks=_GPU_MASKS,
        distributions=_CPU_DISTS,
        heads=[(8, 2), (8, 8)],
    ),
    # softcap, sinks, paged KV, split-KV and packed varlen (kernels that lack one: unsupported)
    "surface": _surface,
    # FP8 inputs with descales (kernels that lack them: unsupported)
    "fp8": _fp8,
    "gpu-long": _long_context,
    "gpu-huge": _huge,
}


def preset(name: str) -> list[Config]:
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} must be one of {sorted(PRESETS)}")
    return PRESETS[name]()


def load_config_file(path: str | Path) -> list[Config]:
    """Configs from JSON (a list of objects, or ``{"config": [...]}``) or TOML (``[[config]]``
    tables). Keys are :class:`Config` fields; missing ones take their defaults."""
    path = Path(path)
    kind = "TOML" if path.suffix == ".toml" else "JSON"
    try:
        text = path.read_text()
        data = tomllib.loads(text) if kind == "TOML" else json.loads(text)
    except (ValueError, RecursionError) as error:  # JSON/TOML errors (line, column), Unicode,
        raise ValueError(f"config file {path} is not valid {kind}: {error}") from None  # nesting
    entries = data.get("config") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"config file {path} must hold a non-empty list of configs")
    fields = dataclasses.fields(Config)
    known = {f.name for f in fields}
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    configs = []
    for index, entry in enumerate(entries):
        where = f"config file {path} config #{index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object/table of Config fields, got {entry!r:.60}")
        if set(entry) - known:
            raise ValueError(
                f"{where}: unknown keys {sorted(set(entry) - known)}; known: {sorted(known)}"
            )
        if required - set(entry):
            raise ValueError(f"{where}: missing required keys {sorted(required - set(entry))}")
        try:
            configs.append(Config(**entry))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    try:
        return unique(configs)
    except ValueError as error:
        raise ValueError(f"config file {path}: {error}") from None


def sampled_configs(count: int, seed: int = 0, spec=None) -> list[SampledConfig]:
    """``count`` cases drawn by ``properties.strategies.attention_cases(spec=spec)``, repeatable
    for a given ``seed`` (Hypothesis derandomized on that seed, no example database)."""
    if count < 1:
        raise ValueError(f"sample count={count!r} must be >= 1")
    from attention_crossval.properties.strategies import attention_cases, drawn_examples

    drawn = drawn_examples(attention_cases(spec=spec), count, seed=seed)
    return [SampledConfig(f"sampled-{seed}-{i:03d}", case) for i, case in enumerate(drawn)]


def unique(configs: list) -> list:
    """``configs`` unchanged, or ValueError naming a duplicated config name."""
    seen: set[str] = set()
    for config in configs:
        if config.name in seen:
            raise ValueError(f"config name {config.name!r} appears twice; names must be unique")
        seen.add(config.name)
    return configs
