"""Bad input raises ValueError naming the field and the rule (docs/design.md#bad-input).

One table of ``(constructor, bad keyword arguments, message fragment)`` rows, one parametrized
test; then Hypothesis throws malformed shapes, dtypes, lengths, windows, explicit masks, NaN
placements and config fields at the constructors and checks that nothing but ValueError escapes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.bounds import error_bound
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.compare import compare
from attention_crossval.reference.exact import exact_attention
from attention_crossval.reference.exact_backward import exact_backward
from attention_crossval.reference.gradients import BackwardCase
from attention_crossval.reference.masks import visible_all
from attention_crossval.reference.precision import BackwardPrecision, StreamingPrecision, round_to
from attention_crossval.reference.streaming import streaming_attention
from attention_crossval.report.configs import Config

pytestmark = pytest.mark.cpu

B, SQ, SK, HQ, HKV, D = 2, 3, 5, 4, 2, 8


def arrays(dtype=np.float16, *, b=B, sq=SQ, sk=SK, hq=HQ, hkv=HKV, d=D, dv=D) -> dict:
    rng = np.random.default_rng(0)
    return {
        "q": rng.normal(size=(b, sq, hq, d)).astype(dtype),
        "k": rng.normal(size=(b, sk, hkv, d)).astype(dtype),
        "v": rng.normal(size=(b, sk, hkv, dv)).astype(dtype),
    }


def with_nan(name: str, index: tuple[int, ...], value: float = np.nan, **mask: Any) -> dict:
    out = arrays()
    out[name][index] = value
    return out | ({"mask": Mask(**mask)} if mask else {})


CASE = arrays()
RESULT = AttentionResult(o=np.zeros((B, SQ, HQ, D)), lse=np.zeros((B, HQ, SQ)))
GOOD_CASE = AttentionCase(**CASE)
FA16 = StreamingPrecision.flash_attention("float16")
ONE_ROW = np.zeros((B, HQ, SQ), bool)
ONE_ROW[0, 0, 0] = True
ONE_KEY = np.zeros((B, HKV, SK), bool)
ONE_KEY[0, 0, 0] = True


def bound_call(**kwargs: Any) -> Callable[[], object]:
    args = {"case": GOOD_CASE, "reference": RESULT, "precision": FA16, "block_n": 4}
    return lambda: error_bound(**(args | kwargs))


def compare_call(**kwargs: Any) -> Callable[[], object]:
    args = {"actual": RESULT, "reference": RESULT, "bound": None, "output_dtype": "float16"}
    return lambda: compare(**(args | kwargs))


class Row(NamedTuple):
    constructor: Callable[..., object]
    kwargs: dict[str, Any]
    message: str


def e(constructor: Callable[..., object], message: str, **kwargs: Any) -> Row:
    return Row(constructor, kwargs, message)


TABLE = [
    # AttentionCase: ranks, dtypes, shapes, heads, scale, finiteness, mask against the shapes
    e(AttentionCase, "q must have rank 4", **CASE | {"q": CASE["q"][0]}),
    e(AttentionCase, "v must have rank 4", **CASE | {"v": CASE["v"][..., None]}),
    e(AttentionCase, "k must be a numpy array", **CASE | {"k": CASE["k"].tolist()}),
    e(AttentionCase, "q.dtype=float64", **arrays(np.float64)),
    e(AttentionCase, "k.dtype=int32", **CASE | {"k": CASE["k"].astype(np.int32)}),
    e(AttentionCase, "share one dtype", **CASE | {"v": CASE["v"].astype(ml_dtypes.bfloat16)}),
    e(AttentionCase, "batch sizes must match", **CASE | {"k": arrays(b=1)["k"]}),
    e(AttentionCase, "same Sk", **CASE | {"v": arrays(sk=SK + 1)["v"]}),
    e(AttentionCase, "same Hkv", **CASE | {"v": arrays(hkv=1)["v"]}),
    e(AttentionCase, "head dim D", **CASE | {"k": arrays(d=D + 1)["k"]}),
    e(AttentionCase, "Hq=3 must be a multiple of Hkv=2", **arrays(hq=3)),
    e(AttentionCase, "must be >= 1", **arrays(b=0)),
    e(AttentionCase, "must be >= 1", **arrays(dv=0)),
    e(AttentionCase, "softmax_scale", **CASE, softmax_scale=0.0),
    e(AttentionCase, "softmax_scale", **CASE, softmax_scale=math.nan),
    e(AttentionCase, "softmax_scale", **CASE, softmax_scale=-math.inf),
    e(AttentionCase, "softmax_scale", **CASE, softmax_scale=1e18),
    e(AttentionCase, "softmax_scale", **CASE, softmax_scale="0.1"),
    e(AttentionCase, "softmax_scale", **CASE, softmax_scale=True),
    e(AttentionCase, "mask must be", **CASE, mask={"causal": True}),
    e(AttentionCase, "q must be finite", **with_nan("q", (1, 2, 3, 4))),
    e(AttentionCase, "k must be finite", **with_nan("k", (0, 0, 0, 0), np.inf)),
    e(AttentionCase, "v must be finite", **with_nan("v", (1, 1, 1, 1), -np.inf, k_lengths=(5, 2))),
    e(AttentionCase, "q must be finite", **with_nan("q", (0, 1, 0, 0), q_lengths=(2, 3))),
    e(AttentionCase, "mask.q_lengths must have B=2", **CASE, mask=Mask(q_lengths=(1,))),
    e(AttentionCase, "mask.k_lengths", **CASE, mask=Mask(k_lengths=(5, SK + 1))),
    e(
        AttentionCase,
        "mask.explicit shape",
        **CASE,
        mask=Mask(explicit=np.ones((1, 1, 2, 2), bool)),
    ),
    e(
        AttentionCase,
        "mask.explicit shape",
        **CASE,
        mask=Mask(explicit=np.ones((3, 1, 1, 1), bool)),
    ),
    # AttentionCase call options: page size, splits, layout
    e(
        AttentionCase,
        "page_size=0 must be None (contiguous K/V) or an int >= 1",
        **CASE,
        page_size=0,
    ),
    e(AttentionCase, "page_size=2.0 must be None", **CASE, page_size=2.0),
    e(AttentionCase, "num_splits=0 must be an int in [1, 256]", **CASE, num_splits=0),
    e(AttentionCase, "num_splits=257 must be an int in [1, 256]", **CASE, num_splits=257),
    e(
        AttentionCase,
        "page_fill='nan' must be a float (NaN: a read shows)",
        **CASE,
        page_fill="nan",
    ),
    e(AttentionCase, "page_fill=True must be a float", **CASE, page_fill=True),
    e(AttentionCase, "num_splits=True must be an int", **CASE, num_splits=True),
    e(
        AttentionCase,
        "layout='ragged' must be one of ['padded', 'packed']",
        **CASE,
        layout="ragged",
    ),
    # Mask: windows, lengths, alignment, explicit
    e(Mask, "mask.window_left", window_left=-1),
    e(Mask, "mask.window_right", window_right=1.5),
    e(Mask, "mask.window_right", window_right=True),
    e(Mask, "mask.alignment", alignment="bottom_right"),
    e(Mask, "mask.q_lengths", q_lengths=(-1, 2)),
    e(Mask, "mask.k_lengths", k_lengths=(1.0,)),
    e(Mask, "mask.k_lengths", k_lengths=3),
    e(Mask, "mask.causal", causal="yes"),
    e(Mask, "mask.explicit must be a bool array", explicit=np.ones((1, 1, 2, 2))),
    e(Mask, "mask.explicit must be a bool array", explicit=np.ones((2, 2), bool)),
    e(Mask, "mask.q_lengths=array(3) must be a sequence", q_lengths=np.array(3)),  # TypeError
    e(Mask, "mask.window_left=9223372036854775808 must be None", window_left=2**63),
    e(Mask, "mask.window_right=2147483648 must be None", window_right=2**31),
    # AttentionCase and Config: the element budget, before any copy (MemoryError before)
    e(
        AttentionCase,
        "v [1, 65536, 1, 8192] has 536870912 elements: above the element budget",
        **{
            name: np.broadcast_to(np.float16(0), shape)  # no memory behind these views
            for name, shape in (
                ("q", (1, 1, 1, 8)),
                ("k", (1, 65536, 1, 8)),
                ("v", (1, 65536, 1, 8192)),
            )
        },
    ),
    # a Config is checked against the ceiling at construction, the run's budget when chosen
    e(Config, "config: q [1, 10000000000, 2, 64] has", dtype="float16", D=64, Sq=10**10, Sk=8),
    # StreamingPrecision: each stage's dtype and the threshold
    e(StreamingPrecision, "score_dtype", score_dtype="float16"),
    e(StreamingPrecision, "accum_dtype", accum_dtype="bfloat16"),
    e(StreamingPrecision, "p_dtype", p_dtype="float32"),
    e(StreamingPrecision, "output_dtype", output_dtype="int8"),
    e(StreamingPrecision, "output_dtype", output_dtype=16),
    e(StreamingPrecision, "rescale_threshold_log2", rescale_threshold_log2=-1.0),
    e(StreamingPrecision, "rescale_threshold_log2", rescale_threshold_log2=math.nan),
    e(StreamingPrecision, "rescale_threshold_log2", rescale_threshold_log2="8"),
    # a threshold at or past the exponent range: every tier raised OverflowError
    e(
        StreamingPrecision,
        "rescale_threshold_log2=100000000000000000...0000000000000000000 must be a finite float",
        rescale_threshold_log2=10**400,
    ),
    e(
        StreamingPrecision,
        "rescale_threshold_log2=inf must be a finite float in [0, 128)",
        rescale_threshold_log2=math.inf,
    ),
    e(
        StreamingPrecision,
        "rescale_threshold_log2=128.0 must be a finite float in [0, 128)",
        rescale_threshold_log2=128.0,
    ),
    e(
        StreamingPrecision,
        "rescale_threshold_log2=1024 must be a finite float in [0, 1024)",
        score_dtype="float64",
        accum_dtype="float64",
        rescale_threshold_log2=1024,
    ),
    e(StreamingPrecision, "row_sum_from_rounded_p", row_sum_from_rounded_p="no"),
    # KernelSpec: the declaration
    e(KernelSpec, "spec.dtypes", name="k", dtypes=frozenset({"float64"})),
    e(KernelSpec, "spec.dtypes", name="k", dtypes=frozenset()),
    e(KernelSpec, "spec.mask_kinds", name="k", mask_kinds=frozenset({"sliding"})),
    e(KernelSpec, "spec.head_dims", name="k", head_dims=frozenset()),
    e(KernelSpec, "spec.head_dims", name="k", head_dims=frozenset({0, 64})),
    e(KernelSpec, "spec.head_dims", name="k", head_dims=frozenset({"64"})),
    e(KernelSpec, "spec.tile_m", name="k", tile_m=0),
    e(KernelSpec, "spec.device", name="k", device="tpu"),
    e(KernelSpec, "spec.empty_rows", name="k", empty_rows="inf"),
    e(KernelSpec, "spec.dtypes=[16] must hold str names", name="k", dtypes=[16]),  # TypeError
    e(KernelSpec, "spec.mask_kinds=[['causal']] must hold str", name="k", mask_kinds=[["causal"]]),
    e(KernelSpec, "spec.head_dims=[[64]] must hold ints", name="k", head_dims=[[64]]),
    e(KernelSpec, "spec.device=['cpu'] must be a str", name="k", device=["cpu"]),
    # exact tier: the working precision's range (OverflowError in _finish_row at 1023 and up)
    e(
        exact_attention,
        "prec_bits=1023 must be an int in [64, 960]",
        case=GOOD_CASE,
        prec_bits=1023,
    ),
    # Tiers and comparison: their own arguments
    e(streaming_attention, "block_n", case=GOOD_CASE, block_n=0),
    e(streaming_attention, "precision", case=GOOD_CASE, precision="float16"),
    e(round_to, "dtype='int8'", x=np.ones(2), dtype="int8"),
    e(bound_call(block_n=0), "block_n"),
    e(bound_call(kv_order="sideways"), "kv_order"),
    e(bound_call(mma_unit_roundoff=0.5), "mma_unit_roundoff"),
    e(bound_call(exp2_error_ulp=-1.0), "exp2_error_ulp"),
    e(bound_call(reference=AttentionResult(o=np.zeros((1, 1, 1, 1)))), "reference.o shape"),
    e(compare_call(output_dtype="int8"), "output_dtype"),
    e(compare_call(bound=np.zeros((1, 1, 1, 1))), "bound shape"),
    e(compare_call(actual=AttentionResult(o=np.zeros(3))), "actual.o shape"),
    e(compare_call(rows=np.ones((B, HQ, SQ))), "rows must be a bool array"),
    e(compare_call(lse_bound=np.zeros(2)), "lse_bound shape"),
]


@pytest.mark.parametrize(
    "row", TABLE, ids=[f"{getattr(r.constructor, '__name__', 'call')}-{r.message}" for r in TABLE]
)
def test_bad_argument_raises_value_error_naming_it(row: Row) -> None:
    with pytest.raises(ValueError, match=re.escape(row.message)):
        row.constructor(**row.kwargs)


def test_list_valued_spec_fields_are_read_as_sets() -> None:
    """Regression: ``mask_kinds=['causal']`` was accepted, then every case raised TypeError in
    ``supports`` (every report record an error); any of frozenset/set/tuple/list now works."""
    spec = KernelSpec(name="k", dtypes=["float16"], head_dims=[8], mask_kinds=["causal"])
    assert spec.mask_kinds == frozenset({"causal"}) and spec.head_dims == frozenset({8})
    assert spec.supports(AttentionCase(**CASE, mask=Mask(causal=True)))
    assert spec.unsupported(AttentionCase(**CASE, mask=Mask(window_left=1))) == (
        "mask kinds ['window'] not supported"
    )


# --- Hypothesis: malformed inputs let only ValueError escape ------------------------------

JUNK = st.sampled_from(
    [None, "x", 1.5, -1, True, object(), (), [1], 10**400, math.nan, 2**63, np.array(3), [[1]]]
)
DTYPES = st.sampled_from(
    [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.bool_, np.complex64]
    + [">f2", ">f4", ">f8", ">i4"]  # non-native byte order: read as native, it escaped
)
VALID_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, ">f2", ">f4"]
SIZES = st.integers(0, 3)


FAULTS = ("none", "none", "none", "shape", "rank", "dtype", "mix", "nan", "list", "scale", "mask")


@st.composite
def malformed_case_kwargs(draw) -> dict:
    """A consistent shape (sizes 0..3) with at most one fault: one array's rank or one dim
    changed, an unsupported or mixed dtype, NaN/Inf at a random place (padding or not), nested
    lists instead of arrays, a bad softmax_scale, or mask fields (lengths, windows, explicit,
    causal) of any type and size. Valid masks are still drawn with lengths and windows."""
    fault = draw(st.sampled_from(FAULTS))
    event(f"fault: {fault}")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b, sq, sk, hkv, group, d, dv = (draw(SIZES) for _ in range(7))
    shapes = {"q": [b, sq, hkv * group, d], "k": [b, sk, hkv, d], "v": [b, sk, hkv, dv]}
    name = draw(st.sampled_from("qkv"))
    if fault == "shape":
        shapes[name][draw(st.integers(0, 3))] = draw(SIZES)
    elif fault == "rank":
        shapes[name] = shapes[name][: draw(st.integers(0, 3))] + [1] * draw(st.integers(0, 2))
    dtype = draw(DTYPES) if fault == "dtype" else draw(st.sampled_from(VALID_DTYPES))
    out: dict[str, Any] = {n: rng.normal(size=shape).astype(dtype) for n, shape in shapes.items()}
    if fault == "mix":
        out[name] = out[name].astype(draw(DTYPES))
    if fault == "nan" and out[name].size and out[name].dtype.kind == "f":
        out[name].flat[rng.integers(out[name].size)] = draw(st.sampled_from([np.nan, np.inf]))
    if fault == "list":
        out[name] = out[name].tolist()
    scales = (
        JUNK | st.floats(allow_nan=True) if fault == "scale" else st.none() | st.floats(0.01, 4)
    )
    out["softmax_scale"] = draw(scales)
    lengths = st.none() | st.tuples(*[st.integers(0, 3)] * b)
    windows = st.none() | st.integers(0, 4)
    explicit = st.none() | st.just(rng.random((b, 1, sq, sk)) < 0.5)
    if fault == "mask":
        lengths = lengths | st.lists(st.integers(-1, 4), max_size=3).map(tuple) | JUNK
        windows = windows | st.integers(-2, -1) | JUNK
        explicit = explicit | st.tuples(st.lists(SIZES, max_size=5), DTYPES).map(
            lambda spec: np.ones(spec[0], spec[1])
        )
    out["mask_kwargs"] = {
        "causal": draw(st.booleans() | JUNK if fault == "mask" else st.booleans()),
        "window_left": draw(windows),
        "window_right": draw(windows),
        "q_lengths": draw(lengths),
        "k_lengths": draw(lengths),
        "explicit": draw(explicit),
    }
    return out


def _big_endian_with_inf() -> dict:
    """The byte-order escape: inf on a valid row of a big-endian q (accepted, read as native)."""
    out = {name: array.astype(">f2") for name, array in CASE.items()}
    out["q"][1, 2, 3, 4] = np.inf
    return out | {"mask_kwargs": {}}


@given(malformed_case_kwargs())
@example(_big_endian_with_inf())
@example({name: array.astype(">f2") for name, array in CASE.items()} | {"mask_kwargs": {}})
def test_only_value_error_escapes_case_and_mask(kwargs: dict) -> None:
    mask_kwargs = kwargs.pop("mask_kwargs")
    try:
        case = AttentionCase(**kwargs, mask=Mask(**mask_kwargs))
    except ValueError:
        return
    event("valid case")
    seen = visible_all(case)  # a valid case has a well-defined visibility
    assert seen.shape == (case.B, case.Hq, case.Sq, case.Sk)
    valid = (
        np.arange(case.Sq)[None, :] < np.array([case.q_length(b) for b in range(case.B)])[:, None]
    )  # read by value: a big-endian inf on a valid row was accepted
    assert np.isfinite(case.q.astype(np.float64)[valid]).all() and case.q.dtype.isnative


@given(
    st.fixed_dictionaries(
        {
            "score_dtype": st.sampled_from(["float32", "float64", "float16"]) | JUNK,
            "p_dtype": st.sampled_from([None, "float16", "bfloat16", "float32"]) | JUNK,
            "row_sum_from_rounded_p": st.booleans() | JUNK,
            "accum_dtype": st.sampled_from(["float32", "float64"]) | JUNK,
            "output_dtype": st.sampled_from([None, "float16", "bfloat16", "float32", "int8"])
            | JUNK,
            "rescale_threshold_log2": st.floats(allow_nan=True)
            | st.integers(-2, 9)
            | st.sampled_from([127.9, 128, 1023.5, 1024, 2**1100])
            | JUNK,
        }
    )
)
@example({"rescale_threshold_log2": 10**400})
@example({"rescale_threshold_log2": math.inf})
def test_only_value_error_escapes_streaming_precision(kwargs: dict) -> None:
    """An accepted chain runs: the streaming tier and the bound take it without an exception
    (a threshold of 10**400 was accepted, then both raised OverflowError)."""
    try:
        precision = StreamingPrecision(**kwargs)
    except ValueError:
        return
    event("valid precision")
    with np.errstate(all="ignore"):
        got = streaming_attention(GOOD_CASE, precision, block_m=2, block_n=2)
        bound = error_bound(GOOD_CASE, got, precision, block_n=2)
    assert bound.shape == got.o.shape


@given(
    st.fixed_dictionaries(
        {
            "name": st.text(max_size=3),
            "dtypes": st.frozensets(st.sampled_from(["float16", "bfloat16", "float32", "x"]))
            | st.lists(st.sampled_from(["float16", "x", 16, ("float16",)]) | JUNK, max_size=3),
            "head_dims": st.frozensets(st.integers(-1, 256) | st.sampled_from(["64", 1.5]))
            | st.lists(st.integers(-1, 256) | JUNK, max_size=3),
            "mask_kinds": st.frozensets(st.sampled_from(["causal", "window", "varlen", "z"]))
            | st.lists(st.sampled_from(["causal", "varlen"]) | JUNK, max_size=3).map(tuple),
            "tile_m": st.integers(-1, 256) | JUNK,
            "tile_n": st.integers(-1, 256) | JUNK,
            "device": st.sampled_from(["cpu", "cuda", "tpu"]) | JUNK,
            "empty_rows": st.sampled_from(["zero", "nan", "inf"]) | JUNK,
        }
    )
)
def test_only_value_error_escapes_kernel_spec(kwargs: dict) -> None:
    try:
        spec = KernelSpec(**kwargs)
    except ValueError:
        return
    again = KernelSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(KernelSpec)})
    assert again == spec  # what validation accepted is already in its normal form
    assert isinstance(spec.supports(GOOD_CASE), bool)


DLSE_VALUES = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [1e-300, 1e300, 2.0**-1074, -1.7e308, 0.0]
)


@given(
    do_dtype=st.sampled_from([np.float16, ">f2", np.float32, ml_dtypes.bfloat16]),
    dlse=st.none() | st.lists(DLSE_VALUES, min_size=SQ, max_size=SQ),
    nan_row=st.none() | st.integers(0, SQ - 1),
)
@example(do_dtype=">f2", dlse=[1e-300, 1e300, 0.5], nan_row=None)
def test_only_value_error_escapes_backward_case(do_dtype, dlse, nan_row) -> None:
    """dO of any byte order and dtype, dlse anywhere in the float64 range (spanning more than
    2^970 gave 'cannot convert float NaN to integer' in the exact backward): an accepted case
    runs through the exact backward."""
    do = np.random.default_rng(1).normal(size=(B, SQ, HQ, D)).astype(do_dtype)
    if nan_row is not None:
        do[0, nan_row, 0, 0] = np.nan
    dlse_array = None if dlse is None else np.broadcast_to(np.array(dlse), (B, HQ, SQ)).copy()
    try:
        case = BackwardCase(GOOD_CASE, do, dlse_array)
    except ValueError:
        return
    event("valid backward case")
    gradients = exact_backward(case, rows=ONE_ROW, keys=ONE_KEY)
    assert gradients.dq.shape == GOOD_CASE.q.shape


@given(
    st.fixed_dictionaries(
        {
            "forward": st.just(FA16) | JUNK,
            "p_dtype": st.sampled_from([None, "float16", "float32"]) | JUNK,
            "ds_dtype": st.sampled_from([None, "bfloat16", "float64"]) | JUNK,
            "ds_from_rounded_p": st.booleans() | JUNK,
            "ds_flushes_subnormals": st.booleans() | JUNK,
            "accum_dtype": st.sampled_from(["float32", "float64"]) | JUNK,
            "dq_order": st.sampled_from(["fixed", "permuted", "random"]) | JUNK,
            "output_dtype": st.sampled_from([None, "float16", "int8"]) | JUNK,
        }
    )
)
def test_only_value_error_escapes_backward_precision(kwargs: dict) -> None:
    try:
        precision = BackwardPrecision(**kwargs)
    except ValueError:
        return
    assert precision.forward == FA16
