"""Token-wise coupling heatmaps, in the spirit of the ICLR 2025 paper's token-wise figures.

One figure per model (identity) whose geometry files hold the token-wise
matrices (``--metrics tokenwise_self_coupling,...``): the self-coupling of
``J^l_{tt}`` over (block, position), then per block the context coupling with
the input token fixed and with the output token fixed, each the task's mean
over its sampled documents. Axis labels come from the geometry file's
``tokenwise`` record (blocks and positions ``n-3 .. n``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes

from lm_coupling.report.figures import new_grid

SELF = "tokenwise_self_coupling"
CONTEXT = {
    "tokenwise_context_fixed_input": "input token {fixed} fixed: J^{block}_{{{fixed}, t2}}",
    "tokenwise_context_fixed_output": "output token n fixed: J^{block}_{{t1, n}}",
}
NAMES = (SELF, *CONTEXT)


def tokenwise_matrix(geometry: Mapping[str, Any], name: str) -> np.ndarray | None:
    """The mean matrix of ``name`` from a geometry file (``matrices`` or ``profiles``)."""
    for section in ("matrices", "profiles"):
        mean = ((geometry.get(section) or {}).get(name) or {}).get("mean")
        if mean:
            return np.asarray(mean, dtype=float)
    return None


def _heatmap(ax: Axes, data: np.ndarray, ticks: Sequence[str], title: str, axis: str) -> None:
    image = ax.imshow(data, cmap="viridis", origin="upper", vmin=np.nanmin(data), vmax=1.0)
    ax.figure.colorbar(image, ax=ax, shrink=0.8)
    positions = np.arange(len(ticks))
    ax.set_xticks(positions, ticks, rotation=90, fontsize=6)
    ax.set_yticks(positions, ticks, fontsize=6)
    ax.set_xlabel(axis, fontsize=8)
    ax.set_ylabel(axis, fontsize=8)
    ax.set_title(title, fontsize=8)


def tokenwise_figure(geometry: Mapping[str, Any], title: str) -> Axes | None:
    """Heatmaps of one geometry file's token-wise matrices (None when it has none)."""
    found = {name: tokenwise_matrix(geometry, name) for name in NAMES}
    found = {name: m for name, m in found.items() if m is not None}
    if not found:
        return None
    record = geometry.get("tokenwise") or {}
    positions = list(record.get("positions") or [])
    contexts = [n for n in CONTEXT if n in found]
    n_blocks = max([len(found[n]) for n in contexts] or [0])
    if not positions:
        size = found[contexts[0]].shape[-1] if contexts else len(found[SELF])
        positions = [f"p{i}" for i in range(size)]
    blocks = list(record.get("blocks") or range(n_blocks or len(found[SELF]) // len(positions)))
    if contexts and len(blocks) != n_blocks:
        blocks = list(range(n_blocks))
    panels = (SELF in found) + len(contexts) * n_blocks
    axes = list(new_grid(1, panels, cell=(3.6, 3.3)).ravel())
    first = axes[0]
    if SELF in found:
        ticks = [f"b{b} {t}" for b in blocks for t in positions]
        _heatmap(axes.pop(0), found[SELF], ticks, "self-coupling J^l_tt vs J^l'_t't'", "(block, t)")
    for name in contexts:
        fixed = record.get("fixed_input", "n-P+1")
        free = "t2" if name.endswith("input") else "t1"
        for block, data in zip(blocks, found[name], strict=False):
            _heatmap(
                axes.pop(0), data, positions, CONTEXT[name].format(block=block, fixed=fixed), free
            )
    first.figure.suptitle(title, fontsize=9)
    return first


def with_tokenwise(geometry: Sequence[Mapping[str, Any]]) -> dict[tuple, Mapping[str, Any]]:
    """Per identity, the first geometry file (by task name) holding token-wise matrices."""
    chosen: dict[tuple, Mapping[str, Any]] = {}
    for geo in sorted(geometry, key=lambda g: str(g.get("task"))):
        if any(tokenwise_matrix(geo, name) is not None for name in NAMES):
            chosen.setdefault(tuple(geo["identity"]), geo)
    return chosen
