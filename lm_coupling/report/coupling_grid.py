"""Every model's coupling matrix on one figure (``coupling_matrices.png``).

Drawn instead of the per-model ``coupling_<model>.png`` figures when a
report has too many model rows for those (`lm_coupling.report.build`,
``--per-model-figures``): one small heatmap per model, blocks 1..L on both
axes (rows l, columns l', directed as in `figures.coupling_heatmap`), the
diagonal grey, and **one colour scale for all**, spanning the off-diagonal
values of every model, so that the panels compare; the colour bar says how
far that scale zooms into [0, 1] (`figures.zoom_note`). A fixed grid (no
constrained layout) and no tick labels keep it at about a second of CPU for
fifty models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lm_coupling.report.figures import DPI, zoom_note

COLUMNS = 10
CELL = 1.25  # inches per panel


def coupling_grid(entries: Sequence[Mapping], task: str) -> Figure | None:
    """One heatmap per entry (``label``, ``matrix``, ``k``) on a shared colour scale.

    Args:
        entries: one mapping per model: ``label`` (the panel's title),
            ``matrix`` (L x L coupling, the geometry file's
            ``matrices.coupling.mean``) and ``k`` (its K).
        task: the task the matrices were measured on (for the title).

    Returns:
        The figure, or None when no entry has a matrix.
    """
    mats = [np.asarray(e["matrix"], dtype=float) for e in entries]
    keep = [i for i, m in enumerate(mats) if m.ndim == 2 and m.size]
    if not keep:
        return None
    offs = [np.where(np.eye(len(mats[i]), dtype=bool), np.nan, mats[i]) for i in keep]
    finite = np.concatenate([o[np.isfinite(o)] for o in offs])
    vmin, vmax = (float(finite.min()), float(finite.max())) if len(finite) else (0.0, 1.0)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5e-3, vmax + 0.5e-3
    ncols = min(COLUMNS, len(keep))
    nrows = math.ceil(len(keep) / ncols)
    width, height = CELL * ncols + 1.2, CELL * nrows + 0.9
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    top, bottom = 1 - 0.75 / height, 0.15 / height
    grid = fig.add_gridspec(
        nrows, ncols, left=0.1 / width, right=1 - 1.1 / width, top=top, bottom=bottom,
        wspace=0.15, hspace=0.35,
    )  # fmt: skip
    cmap = colormaps["viridis"].with_extremes(bad="lightgrey")
    image = None
    for slot, (i, off) in enumerate(zip(keep, offs, strict=True)):
        ax = fig.add_subplot(grid[slot // ncols, slot % ncols])
        n = len(off)
        image = ax.imshow(
            np.ma.masked_invalid(off), cmap=cmap, vmin=vmin, vmax=vmax,
            extent=(0.5, n + 0.5, n + 0.5, 0.5), interpolation="nearest",
        )  # fmt: skip
        ax.set_xticks([])
        ax.set_yticks([])
        k = entries[i].get("k")
        ax.set_title(f"{entries[i]['label']}\nL = {n}, K = {k}", fontsize=6, pad=2)
    bar_ax = fig.add_axes((1 - 0.95 / width, bottom, 0.18 / width, top - bottom))
    bar = fig.colorbar(image, cax=bar_ax)
    zoom = zoom_note(vmin, vmax) if 0.0 <= vmin and vmax <= 1.0 else "outside [0, 1]"
    bar.set_label(f"c_K off-diagonal, one scale for all ({zoom}); diagonal grey", fontsize=7)
    bar.ax.tick_params(labelsize=6)
    fig.suptitle(
        f"Coupling c_K(l, l') of every model, task {task}: rows l, columns l' (blocks 1..L, "
        "directed)",
        fontsize=9,
        y=1 - 0.2 / height,
    )
    return fig
