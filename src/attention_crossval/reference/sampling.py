"""Adversarial row sampling for cases too long to check on every row (docs/long-context.md).

Uniform rows miss the rows where kernels break. A row plan picks query positions by reason,
each reason a bug class:

* ``edges``: the first and last row, and per batch the last valid row and the first padded row
  (padding and varlen bugs);
* ``tile_edges``: the first and last row of query tiles (``tile_m``): every tile when the budget
  allows, else tiles spread evenly, the first and last tile always (tile-boundary masking);
* ``kinks``: rows where the visible-key count stops changing linearly in the row, i.e. where
  the causal diagonal or a window hits the start or end of the keys, and their neighbours
  (alignment and window-clipping bugs);
* ``mod_tile``: rows whose visible key count is ``1 (mod tile_n)``, or whose last visible key
  starts a K tile: a last K block holding one key (partial-block masking);
* ``uniform``: the rest of the budget, drawn uniformly (everything else);
* ``worst``: added per kernel: the rows where its output looks worst against a cheap reference
  on every row (:func:`reference.rowwise.row_scores`), so a bug anywhere, in any head, becomes a
  checked row.

Positions are shared by every batch and head (the sub-case of :mod:`reference.subset`), so a
plan of ``n`` positions costs ``n * B * Hq`` rows, each ``O(Sk)``: never ``Sq * Sk``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attention_crossval.reference.case import AttentionCase
from attention_crossval.reference.masks import key_ranges, visible_counts

REASONS = ("edges", "kinks", "tile_edges", "mod_tile", "uniform", "worst")


@dataclass(frozen=True)
class RowPlan:
    """Sorted unique query ``positions`` and, per reason, the positions chosen for it."""

    positions: np.ndarray
    reasons: dict[str, np.ndarray] = field(default_factory=dict)

    def with_reason(self, reason: str, positions: np.ndarray) -> RowPlan:
        """This plan plus ``positions`` under ``reason``."""
        if reason not in REASONS:
            raise ValueError(f"reason={reason!r} must be one of {REASONS}")
        positions = np.unique(np.asarray(positions, dtype=np.int64))
        reasons = {**self.reasons, reason: positions}
        return RowPlan(np.union1d(self.positions, positions), reasons)

    def summary(self) -> dict[str, int]:
        """Positions per reason (a position may serve several)."""
        return {reason: len(chosen) for reason, chosen in self.reasons.items()}


def _spread(candidates: np.ndarray, count: int) -> np.ndarray:
    """At most ``count`` of the sorted ``candidates``, evenly spaced, both ends included."""
    candidates = np.unique(candidates)
    if count <= 0 or candidates.size == 0:
        return candidates[:0]
    if candidates.size <= count:
        return candidates
    return candidates[np.unique(np.linspace(0, candidates.size - 1, count).round().astype(int))]


def _counts(case: AttentionCase) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per batch ``(lo, hi, count)`` of every position's visible keys; an explicit mask has no
    interval, so there ``lo = 0`` and ``hi = count`` (the widest head's)."""
    if case.mask.explicit is not None:
        counts = visible_counts(case).max(axis=1)  # [B, Sq]: the widest head
        return [(np.zeros_like(c), c, c) for c in counts]
    out = []
    for b in range(case.B):
        lo, hi = key_ranges(case, b)
        out.append((lo, hi, hi - lo))
    return out


def _kinks(series: np.ndarray) -> np.ndarray:
    """Positions where a per-row series leaves a straight line, with both neighbours."""
    if series.size < 3:
        return np.arange(series.size)
    bends = np.flatnonzero(np.diff(series, 2) != 0) + 1
    return np.unique(np.clip(np.concatenate([bends - 1, bends, bends + 1]), 0, series.size - 1))


def candidates(case: AttentionCase, *, tile_m: int, tile_n: int) -> dict[str, np.ndarray]:
    """Every position each structural reason would pick (before the budget), O(B Sq)."""
    Sq = case.Sq
    if Sq == 0:
        return {reason: np.zeros(0, np.int64) for reason in REASONS[:4]}
    edges = [0, Sq - 1]
    kinks, mod_tile = [], []
    for b, (lo, hi, count) in enumerate(_counts(case)):
        q_len = case.q_length(b)
        edges += [max(q_len - 1, 0), min(q_len, Sq - 1)]
        kinks += [_kinks(lo), _kinks(hi), _kinks(count)]
        last_starts_tile = (hi - 1) % tile_n == 0
        mod_tile.append(np.flatnonzero((count > 0) & ((count % tile_n == 1) | last_starts_tile)))
    starts = np.arange(0, Sq, tile_m)
    tile_edges = np.concatenate([starts, np.minimum(starts + tile_m, Sq) - 1])
    return {
        "edges": np.unique(edges),
        "kinks": np.unique(np.concatenate(kinks)),
        "tile_edges": np.unique(tile_edges),
        "mod_tile": np.unique(np.concatenate(mod_tile)),
    }


def adversarial_plan(
    case: AttentionCase, *, tile_m: int, tile_n: int, budget: int, seed: int = 0
) -> RowPlan:
    """A :class:`RowPlan` of about ``budget`` positions (edges always; kinks, tile edges and
    ``mod_tile`` rows up to a quarter of the budget each, spread evenly; uniform rows for the
    rest). ``tile_m`` / ``tile_n``: the kernel's query and key tiles."""
    for name, value in (("tile_m", tile_m), ("tile_n", tile_n), ("budget", budget)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    found = candidates(case, tile_m=tile_m, tile_n=tile_n)
    plan = RowPlan(np.zeros(0, np.int64)).with_reason("edges", found["edges"])
    share = max(1, budget // 4)
    for reason in ("kinks", "tile_edges", "mod_tile"):
        plan = plan.with_reason(reason, _spread(found[reason], share))
    rest = np.setdiff1d(np.arange(case.Sq), plan.positions)
    extra = min(max(budget - len(plan.positions), 0), rest.size)
    uniform = np.random.default_rng(seed).choice(rest, size=extra, replace=False)
    return plan.with_reason("uniform", uniform)


def worst_positions(scores: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` positions whose worst row (over batches and heads) of ``scores``
    (``[B, Hq, Sq]``, e.g. :func:`reference.rowwise.row_scores`) is largest, worst first;
    rows scoring 0 are left out."""
    per_position = scores.max(axis=(0, 1)) if scores.size else np.zeros(scores.shape[-1])
    order = np.argsort(-per_position, kind="stable")[:count]
    return order[per_position[order] > 0]


def exact_rows(
    case: AttentionCase, plan: RowPlan, count: int, *, seed: int = 0, scores=None
) -> np.ndarray:
    """Bool ``[B, Hq, Sq]`` of ``count`` rows for the exact tier, all inside ``plan``: the
    worst-scoring rows first (half the count, with ``scores``), then one position per reason in
    turn (edges, kinks, mod_tile, tile_edges, worst, uniform), each on a batch and head drawn
    with ``seed``, so every reason and every head gets exact rows over a run."""
    rows = np.zeros((case.B, case.Hq, case.Sq), dtype=bool)
    if count < 1 or plan.positions.size == 0:
        return rows
    if scores is not None:
        in_plan = np.zeros(case.Sq, dtype=bool)
        in_plan[plan.positions] = True
        ranked = np.where(in_plan[None, None, :], scores, -np.inf).ravel()
        top = np.argsort(-ranked, kind="stable")[: count // 2]
        rows.ravel()[top[ranked[top] > 0]] = True
    rng = np.random.default_rng(seed)
    order = ("edges", "kinks", "mod_tile", "tile_edges", "worst", "uniform")
    queues = [list(_spread(plan.reasons.get(r, np.zeros(0, np.int64)), count)) for r in order]
    while rows.sum() < min(count, rows.size) and any(queues):
        for queue in queues:
            if queue and rows.sum() < count:
                i = queue.pop(0)
                rows[rng.integers(case.B), rng.integers(case.Hq), i] = True
    return rows
