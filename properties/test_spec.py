"""KernelSpec rejects every malformed field with a ValueError naming the field and the rule.

Table-driven like properties/test_argument_validation.py: ``(bad keyword arguments, message
fragment)`` rows; each row would, before the validation, have been accepted and then misused
(an alignment string compared with an enum, a str of dtypes iterated per character, ...).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from attention_crossval.kernel.spec import KernelSpec
from attention_crossval.reference.case import CausalAlignment
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
]


@pytest.mark.parametrize(("kwargs", "message"), ROWS, ids=[str(r[0]) for r in ROWS])
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
