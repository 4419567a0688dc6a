"""The report's figures (matplotlib, Agg backend), each returned as PNG bytes.

All figures plot error as a fraction of the derived bound on a log10 axis: 1 (log10 = 0) is the
bound, so anything right of / above the red line fails. Exact zeros are drawn at the axis floor.
"""

from __future__ import annotations

import io
import math
from collections import Counter

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from attention_crossval.report.records import as_float  # noqa: E402

FLOOR = 1e-8  # plotted value for an exact zero error
WORST_PANELS = 8
PROFILE_COLUMNS = 64
LABEL_SIZE = 8  # points: the configs' labels of the strip and the heatmap
ROW_INCHES = 0.2  # height per labelled line, so labels of LABEL_SIZE do not overlap


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def plottable(records: list[dict]) -> list[dict]:
    """The ok records with the forward plot data (``histogram``, ``row_profile``, the primary
    pair); the schema leaves those optional, e.g. for a backward-only record."""
    keys = ("histogram", "row_profile", "primary_pair")
    return [
        r
        for r in records
        if r["status"] == "ok"
        and all(k in r for k in keys)
        and r["primary_pair"] in r["pairs"]
        and _histogram_ok(r["histogram"])
    ]


def _histogram_ok(histogram: dict) -> bool:
    """Finite, increasing bin edges and one count per bin: what the plots draw from (a report
    edited by hand or damaged can hold anything the schema's types allow)."""
    try:
        edges = np.asarray(histogram["edges_log10"], dtype=np.float64)
    except (OverflowError, TypeError, ValueError):
        return False
    counts = histogram["counts"]
    return (
        edges.ndim == 1
        and edges.size >= 2
        and bool(np.all(np.isfinite(edges)))
        and bool(np.all(np.diff(edges) > 0))
        and len(counts) == edges.size - 1
    )


def _fraction(record: dict) -> float:
    value = as_float(record["pairs"][record["primary_pair"]]["max_bound_fraction"])
    return FLOOR if value == 0 else (1e3 if not math.isfinite(value) else max(value, FLOOR))


def _kernels(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["kernel"]["name"] for r in records))


def histograms(records: list[dict]) -> bytes:
    """Per-config histograms of log10(error/bound) per element: all configs as one heat strip
    each (left, share of the config's elements per bin), and step plots of the worst
    ``WORST_PANELS`` configs (right), one line per kernel. One axes per config would cost
    matplotlib ~0.3 s each, too slow for a one-minute report."""
    records = plottable(records)
    # One strip per record needs one set of bins: the report's (a record with other edges,
    # from a hand-edited or damaged file, is left out of the strip).
    common = Counter(tuple(r["histogram"]["edges_log10"]) for r in records).most_common(1)[0][0]
    records = [r for r in records if tuple(r["histogram"]["edges_log10"]) == common]
    records = sorted(records, key=lambda r: -_fraction(r))
    edges = np.array(common, dtype=np.float64)
    shares = np.array([_shares(r) for r in records])
    figure = plt.figure(figsize=(14, max(4.0, 1.2 + ROW_INCHES * len(records))))
    strip = figure.add_axes((0.22, 0.06, 0.3, 0.9))
    shown = strip.imshow(
        np.log10(np.clip(shares, 1e-4, None)),
        aspect="auto",
        cmap="viridis",
        extent=(edges[0], edges[-1], len(records) - 0.5, -0.5),
        interpolation="nearest",
    )
    strip.axvline(0, color="red", linewidth=1)
    labels = [f"{r['config']['name']} [{r['kernel']['name']}]" for r in records]
    strip.set_yticks(range(len(records)), labels, fontsize=LABEL_SIZE)
    strip.set_xlabel("log10(|error| / bound), worst configs on top")
    figure.colorbar(shown, ax=strip, label="log10(share of elements)", fraction=0.05)
    worst = list(dict.fromkeys(r["config"]["name"] for r in records))[:WORST_PANELS]
    for index, config in enumerate(worst):
        axis = figure.add_axes((0.62 + 0.19 * (index % 2), 0.78 - 0.24 * (index // 2), 0.16, 0.17))
        for record in records:
            if record["config"]["name"] == config:
                axis.step(
                    edges,
                    np.append(_shares(record), 0),
                    where="post",
                    label=record["kernel"]["name"],
                )
        axis.axvline(0, color="red", linewidth=1)
        axis.set_yscale("log")
        axis.set_title(config, fontsize=7)
        axis.tick_params(labelsize=6)
        if index == 0:
            axis.legend(fontsize=6)
    return _png(figure)


def _shares(record: dict) -> np.ndarray:
    """Histogram counts as shares of the non-zero errors, infinite ones (a NaN or inf output)
    in the last bin with the errors past its edge: a kernel whose every error is non-finite
    still shows (empty only when every error is zero)."""
    counts = np.array(record["histogram"]["counts"], dtype=float)
    counts[-1] += record["histogram"].get("infinite", 0)
    return counts / max(counts.sum(), 1.0)


def error_vs_sk_and_distribution(records: list[dict]) -> bytes:
    """Max error/bound of each config against Sk (left) and per score distribution (right)."""
    records = plottable(records)
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    distributions = sorted({r["config"]["distribution"] for r in records})
    for offset, kernel in enumerate(_kernels(records)):
        mine = [r for r in records if r["kernel"]["name"] == kernel]
        left.scatter(
            [r["config"]["Sk"] for r in mine],
            [_fraction(r) for r in mine],
            label=kernel,
            s=16,
            alpha=0.7,
        )
        x = [distributions.index(r["config"]["distribution"]) + 0.15 * offset for r in mine]
        right.scatter(x, [_fraction(r) for r in mine], label=kernel, s=16, alpha=0.7)
    for axis in (left, right):
        axis.set_yscale("log")
        axis.axhline(1, color="red", linewidth=1)
        axis.set_ylabel("max |error| / bound")
        axis.grid(alpha=0.3)
    left.set_xscale("log", base=2)
    left.set_xlabel("Sk (keys)")
    right.set_xticks(range(len(distributions)), distributions, rotation=20)
    right.set_xlabel("score distribution")
    left.legend(fontsize=8)
    figure.tight_layout()
    return _png(figure)


def row_heatmap(records: list[dict]) -> bytes:
    """Error/bound over query rows: one panel per kernel (titled with it), one line per config
    labelled with the config alone (readable at :data:`LABEL_SIZE` points), rows binned to
    relative position in the sequence (max over batches and heads), log10 colour scale."""
    records = plottable(records)
    kernels = _kernels(records)
    panels = [[r for r in records if r["kernel"]["name"] == kernel] for kernel in kernels]
    heights = [len(mine) + 2.5 for mine in panels]  # a panel's rows, plus its title and ticks
    figure, axes = plt.subplots(
        len(kernels),
        1,
        figsize=(10, 0.6 + ROW_INCHES * sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for axis, kernel, mine in zip(axes[:, 0], kernels, panels, strict=True):
        shown = axis.imshow(
            np.array([_row_bins(r) for r in mine]),
            aspect="auto",
            cmap="magma",
            vmin=math.log10(FLOOR),
            vmax=1,
            interpolation="nearest",
        )
        axis.set_title(kernel, fontsize=LABEL_SIZE + 1, loc="left")
        axis.set_yticks(range(len(mine)), [r["config"]["name"] for r in mine], fontsize=LABEL_SIZE)
        axis.set_xticks(
            [0, PROFILE_COLUMNS // 2, PROFILE_COLUMNS - 1], ["first row", "middle", "last row"]
        )
        figure.colorbar(shown, ax=axis, label="log10(max |error| / bound)", fraction=0.04)
    figure.tight_layout()
    return _png(figure)


def _row_bins(record: dict) -> np.ndarray:
    """A record's row profile resampled to :data:`PROFILE_COLUMNS` bins, as log10 error/bound."""
    values = np.array([[as_float(v) for v in line] for line in record["row_profile"]["values"]])
    profile = values.max(axis=0) if values.size else np.zeros(1)
    positions = np.minimum(
        (np.arange(PROFILE_COLUMNS) * len(profile)) // PROFILE_COLUMNS, len(profile) - 1
    )
    line = np.nan_to_num(profile[positions], nan=FLOOR, posinf=1e3)
    with np.errstate(divide="ignore"):
        return np.log10(np.clip(line, FLOOR, None))


def kernel_comparison(records: list[dict]) -> bytes | None:
    """Each kernel's max error/bound against the first kernel's, config by config (None when
    fewer than two kernels ran on a common config)."""
    records = plottable(records)
    kernels = _kernels(records)
    if len(kernels) < 2:
        return None
    by = {(r["config"]["name"], r["kernel"]["name"]): _fraction(r) for r in records}
    base = kernels[0]
    figure, axis = plt.subplots(figsize=(6, 5.5))
    drawn = False
    for kernel in kernels[1:]:
        common = [c for (c, k) in by if k == kernel and (c, base) in by]
        if common:
            drawn = True
            axis.scatter(
                [by[c, base] for c in common], [by[c, kernel] for c in common], label=kernel, s=18
            )
    if not drawn:
        plt.close(figure)
        return None
    axis.plot([FLOOR, 1e3], [FLOOR, 1e3], color="gray", linewidth=1)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.axhline(1, color="red", linewidth=1)
    axis.axvline(1, color="red", linewidth=1)
    axis.set_xlabel(f"{base}: max |error| / bound")
    axis.set_ylabel("other kernel: max |error| / bound")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return _png(figure)
