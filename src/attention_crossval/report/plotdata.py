"""Per-element data behind the report's plots, reduced to a few hundred numbers per record.

The verdict and every metric come from ``reference.compare``; this only keeps distributions
for plotting: a histogram of log10(|error| / bound) and the max error/bound per query-row bin.
"""

from __future__ import annotations

import math

import numpy as np

from attention_crossval.reference.case import AttentionResult

HIST_EDGES_LOG10 = tuple(float(e) for e in np.arange(-8.0, 1.01, 0.5))
PROFILE_ROW_BINS = 64
PROFILE_HEADS = 16


def _fraction(actual: np.ndarray, reference: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Elementwise |actual - reference| / bound for the plots (0/0 = 0, x/0 = inf, a NaN
    actual = inf), NaN where the reference was not evaluated."""
    with np.errstate(invalid="ignore", divide="ignore"):
        error = np.abs(actual - reference)
        error = np.where(np.isnan(error) & ~np.isnan(reference), np.inf, error)
        return np.where(error == 0, 0.0, error / bound)


def histogram(actual, exact, rows, reference64, bound) -> dict:
    """Counts of log10(error / bound) per element: against exact on its sampled rows when the
    exact tier ran, else against the float64 result on all rows."""
    if exact is not None:
        selected = np.transpose(rows, (0, 2, 1))  # [B, Hq, Sq] -> [B, Sq, Hq] like o
        reference = exact.o + exact.o_lo
        fraction = _fraction(actual.o, reference, bound)[selected]
        against = "exact (sampled rows)"
    else:
        fraction = _fraction(actual.o, reference64.o, bound)
        fraction = fraction[~np.isnan(fraction)]
        against = "float64 streaming (evaluated rows)"
    zeros = int(np.sum(fraction == 0))
    finite = fraction[np.isfinite(fraction) & (fraction > 0)]
    edges = np.array(HIST_EDGES_LOG10)
    counts, _ = np.histogram(np.clip(np.log10(finite), edges[0], edges[-1]), bins=edges)
    return {
        "against": against,
        "edges_log10": list(HIST_EDGES_LOG10),
        "counts": counts.tolist(),
        "zeros": zeros,
        "infinite": int(np.sum(~np.isfinite(fraction))),
    }


def row_profile(actual: AttentionResult, reference64: AttentionResult, bound: np.ndarray) -> dict:
    """Max error / bound per query row against the float64 result (which agrees with exact to
    ~1e-15, far below any 16-bit bound), binned to at most 64 row bins x 16 (batch, head) lines;
    NaN where no row of a bin was evaluated."""
    per_row = np.fmax.reduce(_fraction(actual.o, reference64.o, bound), axis=-1)  # [B, Sq, Hq]
    lines = np.transpose(per_row, (0, 2, 1)).reshape(-1, per_row.shape[1])  # [B*Hq, Sq]
    lines = _bin_max(_bin_max(lines, PROFILE_ROW_BINS, axis=1), PROFILE_HEADS, axis=0)
    return {
        "rows_per_bin": math.ceil(per_row.shape[1] / min(PROFILE_ROW_BINS, per_row.shape[1])),
        "lines": "batch*head",
        "values": lines.tolist(),
    }


def _bin_max(array: np.ndarray, bins: int, axis: int) -> np.ndarray:
    n = array.shape[axis]
    if n <= bins:
        return array
    edges = np.linspace(0, n, bins + 1).astype(int)
    parts = [
        np.fmax.reduce(np.take(array, range(lo, hi), axis=axis), axis=axis)  # NaN: not evaluated
        for lo, hi in zip(edges[:-1], edges[1:], strict=True)
    ]
    return np.stack(parts, axis=axis)
