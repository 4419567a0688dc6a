"""KernelSpec rejects every malformed field with a ValueError naming the field and the rule.

Table-driven like tests/test_argument_validation.py: ``(bad keyword arguments, message
fragment)`` rows; each row would, before the validation, have been accepted and then misused
(an alignment string compared with an enum, a str of dtypes iterated per character, ...).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, CausalAlignment
from attention_crossval.reference.precision import StreamingPrecision

pytestmark = pytest.mark.cpu

FA16 = StreamingPrecision.flash_attention("float16")

ROWS: list[tuple[dict[str, Any], str]] = [
    ({"name": None}, "spec.name=None must be a non-empty str"),
    ({"name": ""}, "spec.name='' must be a non-empty str"),
    ({"causal_alignment": "top_left"}, "spec.causal_alignment='top_left' must be a CausalAlign"),
    ({"precision": {"float16": 3}}, "spec.precision['float16']=3: keys must be input dtypes"),
    ({"precision": {"float64": FA16}}, "spec.precision['float64']="),
    ({"precision": [FA16]}, "spec.precision=["),
    ({"max_seqlen": 0}, "spec.max_seqlen=0 must be an int >= 1"),
    ({"max_seqlen": 2.5}, "spec.max_seqlen=2.5 must be an int >= 1"),
    ({"returns_lse": "no"}, "spec.returns_lse='no' must be a bool"),
    ({"gqa": 1}, "spec.gqa=1 must be a bool"),
    ({"deterministic": None}, "spec.deterministic=None must be a bool"),
    ({"dtypes": "float16"}, "spec.dtypes='float16' must be a set"),
    ({"mask_kinds": "causal"}, "spec.mask_kinds='causal' must be a set"),
    ({"head_dims": 64}, "spec.head_dims=64 must be a set"),
    ({"head_dims_v": 64}, "spec.head_dims_v=64 must be a set"),
    ({"paged": "yes"}, "spec.paged='yes' must be a bool"),
    ({"max_splits": 0}, "spec.max_splits=0 must be an int in [1, 256]"),
    ({"max_splits": 257}, "spec.max_splits=257 must be an int in [1, 256]"),
    ({"layouts": "packed"}, "spec.layouts='packed' must be a non-empty set"),
    ({"layouts": frozenset({"ragged"})}, "a subset of ['padded', 'packed']"),
    ({"layouts": frozenset()}, "must be a non-empty set"),
    ({"tanh_error_ulp": -1}, "spec.tanh_error_ulp=-1 must be a float in [0, 2^20)"),
    ({"kv_blocks": {128: 0}}, "spec.kv_blocks={128: 0} must be a dict head dim D -> K block"),
    ({"head_dim_pairs": (64, 64)}, "spec.head_dim_pairs=(64, 64) must be None or a non-empty"),
    ({"head_dim_pairs": frozenset()}, "must be None or a non-empty set of (D, Dv) tuples"),
    ({"head_dim_pairs": {(64, 0)}}, "spec.head_dim_pairs={(64, 0)} must be None or a non-empty"),
    (
        {"head_dim_pairs": {(64, 64), (128, 128), (96, 96)}},
        "spec.head_dim_pairs has [(96, 96)] outside spec.head_dims x spec.head_dims_v",
    ),
    (
        {"head_dims_v": (64, 128), "head_dim_pairs": {(64, 128), (128, 128)}},
        "must pair every declared head dim (D without a pair: []; Dv without a pair: [64])",
    ),
    (
        {"head_dim_pairs": {(64, 64)}},
        "must pair every declared head dim (D without a pair: [128]; Dv without a pair: [128])",
    ),
    ({"head_dim_pairs": {(64, 128), (128, 128)}}, "has Dv != D but spec.head_dims_v is None"),
]


def _stable_id(value: Any) -> str:
    """A test id that does not depend on set iteration order (which differs between processes,
    so pytest-xdist workers would collect different ids)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_stable_id(v)}" for k, v in value.items()) + "}"
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(_stable_id(v) for v in value)) + "}"
    return repr(value)


@pytest.mark.parametrize(("kwargs", "message"), ROWS, ids=[_stable_id(r[0]) for r in ROWS])
def test_malformed_spec_field_raises_value_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        KernelSpec(**({"name": "k"} | kwargs))


def test_well_formed_spec_is_accepted() -> None:
    spec = KernelSpec(
        name="k",
        dtypes=("float16",),
        causal_alignment=CausalAlignment.TOP_LEFT,
        precision={"float16": FA16},
        gqa=False,
        returns_lse=False,
        head_dims_v=None,
    )
    assert spec.precision_for("float16") is FA16


def test_call_options_outside_the_declaration_are_refused_with_a_reason() -> None:
    """A case using a call option the spec does not declare is unsupported, and says which."""
    q = np.zeros((1, 4, 1, 64), np.float16)
    case = AttentionCase(q, q, q)
    plain = KernelSpec(name="k")
    wide = KernelSpec(name="k", paged=True, max_splits=4, layouts=("padded", "packed"))
    for options, reason in (
        (dict(page_size=3), "paged KV (page_size) not supported"),
        (dict(num_splits=2), "num_splits=2 above max_splits=1"),
        (dict(layout="packed"), "layout 'packed' not in ['padded']"),
    ):
        with_option = dataclasses.replace(case, **options)
        assert plain.unsupported(with_option) == reason
        assert wide.unsupported(with_option) is None
    assert wide.unsupported(dataclasses.replace(case, num_splits=5)) == (
        "num_splits=5 above max_splits=4"
    )


def test_kv_blocks_choose_the_bound_block_per_head_dim() -> None:
    q = np.zeros((1, 4, 1, 256), np.float16)
    spec = KernelSpec(name="k", head_dims=(64, 256), kv_blocks={256: 16})
    assert spec.block_n_for(AttentionCase(q, q, q)) == 16
    assert spec.block_n_for(AttentionCase(q[..., :64], q[..., :64], q[..., :64])) == 128


def test_head_dim_pairs_restrict_d_and_dv_to_the_declared_pairs() -> None:
    """flash_attn.cute on SM90: 192/128 ran, 64/256 does not compile; independent D and Dv
    sets could not say so. A pair outside the declaration is unsupported, and says which."""
    spec = KernelSpec(
        name="k",
        head_dims=(64, 192),
        head_dims_v=(64, 128, 192),
        head_dim_pairs={(64, 64), (192, 192), (192, 128)},
    )
    assert spec.value_dims_for(192) == (128, 192) and spec.value_dims_for(64) == (64,)

    def case(D: int, Dv: int) -> AttentionCase:
        q = np.zeros((1, 4, 1, D), np.float16)
        return AttentionCase(q, q, np.zeros((1, 4, 1, Dv), np.float16))

    assert spec.unsupported(case(192, 128)) is None
    assert spec.unsupported(case(64, 128)) == (
        "head dims (D=64, Dv=128) not a declared pair "
        "(head_dim_pairs [(64, 64), (192, 128), (192, 192)])"
    )
    free = KernelSpec(name="k", head_dims=(64, 192), head_dims_v=(64, 128, 192))
    assert free.unsupported(case(64, 128)) is None and free.value_dims_for(64) == (64, 128, 192)
    assert KernelSpec(name="k").value_dims_for(128) == (128,)
