"""The report's default grid reaches the input classes real bugs need (report.grid_classes),
and the Config fields that express them (Dv, Hkv, softmax_scale, the explicit mask) are
validated and read from config files."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
import pytest

from attention_crossval.properties._strategies.gradients import GRADIENT_DISTRIBUTIONS
from attention_crossval.report.backward import backward_case
from attention_crossval.report.configs import (
    _CPU_DISTS,
    Config,
    _rotated,
    grid,
    load_config_file,
    preset,
    unique,
)
from attention_crossval.report.grid_classes import tally

pytestmark = pytest.mark.cpu

_CROSSED_CLASSES = [
    "decode row with its largest logit below -30",
    "half-tile length with a row LSE below -30",
    "uniform logits (16+ keys spanning < 0.05)",
    "explicit mask that empties a row",
    "long GQA decode (Sq <= 16, Sk >= 4096, Hq > Hkv)",
]


def _decode_distributions(configs: list[Config], reached: dict[str, list[str]]) -> set[str]:
    decode = set(reached["decode (Sq = 1)"])
    return {c.distribution for c in configs if c.name in decode}


def test_default_preset_reaches_every_class() -> None:
    configs = unique(preset("default"))
    reached = tally(configs)
    assert [name for name, hits in reached.items() if not hits] == []
    assert len(_decode_distributions(configs, reached)) >= 5


def test_the_previous_default_grids_miss_them() -> None:
    """The checks can fail: the rotated grid alone (the default before the crossed configs)
    misses the crossed classes and puts one distribution on decode; the grid before that
    misses the property suite's classes too."""
    rotated = _rotated()
    reached = tally(rotated)
    assert [name for name, hits in reached.items() if not hits] == _CROSSED_CLASSES
    assert _decode_distributions(rotated, reached) == {"ramp"}
    older = grid(
        dtypes=["bfloat16", "float16"],
        head_dims=[64, 128],
        lengths=[(128, 128), (100, 300), (1, 257), (200, 129), (64, 512)],
        masks=["none", "causal", "window", "varlen"],
        distributions=_CPU_DISTS,
    )
    assert len([name for name, hits in tally(older).items() if not hits]) == 6 + 5


def test_explicit_config_mask_empties_rows() -> None:
    """Config mask ``explicit``: every fourth query row sees no key, the others most keys."""
    case = Config("float16", 16, 9, 20, mask="explicit").build()
    visible = case.mask.explicit[0, 0]
    assert visible.shape == (9, 20)
    assert [i for i in range(9) if not visible[i].any()] == [3, 7]
    assert visible[[0, 1, 2, 4, 5, 6, 8]].mean() == pytest.approx(0.8, abs=0.05)


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


def test_default_preset_has_the_backward_rows() -> None:
    """``--pass backward`` on the default grid meets non-default scales, every non-gaussian dO,
    fp32 inputs and keys to 4096 (before these rows: scale 1/sqrt(D), gaussian dO, 16-bit
    inputs and at most 512 keys only)."""
    configs = preset("default")
    assert {c.softmax_scale for c in configs} >= {0.5, 1.0}
    assert {c.do_distribution for c in configs} == {None, *GRADIENT_DISTRIBUTIONS} - {"gaussian"}
    assert "float32" in {c.dtype for c in configs}
    assert max(c.Sk for c in configs) >= 4096
    assert max(c.Sk for c in configs if c.Sq > 16) >= 2048
    rotated = _rotated()
    assert {c.do_distribution for c in rotated} == {None}
    assert {c.dtype for c in rotated} == {"bfloat16", "float16"}


def test_do_distribution_reaches_the_backward_and_leaves_the_forward_alone() -> None:
    config = Config("bfloat16", 16, 5, 9, do_distribution="one_hot", seed=3)
    plain = dataclasses.replace(config, name="", do_distribution=None)
    assert config.name == plain.name.replace("-s3", "-do_one_hot-s3")
    assert "do_distribution" not in plain.fields()
    case = config.build()
    assert np.array_equal(case.q, plain.build().q)
    grad = backward_case(case, config.seed, config.do_distribution)
    assert (np.count_nonzero(grad.do, axis=-1) <= 1).all()  # one nonzero per dO row
    assert np.count_nonzero(backward_case(case, config.seed).do) > grad.do.shape[1]
    with pytest.raises(ValueError, match=r"config.do_distribution='zeros' must be None"):
        Config("bfloat16", 16, 5, 9, do_distribution="zeros")


def test_a_report_shows_the_input_classes_its_configs_reach(tmp_path) -> None:
    """report.json carries the tally of its configs and report.md shows it, a class no config
    reaches marked **none**."""
    from attention_crossval.report.cli import main
    from attention_crossval.report.configs import preset
    from attention_crossval.report.grid_classes import CLASSES, tally

    argv = ["--preset", "tiny", "--tier", "streaming", "--no-html", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["input_classes"] == tally(preset("tiny"))
    markdown = (tmp_path / "report.md").read_text()
    assert "## Input classes reached" in markdown
    for name, configs in report["input_classes"].items():
        assert f"| {name} | {len(configs)} |" in markdown
    assert any(not configs for configs in report["input_classes"].values())  # tiny misses some
    assert "**none**" in markdown and set(report["input_classes"]) == set(CLASSES)
