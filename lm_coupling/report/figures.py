"""The report's figures. Each function draws on an optional ``ax`` and returns it.

Figures are built on `matplotlib.figure.Figure` (no pyplot state, any
backend); callers save them. `new_axes` makes a figure of ``FIGSIZE`` inches at
``DPI``, so a saved PNG is ``FIGSIZE * DPI`` pixels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from lm_coupling.report.benchmarks import parse_step
from lm_coupling.report.boundary import boundary_layer, boundary_profile

FIGSIZE = (6.0, 4.5)
DPI = 100
PROFILE_LABELS = {
    "norm": "norm ||x^l||",
    "windowed_lss": "windowed LSS",
    "logit_lens_entropy": "logit-lens entropy H/ln V",
    "tv_to_target": "TV to target",
}


def new_axes(ncols: int = 1, figsize: tuple[float, float] = FIGSIZE) -> list[Axes]:
    """A fresh figure with ``ncols`` axes side by side."""
    fig = Figure(figsize=figsize, dpi=DPI)
    return [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def new_grid(nrows: int, ncols: int, cell: tuple[float, float] = (4.0, 3.4)) -> np.ndarray:
    """A fresh figure with an ``nrows x ncols`` array of axes, ``cell`` inches each."""
    fig = Figure(figsize=(cell[0] * ncols, cell[1] * nrows), dpi=DPI, layout="constrained")
    return np.asarray(fig.subplots(nrows, ncols, squeeze=False))


def _short(model: str) -> str:
    return model.rstrip("/").split("/")[-1]


def metric_vs_score(
    board: pd.DataFrame,
    metric: str,
    target: str,
    fit: Mapping | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Scatter of a geometry metric against a score with the OLS line (coupling paper, Fig. 1a).

    Args:
        board: leaderboard rows.
        metric: x column.
        target: y column.
        fit: a ``correlations.csv`` row (slope, intercept, r2, p_hc3) to draw and quote.
        ax: axes to draw on (a new figure when None).
    """
    ax = ax if ax is not None else new_axes()[0]
    data = board[["model", metric, target]].dropna()
    ax.scatter(data[metric], data[target], color="tab:blue", zorder=3)
    for row in data.itertuples(index=False):
        ax.annotate(_short(str(row[0])), (row[1], row[2]), fontsize=7, alpha=0.7)
    if fit is not None and np.isfinite(fit.get("slope", math.nan)) and len(data):
        xs = np.linspace(data[metric].min(), data[metric].max(), 50)
        ax.plot(xs, fit["intercept"] + fit["slope"] * xs, color="tab:red")
        ax.set_title(
            f"{metric} vs {target}: R^2 = {fit['r2']:.3f}, p (HC3) = "
            f"{fit['p_hc3']:.3g}, n = {int(fit['n'])}",
            fontsize=9,
        )
    else:
        ax.set_title(f"{metric} vs {target}", fontsize=9)
    ax.set_xlabel(metric)
    ax.set_ylabel(target)
    return ax


def layer_profile(
    values: Sequence[float],
    name: str,
    boundary: float | None = None,
    ax: Axes | None = None,
    stderr: Sequence[float] | None = None,
) -> Axes:
    """One per-layer profile, with the thought/fixation boundary layer as a dashed line."""
    ax = ax if ax is not None else new_axes()[0]
    y = np.asarray(values, dtype=float)
    layers = np.arange(len(y)) + (1 if name == "windowed_lss" else 0)
    ax.plot(layers, y, marker="o", markersize=3)
    if stderr is not None:
        err = np.asarray(stderr, dtype=float)
        ax.fill_between(layers, y - err, y + err, alpha=0.2)
    if boundary is not None and math.isfinite(boundary):
        ax.axvline(boundary, color="tab:red", linestyle="--", label="thought/fixation")
        ax.legend(fontsize=7)
    ax.set_xlabel("layer l")
    ax.set_title(PROFILE_LABELS.get(name, name), fontsize=9)
    return ax


def profile_boundary(profiles: Mapping[str, Mapping]) -> float:
    """The boundary layer from the entropy profile, else the TV profile (NaN if neither)."""
    profile = boundary_profile(profiles)
    return boundary_layer(profile) if profile is not None else math.nan


def coupling_heatmap(
    matrix: Sequence[Sequence[float]], ax: Axes | None = None, title: str = "coupling c_K(l, l')"
) -> Axes:
    """The L x L coupling matrix as a heatmap (rows l, columns l')."""
    ax = ax if ax is not None else new_axes()[0]
    data = np.asarray(matrix, dtype=float)
    image = ax.imshow(data, cmap="viridis", origin="upper")
    ax.figure.colorbar(image, ax=ax)
    ax.set_xlabel("layer l'")
    ax.set_ylabel("layer l")
    ax.set_title(title, fontsize=9)
    return ax


def coupling_graph(
    matrix: Sequence[Sequence[float]], ax: Axes | None = None, quantile: float = 0.5
) -> Axes:
    """Layers on a circle, joined where their coupling is above the ``quantile`` of off-diagonals.

    Edge width and opacity grow with the symmetric coupling ``(A + A^T) / 2``.
    """
    ax = ax if ax is not None else new_axes()[0]
    data = np.asarray(matrix, dtype=float)
    sym = (data + data.T) / 2
    n = len(sym)
    angle = 2 * np.pi * np.arange(n) / max(n, 1)
    xy = np.column_stack([np.cos(angle), np.sin(angle)])
    off = sym[~np.eye(n, dtype=bool)]
    off = off[np.isfinite(off)]
    if len(off):
        low, high = np.quantile(off, quantile), off.max()
        for i in range(n):
            for j in range(i + 1, n):
                if np.isfinite(sym[i, j]) and sym[i, j] >= low:
                    w = (sym[i, j] - low) / (high - low) if high > low else 1.0
                    ax.plot(
                        *xy[[i, j]].T,
                        color="tab:purple",
                        linewidth=0.5 + 3 * w,
                        alpha=0.3 + 0.7 * w,
                    )
    ax.scatter(*xy.T, s=120, color="white", edgecolors="black", zorder=3)
    for i, (x, y) in enumerate(xy):
        ax.annotate(str(i + 1), (x, y), ha="center", va="center", fontsize=7, zorder=4)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title("layer-to-layer coupling graph", fontsize=9)
    return ax


def _spans_decades(values: pd.Series, decades: float = 2.0) -> bool:
    """True when ``values`` are positive and span more than ``decades`` powers of ten."""
    values = values.dropna()
    return bool(len(values)) and values.min() > 0 and values.max() / values.min() > 10**decades


def training_dynamics(board: pd.DataFrame, metrics: Sequence[str], target: str) -> np.ndarray:
    """Score and geometry over training, and geometry against score, per model.

    Top row: ``target`` and each of ``metrics`` against training step (from
    the revision, e.g. ``step512``; symmetric-log axis so that the
    initialisation, step 0, is shown). Bottom row: each metric against
    ``target``, the checkpoints of a model joined in step order and its last
    one ringed, so that the path from initialisation to the trained model reads
    left to right or right to left (the papers' emergence plots). A metric
    whose values span more than two decades (expodistance at initialisation)
    gets a log axis.

    Returns:
        The ``2 x (len(metrics) + 1)`` axes array (the bottom-left one is off).
    """
    columns = [target, *metrics]
    data = board.assign(_step=board["revision"].map(parse_step)).dropna(subset=["_step"])
    axes = new_grid(2, len(columns))
    for ax, column in zip(axes[0], columns, strict=True):
        for model, group in data.dropna(subset=[column]).groupby("model"):
            group = group.sort_values("_step")
            ax.plot(group["_step"], group[column], marker="o", ms=3, label=_short(str(model)))
        ax.set_xscale("symlog", linthresh=1.0)
        if _spans_decades(data[column]):
            ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_title(f"{column} over training", fontsize=9)
    axes[0][0].legend(fontsize=7)
    axes[1][0].set_axis_off()
    for ax, column in zip(axes[1][1:], metrics, strict=True):
        for model, group in data.dropna(subset=[column, target]).groupby("model"):
            group = group.sort_values("_step")
            line = ax.plot(group[column], group[target], marker="o", ms=3, label=_short(str(model)))
            last = group.iloc[-1]
            ax.scatter(
                [last[column]], [last[target]], s=60, facecolors="none",
                edgecolors=line[0].get_color(), zorder=3,
            )  # fmt: skip
        if _spans_decades(data[column]):
            ax.set_xscale("log")
        ax.set_xlabel(column)
        ax.set_ylabel(target)
        ax.set_title(f"{target} vs {column} (ring: last step)", fontsize=9)
    return axes
