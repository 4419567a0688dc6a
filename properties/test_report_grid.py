"""The report's default grid reaches the bug classes the property suite targets, and the Config
fields that express them (Dv, Hkv, softmax_scale) are validated and read from config files."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from attention_crossval.properties._strategies.scores import scaled_scores
from attention_crossval.report.configs import _CPU_DISTS, Config, grid, load_config_file, preset

pytestmark = pytest.mark.cpu

_FP16_MAX = 65504.0


def missing_classes(configs: list[Config]) -> list[str]:
    """The bug classes no config of ``configs`` reaches."""
    cases = [(config, config.build()) for config in configs]

    def varlen_with(kind: str) -> bool:
        return any(
            {"varlen", kind} <= case.mask.kinds
            and any(case.q_length(b) != case.k_length(b) for b in range(case.B))
            for _, case in cases
        )

    def beyond_fp16(case) -> bool:
        logits, seen = scaled_scores(case)
        return bool(seen.any() and np.abs(logits[seen]).max() > _FP16_MAX)

    reached = {
        "GQA with 1 < Hkv < Hq": any(1 < case.Hkv < case.Hq for _, case in cases),
        "Sk < 64": any(case.Sk < 64 for _, case in cases),
        "scaled scores beyond the fp16 range": any(beyond_fp16(case) for _, case in cases),
        "varlen + causal, q and k lengths differ": varlen_with("causal"),
        "varlen + window, q and k lengths differ": varlen_with("window"),
        "Dv != D": any(case.Dv != case.D for _, case in cases),
    }
    return [name for name, hit in reached.items() if not hit]


def test_default_preset_reaches_every_bug_class() -> None:
    assert missing_classes(preset("default")) == []


def test_the_previous_default_grid_misses_them() -> None:
    """The check can fail: the default grid before these classes were added reached none."""
    previous = grid(
        dtypes=["bfloat16", "float16"],
        head_dims=[64, 128],
        lengths=[(128, 128), (100, 300), (1, 257), (200, 129), (64, 512)],
        masks=["none", "causal", "window", "varlen"],
        distributions=_CPU_DISTS,
    )
    assert len(missing_classes(previous)) == 6


BAD: list[tuple[dict[str, Any], str]] = [
    ({"Dv": 0}, "config.Dv=0 must be None (= D) or an int >= 1"),
    ({"Dv": True}, "config.Dv=True must be None"),
    ({"Dv": 32.0}, "config.Dv=32.0 must be None"),
    ({"softmax_scale": 0.0}, "config.softmax_scale=0.0 must be None (= 1/sqrt(D)) or a number"),
    ({"softmax_scale": 1e18}, "config.softmax_scale=1e+18 must be None (= 1/sqrt(D)) or a number"),
    ({"softmax_scale": float("inf")}, "config.softmax_scale=inf must be None"),
    ({"softmax_scale": "0.1"}, "config.softmax_scale='0.1' must be None"),
    ({"softmax_scale": True}, "config.softmax_scale=True must be None"),
    ({"Hkv": 3}, "config.Hq=2 must be a multiple of config.Hkv=3"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_config_rejects_bad_new_fields(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Config("float16", 64, 8, 8, **overrides)


def test_new_fields_reach_the_case_and_leave_older_recipes_alone(tmp_path) -> None:
    """Dv, Hkv and softmax_scale go through JSON and TOML config files into the built case; a
    recipe without them keeps the digest and inputs it had before they existed."""
    entry = {"dtype": "bfloat16", "D": 64, "Sq": 5, "Sk": 9, "Hq": 4, "Hkv": 2, "Dv": 32}
    (tmp_path / "c.json").write_text(json.dumps([{**entry, "softmax_scale": 0.25}]))
    toml = "\n".join(f"{k} = {json.dumps(v)}" for k, v in entry.items())
    (tmp_path / "c.toml").write_text(f"[[config]]\n{toml}\nsoftmax_scale = 0.25\n")
    for path in ("c.json", "c.toml"):
        (config,) = load_config_file(tmp_path / path)
        case = config.build()
        assert (case.Hkv, case.D, case.Dv, case.softmax_scale) == (2, 64, 32, 0.25)
        assert config.name.endswith("-dv32-scale0.25")
    old = Config("bfloat16", 64, 100, 300, B=3, Hq=4, Hkv=2, mask="varlen", distribution="ramp")
    assert "Dv" not in old.fields() and "softmax_scale" not in old.fields()
    assert old.digest == "7f13319be73dd30e"  # measured before the fields were added
    # q correctly rounded to bf16 (reference.precision.cast_input), whatever the ml_dtypes
    # version: before 0.7 its float64 -> bf16 cast rounded through float32 and one value of this
    # q differed (1.33984374 became 1.34375), and the sum pinned then was 1332.2191287577152.
    assert float(np.asarray(old.build().q, dtype=np.float64).sum()) == 1332.2113162577152
