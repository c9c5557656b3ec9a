"""The report's figures (docs/report.md, "The figures"). Each draws on an optional ``ax``.

Figures are `matplotlib.figure.Figure` objects on an Agg canvas with
constrained layout (no pyplot state); callers save them. What a metric or
profile is (label, bounds, axis) comes from the run's catalogue, else the
installed plugins'. Blocks are numbered 1..L, states 0..L (0 = embeddings).
A [0, 1] quantity is drawn on the fixed [0, 1] axis in a profile, its range
printed when nearly flat; a panel that zooms into [0, 1] says by how much.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib import colormaps, rcParams
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.ticker import FixedLocator, MaxNLocator

from lm_coupling.catalogue import Catalogue
from lm_coupling.report.benchmarks import AVERAGE, BENCHMARK_COLUMNS, BOUNDARY_COLUMN, parse_step
from lm_coupling.report.boundary import boundary_layer, boundary_profile
from lm_coupling.report.labels import place_labels
from lm_coupling.report.stats import ALPHA, significant, spans_decades

FIGSIZE = (6.0, 4.5)
FLAT_SPAN = 0.05
DPI = 100
MAX_PANELS_PER_ROW = 4


def new_grid(nrows: int, ncols: int, cell: tuple[float, float] = FIGSIZE) -> np.ndarray:
    """A fresh figure (constrained layout, Agg canvas): ``nrows x ncols`` axes, ``cell`` in."""
    fig = Figure(figsize=(cell[0] * ncols, cell[1] * nrows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return np.asarray(fig.subplots(nrows, ncols, squeeze=False))


def new_panels(n: int, cell: tuple[float, float]) -> list[Axes]:
    """``n`` panels of ``cell`` inches, at most `MAX_PANELS_PER_ROW` to a row (spares hidden)."""
    ncols = min(n, MAX_PANELS_PER_ROW)
    axes = list(new_grid(-(-n // ncols), ncols, cell).ravel())
    for spare in axes[n:]:
        spare.set_axis_off()
    return axes[:n]


def panel_title(label: str, width: int = 40) -> str:
    """A panel's title: its label wrapped at ``width`` characters (a plugin's label can be long)."""
    return textwrap.fill(label, width, break_long_words=False)


def wrap_label(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` characters, broken after a space, ``:_,``.

    A piece longer than ``width`` (``score:<task>:<metric>``) stays whole on its own line.
    """
    pieces = re.split(r"(?<=[ :_,])", text)
    lines, line = [], ""
    for piece in pieces:
        if line and len(line) + len(piece.rstrip()) > width:
            lines.append(line.rstrip())
            line = piece.lstrip()
        else:
            line += piece
    lines.append(line.rstrip())
    return "\n".join(lines)


def fitted_label(ax: Axes, text: str, axis: str = "y", fontsize: float | None = None) -> str:
    """``text`` wrapped to the length of ``ax``'s ``axis`` (0.6 em a character), never cut off."""
    size = fontsize or FontProperties(size=rcParams["axes.labelsize"]).get_size_in_points()
    box, figure = ax.get_position(), ax.figure
    inches = (
        box.height * figure.get_figheight() if axis == "y" else box.width * figure.get_figwidth()
    )
    return wrap_label(text, max(12, int(0.9 * inches * 72 / (0.6 * size))))


def catalogue_or_installed(catalogue: Catalogue | None) -> Catalogue:
    """``catalogue``, or the installed plugins' when None (a figure drawn outside a report)."""
    return catalogue if catalogue is not None else Catalogue.installed()


def is_unit_quantity(name: str, catalogue: Catalogue | None = None) -> bool:
    """Whether a column or profile is bounded in [0, 1] (see the module docstring)."""
    return (
        catalogue_or_installed(catalogue).is_unit(name)
        or name in (*BENCHMARK_COLUMNS, AVERAGE, BOUNDARY_COLUMN)
        or name.startswith("score:")
        and name.split(":")[2].split(",")[0] in _UNIT_SCORES
    )


_UNIT_SCORES = ("acc", "acc_norm", "exact_match", "mc1", "mc2")


def declared_label(column: str, catalogue: Catalogue | None = None) -> str:
    """A column's axis label: its metric's declared label, the column named when it differs."""
    known = catalogue_or_installed(catalogue)
    label = known.label(known.base_metric(column))
    return column if label == column else f"{label} ({column})"


def zoom_note(low: float, high: float) -> str:
    """``zoomed: 0.41-0.46, 5% of [0, 1]`` for an axis of a [0, 1] quantity shown zoomed in."""
    share = 100 * (high - low)
    return f"zoomed: {low:.3g}-{high:.3g}, {share:.2g}% of [0, 1]"


def unit_axis(ax: Axes, values: np.ndarray, bounds: tuple[float, float] = (0.0, 1.0)) -> None:
    """Fix a bounded quantity's y axis to its bounds; print its range when nearly flat."""
    finite = values[np.isfinite(values)]
    low, high = bounds
    pad = 0.02 * (high - low)
    ax.set_ylim(low - pad, high + pad)
    if len(finite) and np.ptp(finite) < FLAT_SPAN:
        ax.text(
            0.98, 0.04 if finite.mean() > 0.5 else 0.92,
            f"flat: {finite.min():.5g}-{finite.max():.5g}",
            transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="dimgrey",
        )  # fmt: skip


def _zoomed(ax: Axes, name: str, axis: str, catalogue: Catalogue | None) -> tuple | None:
    """The visible part of [0, 1] on ``axis`` when ``name`` is a [0, 1] quantity zoomed in."""
    if not is_unit_quantity(name, catalogue):
        return None
    low, high = sorted(ax.get_ylim() if axis == "y" else ax.get_xlim())
    return None if low <= 0.0 and high >= 1.0 else (max(low, 0.0), min(high, 1.0))


def _label_zoom(ax: Axes, name: str, axis: str, catalogue: Catalogue | None = None) -> str:
    """`` (zoomed: ...)`` for an axis label when ``name`` is a [0, 1] quantity zoomed in."""
    span = _zoomed(ax, name, axis, catalogue)
    return f" ({zoom_note(*span)})" if span else ""


def zoom_span_text(ax: Axes, names: Mapping[str, str], catalogue: Catalogue | None = None) -> str:
    """``zoomed: y-axis spans 1.2 of 100 points`` for the zoomed [0, 1] axes in ``names``."""
    spans = [(a, _zoomed(ax, names[a], a, catalogue)) for a in ("y", "x") if a in names]
    parts = [f"{a}-axis spans {100 * (s[1] - s[0]):.2g} of 100 points" for a, s in spans if s]
    return panel_title("zoomed: " + "; ".join(parts), 48) if parts else ""


def short_name(model: str) -> str:
    """The last part of a model's name or path (``fam/tiny`` -> ``tiny``)."""
    return model.rstrip("/").split("/")[-1]


def integer_layer_axis(ax: Axes, first: int, last: int, axis: str = "x") -> None:
    """Integer ticks between ``first`` and ``last`` (all of them up to 12 layers)."""
    target = ax.xaxis if axis == "x" else ax.yaxis
    if last - first <= 11:
        target.set_major_locator(FixedLocator(list(range(first, last + 1))))
    else:
        target.set_major_locator(MaxNLocator(nbins=10, integer=True, min_n_ticks=3))
    lim = (first - 0.5, last + 0.5)
    if axis == "x":
        ax.set_xlim(*lim)
    else:
        ax.set_ylim(*(lim[::-1] if ax.yaxis_inverted() else lim))


def _fit_text(fit: Mapping | None, n: int) -> str:
    if fit is None:
        return f"n = {n} models"
    reason = str(fit.get("reason") or "")
    if reason or not np.isfinite(fit.get("slope", math.nan)):
        return f"no fit: {reason.split(':')[0] or 'not fitted'}"
    return (
        f"OLS R^2 = {fit['r2']:.3f}, p (HC3) = {fit['p_hc3']:.2g}, "
        f"Holm p = {fit.get('p_holm', math.nan):.2g}"
        f"{'' if significant(fit) else ' (n.s.)'}, n = {int(fit['n'])} models; "
        f"Spearman rho = {fit['spearman_rho']:.2f}"
    )


def _point_labels(data: pd.DataFrame) -> tuple[list[str], list[str]]:
    """Point labels (the step for checkpoints of a family, else the model) and colour groups."""
    names = [short_name(str(m)) for m in data["model"]]
    if "revision" not in data:
        return names, ["models"] * len(data)
    steps = data["revision"].map(parse_step)
    if steps.notna().all() and len(data):
        return [f"{int(s)}" for s in steps], names
    revisions = data["revision"]
    labels = [n if r == "main" else f"{n}@{r}" for n, r in zip(names, revisions, strict=True)]
    return labels, ["models"] * len(data)


def metric_vs_score(
    board: pd.DataFrame,
    metric: str,
    target: str,
    fit: Mapping | None = None,
    tasks: str = "",
    catalogue: Catalogue | None = None,
) -> Axes:
    """Scatter of ``metric`` (x) against ``target`` (y), a point per row (coupling paper, Fig. 1a).

    The OLS line and p-values come from ``fit``, a ``correlations.csv`` row,
    only when it was fitted (dashed grey when not significant); an influential
    model is ringed and named; a metric spanning more than two decades gets a
    log axis; checkpoints are labelled by step and coloured by model. ``tasks``
    (the tasks the metric averages) goes in the title.
    """
    ax = new_grid(1, 1)[0, 0]
    cols = [c for c in ("model", "revision", metric, target) if c in board.columns]
    data = board[cols].dropna(subset=[metric, target])
    labels, groups = _point_labels(data)
    for group in dict.fromkeys(groups):
        pick = [g == group for g in groups]
        ax.scatter(data[metric][pick], data[target][pick], zorder=3, s=22, label=group)
    if set(groups) - {"models"}:
        _legend(ax, "model (labels: step)")
    log_x = spans_decades(data[metric].to_numpy())
    if log_x:
        ax.set_xscale("log")
    fitted = fit is not None and not fit.get("reason") and np.isfinite(fit.get("slope", math.nan))
    if fitted and len(data):
        lo, hi = data[metric].min(), data[metric].max()
        xs = np.geomspace(lo, hi, 100) if log_x else np.linspace(lo, hi, 100)
        ys = fit["intercept"] + fit["slope"] * xs
        if significant(fit):
            ax.plot(xs, ys, color="tab:red", label="OLS")
        else:  # drawn as what it is: a line that the data do not support
            label = f"OLS, n.s. (Holm p >= {ALPHA:g})"
            ax.plot(xs, ys, color="grey", linestyle="--", linewidth=1, label=label)
            _legend(ax)
        if fit.get("influential"):
            _ring_influential(ax, data, metric, target, fit)
    task_note = f"; geometry over {tasks}" if tasks else ""
    title = f"{metric} vs {target}{task_note}\n{_fit_text(fit, len(data))}"
    if not log_x:
        ax.ticklabel_format(axis="x", useOffset=False)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_title(_scatter_text(ax, metric, target, title, catalogue), fontsize=8, wrap=True)
    place_labels(ax, data[metric].to_numpy(float), data[target].to_numpy(float), labels)
    return ax


def _scatter_text(
    ax: Axes, x: str, y: str, title: str, catalogue: Catalogue | None, size: float | None = None
) -> str:
    """Label a scatter panel's axes (zoom or log scale stated); ``title`` with its zoom line."""
    log_x = ax.get_xscale() == "log"
    x_text = " (log scale)" if log_x else _label_zoom(ax, x, "x", catalogue)
    font = {"fontsize": size} if size else {}
    ax.set_xlabel(fitted_label(ax, declared_label(x, catalogue) + x_text, "x", size), **font)
    y_text = declared_label(y, catalogue) + _label_zoom(ax, y, "y", catalogue)
    ax.set_ylabel(fitted_label(ax, y_text, "y", size), **font)
    zoomed = zoom_span_text(ax, {"y": y} if log_x else {"x": x, "y": y}, catalogue)
    return title + (f"\n{zoomed}" if zoomed else "")


def _ring_influential(ax: Axes, data: pd.DataFrame, metric: str, target: str, fit: Mapping):
    name = str(fit.get("cooks_d_model", ""))
    model, _, rev = name.partition("@")
    hit = data[data["model"].astype(str) == model]
    if rev and "revision" in hit:
        hit = hit[hit["revision"].astype(str) == rev]
    if hit.empty:
        return
    ax.scatter(
        hit[metric], hit[target], s=160, facecolors="none", edgecolors="tab:red", zorder=4,
        label=f"influential: Cook's D = {fit['cooks_d_max']:.3g}; R^2 without = "
        f"{fit.get('r2_without', math.nan):.2f}",
    )  # fmt: skip
    _legend(ax)


def _legend(ax: Axes, title: str = "") -> None:
    """(Re)draw the legend of ``ax`` with every labelled artist, keeping its title."""
    old = ax.get_legend()
    title = title or (old.get_title().get_text() if old is not None else "")
    ax.legend(fontsize=7, title=title or None, title_fontsize=7)


def layer_profile(
    values: Sequence[float],
    name: str,
    boundary: float | None = None,
    ax: Axes | None = None,
    stderr: Sequence[float] | None = None,
    catalogue: Catalogue | None = None,
) -> Axes:
    """One per-layer profile, with the thought/fixation boundary layer as a dashed line.

    The catalogue says how it is drawn: a profile over blocks has x = 1..L,
    one over states x = 0..L (0 = embeddings); a profile bounded to [0, 1]
    is on the fixed [0, 1] axis (`unit_axis`); its title is its label.
    """
    ax = ax if ax is not None else new_grid(1, 1)[0, 0]
    spec = catalogue_or_installed(catalogue).profile(name)
    y = _floats(values)
    first = spec.first_layer
    layers = np.arange(len(y)) + first
    ax.plot(layers, y, marker="o", markersize=3)
    if stderr is not None:
        err = _floats(stderr)
        ax.fill_between(layers, y - err, y + err, alpha=0.2)
    if boundary is not None and math.isfinite(boundary):
        ax.axvline(boundary, color="tab:red", linestyle="--", label="thought/fixation")
        ax.legend(fontsize=7)
    integer_layer_axis(ax, first, first + len(y) - 1)
    ax.ticklabel_format(axis="y", useOffset=False)
    if spec.bounds is not None:  # any declared interval
        unit_axis(ax, y, bounds=spec.bounds)
    ax.set_xlabel("block l" if first else "state l (0 = embeddings)")
    ax.set_title(panel_title(spec.label), fontsize=9)
    return ax


def drawable(profile: Mapping | None) -> np.ndarray:
    """A geometry file's profile mean as floats (None as NaN); empty if absent or not per layer."""
    values = (profile or {}).get("mean") or []
    if any(isinstance(v, list) for v in values):
        return np.empty(0)  # per-layer vectors (singular values): in the files only
    return _floats(values)


def _floats(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([math.nan if v is None else v for v in values], dtype=float)


def shown_profiles(
    profiles: Mapping[str, Mapping], n_layers: int, catalogue: Catalogue | None = None
) -> tuple[list[str], str]:
    """Profiles to draw (catalogue order, then unknown ones) and a note on any left out.

    A profile declared ``plot=False`` is in the files only; one declared with
    ``min_blocks`` is left out of a shallower model, and the note says so.
    """
    catalogue = catalogue_or_installed(catalogue)
    order = [*catalogue.plotted_profiles()]
    order += [n for n in profiles if n not in catalogue.profiles]
    names, notes = [], []
    for name in order:
        values = drawable(profiles.get(name))
        if not len(values) or not np.isfinite(values).any():
            continue
        spec = catalogue.profile(name)
        if n_layers < spec.min_blocks:
            notes.append(
                f"{spec.label} omitted: {n_layers} blocks < its minimum of {spec.min_blocks}"
            )
            continue
        names.append(name)
    return names, "; ".join(notes)


def profiles_figure(
    profiles: Mapping[str, Mapping],
    n_layers: int,
    title: str,
    catalogue: Catalogue | None = None,
) -> Figure | None:
    """One model's per-layer profiles (`shown_profiles`), four panels to a row, under ``title``.

    None when no profile was measured.
    """
    catalogue = catalogue_or_installed(catalogue)
    names, note = shown_profiles(profiles, n_layers, catalogue)
    if not names:
        return None
    axes = new_panels(len(names), cell=(3.2, 3.4))
    profile = boundary_profile(profiles, catalogue.boundary_profiles())
    boundary = boundary_layer(profile) if profile is not None else math.nan
    for ax, name in zip(axes, names, strict=True):
        prof = profiles[name]
        layer_profile(
            prof["mean"], name, boundary, ax=ax, stderr=prof.get("stderr"), catalogue=catalogue
        )
    figure = axes[0].figure
    figure.suptitle(title + (f"\n{note}" if note else ""), fontsize=9)
    return figure


def coupling_figure(matrix: Sequence[Sequence[float]], k: int | None, title: str) -> Figure:
    """One model's L x L coupling matrix as a heatmap (rows l, columns l', both 1..L).

    ``title`` (model and task) goes above. The diagonal (not part of the
    coupling score) is grey; the colours span the off-diagonal values, and
    the colour bar says how far that zooms.
    """
    ax = new_grid(1, 1, (5.5, 4.4))[0, 0]
    data = np.asarray(matrix, dtype=float)
    n = len(data)
    off = np.where(np.eye(n, dtype=bool), np.nan, data)
    finite = off[np.isfinite(off)]
    vmin, vmax = (finite.min(), finite.max()) if len(finite) else (0.0, 1.0)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5e-3, vmax + 0.5e-3
    extent = (0.5, n + 0.5, n + 0.5, 0.5)
    cmap = colormaps["viridis"].with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(off), cmap=cmap, vmin=vmin, vmax=vmax, extent=extent)
    bar = ax.figure.colorbar(image, ax=ax, shrink=0.85)
    zoom = zoom_note(vmin, vmax) if 0.0 <= vmin and vmax <= 1.0 else "outside [0, 1]"
    bar.set_label(f"c_K off-diagonal ({zoom})\ndiagonal grey", fontsize=8)
    integer_layer_axis(ax, 1, n, "x")
    integer_layer_axis(ax, 1, n, "y")
    ax.set_xlabel("block l'")
    ax.set_ylabel("block l")
    ax.set_title(f"coupling c_K(l, l'), K = {k} (directed)", fontsize=9)
    ax.figure.suptitle(title, fontsize=9)
    return ax.figure


def training_dynamics(
    board: pd.DataFrame,
    metrics: Sequence[str],
    target: str,
    catalogue: Catalogue | None = None,
) -> np.ndarray:
    """Score and geometry over training, and geometry against score, per model.

    Top row: ``target`` and each of ``metrics`` against the training step
    (symmetric-log axis, so step 0 shows). Bottom row: the legend, then each
    metric against ``target``, a model's checkpoints joined in step order and
    its last one ringed (the papers' emergence plots). A metric spanning more
    than two decades gets a log axis. No fit and no p-value: the checkpoints
    of one run are not independent samples.
    Returns the ``2 x (len(metrics) + 1)`` axes (the bottom-left one holds the legend).
    """
    columns = [target, *metrics]
    data = board.assign(_step=board["revision"].map(parse_step)).dropna(subset=["_step"])
    axes = new_grid(2, len(columns), (4.0, 3.4))
    for ax, column in zip(axes[0], columns, strict=True):
        for model, group in data.dropna(subset=[column]).groupby("model"):
            group = group.sort_values("_step")
            ax.plot(group["_step"], group[column], marker="o", ms=3, label=short_name(str(model)))
        ax.set_xscale("symlog", linthresh=1.0)
        if spans_decades(data[column].to_numpy(float)):
            ax.set_yscale("log")
        ax.set_xlabel("training step")
        zoom_y = _label_zoom(ax, column, "y", catalogue).strip(" ()")
        ax.set_ylabel(fitted_label(ax, zoom_y, "y", 7), fontsize=7)
        zoomed = zoom_span_text(ax, {"y": column}, catalogue)
        heading = fitted_label(ax, f"{column} over training", "x", 9)
        ax.set_title(heading + (f"\n{zoomed}" if zoomed else ""), fontsize=9)
    handles, names = axes[0][0].get_legend_handles_labels()
    legend_ax = axes[1][0]
    legend_ax.set_axis_off()
    legend_ax.legend(handles, names, title="model", loc="center", fontsize=8, title_fontsize=8)
    for ax, column in zip(axes[1][1:], metrics, strict=True):
        for model, group in data.dropna(subset=[column, target]).groupby("model"):
            group = group.sort_values("_step")
            line = ax.plot(
                group[column], group[target], marker="o", ms=3, label=short_name(str(model))
            )
            last = group.iloc[-1]
            ax.scatter(
                [last[column]], [last[target]], s=60, facecolors="none",
                edgecolors=line[0].get_color(), zorder=3,
            )  # fmt: skip
        if spans_decades(data[column].to_numpy(float)):
            ax.set_xscale("log")
        heading = fitted_label(ax, f"{target} vs {column}", "x", 9) + "\n(ring: last step)"
        ax.set_title(_scatter_text(ax, column, target, heading, catalogue, 8), fontsize=9)
    figure = axes[0][0].figure
    note = (
        "Checkpoints of one training run, per run: not independent samples, so no fit "
        "or p-value (the across-model statistics take one checkpoint per model)"
    )
    figure.suptitle(panel_title(note, int(figure.get_figwidth() * 12)), fontsize=9)
    return axes
