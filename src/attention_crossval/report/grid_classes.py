"""Which input classes a set of report configs reaches: the tally that keeps a preset honest.

Each class is a shape, mask or score condition that some real kernel bug needs (GQA with
1 < Hkv < Hq, a decode row whose largest logit is below -30, an explicit mask that empties a
row, ...). :func:`tally` builds every config and lists, per class, the configs whose case has
it, read from the case itself (its shapes, mask and scaled scores), not from the recipe's
names, so a distribution whose values drift out of a class stops counting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from attention_crossval.properties._strategies.scores import scaled_scores
from attention_crossval.reference.case import AttentionCase

_FP16_MAX = 65504.0
# A row's LSE (or largest logit) below this: exp underflows in fp32 for a kernel that skips
# the max subtraction or starts the running max at 0 (e^-30 ~ 1e-13 relative to one key).
VERY_NEGATIVE = -30.0
LONG_DECODE_KEYS = 4096


@dataclass(frozen=True)
class _Scores:
    """A built case with its row statistics: largest logit and LSE per visible row."""

    case: AttentionCase
    logits: np.ndarray  # [B, Hq, Sq, Sk], -inf where not visible
    seen: np.ndarray  # [B, Hq, Sq, Sk]
    valid_rows: np.ndarray  # [B, Hq, Sq]: rows inside q_lengths

    @classmethod
    def of(cls, case: AttentionCase) -> _Scores:
        logits, seen = scaled_scores(case)
        valid = (
            np.arange(case.Sq)[None, :]
            < np.array([case.q_length(b) for b in range(case.B)])[:, None]
        )
        return cls(case, logits, seen, np.broadcast_to(valid[:, None, :], seen.shape[:3]))

    def row_max(self) -> np.ndarray:
        """Largest visible logit per row that sees a key (flattened)."""
        rows = self.seen.any(axis=-1)
        return self.logits[rows].max(axis=-1)

    def row_lse(self) -> np.ndarray:
        rows = self.seen.any(axis=-1)
        logits = self.logits[rows]
        top = logits.max(axis=-1, keepdims=True)
        return top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))


def _varlen_with(kind: str) -> Callable[[_Scores], bool]:
    def reached(s: _Scores) -> bool:
        case = s.case
        return {"varlen", kind} <= case.mask.kinds and any(
            case.q_length(b) != case.k_length(b) for b in range(case.B)
        )

    return reached


def _half_tile(n: int) -> bool:
    """Half a 128-key (or 64-key) tile past a tile edge."""
    return n % 128 == 64 or n % 64 == 32


def _beyond_fp16(s: _Scores) -> bool:
    return bool(s.seen.any() and np.abs(s.logits[s.seen]).max() > _FP16_MAX)


def _uniform(s: _Scores) -> bool:
    """A row of 16+ visible keys whose logits span less than 0.05 (softmax nearly uniform;
    gaussian logits over that many keys never are)."""
    rows = s.seen.sum(axis=-1) >= 16
    if not rows.any():
        return False
    low = np.where(s.seen, s.logits, np.inf).min(axis=-1)
    return bool(((s.logits.max(axis=-1) - low)[rows] < 0.05).any())


def _explicit_empties_a_row(s: _Scores) -> bool:
    return "explicit" in s.case.mask.kinds and bool((s.valid_rows & ~s.seen.any(axis=-1)).any())


CLASSES: dict[str, Callable[[_Scores], bool]] = {
    "GQA with 1 < Hkv < Hq": lambda s: 1 < s.case.Hkv < s.case.Hq,
    "Sk < 64": lambda s: s.case.Sk < 64,
    "Dv != D": lambda s: s.case.Dv != s.case.D,
    "scaled scores beyond the fp16 range": _beyond_fp16,
    "varlen + causal, q and k lengths differ": _varlen_with("causal"),
    "varlen + window, q and k lengths differ": _varlen_with("window"),
    "decode (Sq = 1)": lambda s: s.case.Sq == 1,
    "decode row with its largest logit below -30": lambda s: (
        s.case.Sq == 1 and bool((s.row_max() < VERY_NEGATIVE).any())
    ),
    "half-tile length with a row LSE below -30": lambda s: (
        (_half_tile(s.case.Sq) or _half_tile(s.case.Sk))
        and bool((s.row_lse() < VERY_NEGATIVE).any())
    ),
    "uniform logits (16+ keys spanning < 0.05)": _uniform,
    "explicit mask that empties a row": _explicit_empties_a_row,
    "long GQA decode (Sq <= 16, Sk >= 4096, Hq > Hkv)": lambda s: (
        s.case.Sq <= 16 and s.case.Sk >= LONG_DECODE_KEYS and s.case.Hq > s.case.Hkv
    ),
}


# The largest score plane (B * Hq * Sq * Sk) a tally builds: long and huge presets' cases are left
# out (they would cost seconds to minutes and gigabytes each just to be classified).
TALLY_MAX_SCORES = 2**22


def tally(configs: Iterable) -> dict[str, list[str]]:
    """Per class of :data:`CLASSES`, the names of the configs (``report.configs.Config`` or
    anything with ``name`` and ``build()``) whose built case reaches it; empty lists for
    classes none reaches. Configs above :data:`TALLY_MAX_SCORES` scores are not built."""
    reached: dict[str, list[str]] = {name: [] for name in CLASSES}
    for config in configs:
        shape = config.fields()
        if shape["B"] * shape["Hq"] * shape["Sq"] * shape["Sk"] > TALLY_MAX_SCORES:
            continue
        with np.errstate(all="ignore"):  # -inf logits of hidden keys, huge scores
            scores = _Scores.of(config.build())
            for name, predicate in CLASSES.items():
                if predicate(scores):
                    reached[name].append(config.name)
    return reached
