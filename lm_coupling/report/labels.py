"""Point labels that never overlap each other, the points, or the axes' edge.

Greedy placement in display space after one layout pass: each label takes the
first of a ring of offsets around its point whose box stays inside the axes
and clear of the boxes already taken (kept in a grid of cells, so n labels
cost O(n)). A label with no free place is left out, and a note in a free
corner counts them. Labels take no part in the layout (``in_layout=False``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.transforms import Bbox

MARKER_PX = 4.0
_DIRECTIONS = [(1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1), (0, -1), (1, 0), (-1, 0)]


def _candidates(point: np.ndarray, width: float, height: float) -> list[Bbox]:
    boxes = []
    for radius in (4.0, 10.0, 18.0, 28.0):
        for dx, dy in _DIRECTIONS:
            x0 = point[0] + dx * radius - (width if dx < 0 else width / 2 if dx == 0 else 0)
            y0 = point[1] + dy * radius - (height if dy < 0 else height / 2 if dy == 0 else 0)
            boxes.append(Bbox.from_bounds(x0, y0, width, height))
    return boxes


class _BoxGrid:
    """Boxes bucketed by the grid cells they cover, for overlap tests near a box only."""

    def __init__(self, cell: float):
        self.cell = max(cell, 1.0)
        self.cells: dict[tuple[int, int], list[Bbox]] = {}

    def _keys(self, box: Bbox):
        c = self.cell
        for i in range(int(box.x0 // c), int(box.x1 // c) + 1):
            for j in range(int(box.y0 // c), int(box.y1 // c) + 1):
                yield i, j

    def add(self, box: Bbox) -> None:
        """Take ``box``."""
        for key in self._keys(box):
            self.cells.setdefault(key, []).append(box)

    def overlaps(self, box: Bbox) -> bool:
        """Whether ``box`` overlaps a box taken."""
        return any(
            box.overlaps(other) for key in self._keys(box) for other in self.cells.get(key, ())
        )


def place_labels(
    ax: Axes, xs: Sequence[float], ys: Sequence[float], texts: Sequence[str], fontsize: float = 7
) -> list:
    """Annotate the points ``(xs, ys)`` (data coordinates) with ``texts`` without overlap.

    Returns the annotations placed.
    """
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    points = ax.transData.transform(np.column_stack([xs, ys])) if len(xs) else np.empty((0, 2))
    frame = ax.get_window_extent(renderer)
    probe = ax.text(0, 0, "", fontsize=fontsize)
    sizes = []
    for text in texts:
        probe.set_text(text)
        extent = probe.get_window_extent(renderer)
        sizes.append((extent.width + 2, extent.height + 2))
    probe.remove()
    taken = _BoxGrid(max((h for _, h in sizes), default=10.0) * 4)
    for x, y in points:
        taken.add(Bbox.from_bounds(x - MARKER_PX, y - MARKER_PX, 2 * MARKER_PX, 2 * MARKER_PX))
    if ax.get_legend() is not None:
        taken.add(ax.get_legend().get_window_extent(renderer))
    for note in ax.texts:  # notes already on the panel
        taken.add(note.get_window_extent(renderer))
    placed, skipped = [], 0
    order = np.argsort(points[:, 0]) if len(points) else []
    for i in order:
        box = next(
            (
                b
                for b in _candidates(points[i], *sizes[i])
                if frame.contains(b.x0, b.y0)
                and frame.contains(b.x1, b.y1)
                and not taken.overlaps(b)
            ),
            None,
        )
        if box is None:
            skipped += 1
            continue
        taken.add(box)
        offset = (box.x0 + 1 - points[i][0], box.y0 + 1 - points[i][1])
        note = ax.annotate(
            texts[i],
            (xs[i], ys[i]),
            xytext=(offset[0] * 72 / fig.dpi, offset[1] * 72 / fig.dpi),
            textcoords="offset points",
            ha="left",
            va="bottom",
            fontsize=fontsize,
            alpha=0.85,
        )
        note.set_in_layout(False)
        placed.append(note)
    if skipped:
        _corner_note(ax, renderer, taken, f"{skipped} label(s) left out for space")
    return placed


_CORNERS = [(0.99, 0.01, "right", "bottom"), (0.99, 0.99, "right", "top"),
            (0.01, 0.01, "left", "bottom"), (0.01, 0.99, "left", "top")]  # fmt: skip


def _corner_note(ax: Axes, renderer, taken: _BoxGrid, text: str):
    """A small grey note in the first corner of the axes clear of every marker and label.

    Bottom right when every corner is taken.
    """
    note = ax.text(0, 0, text, transform=ax.transAxes, fontsize=6, color="grey")
    for x, y, ha, va in [*_CORNERS, _CORNERS[0]]:
        note.set_position((x, y))
        note.set_horizontalalignment(ha)
        note.set_verticalalignment(va)
        if not taken.overlaps(note.get_window_extent(renderer)):
            break
    return note
