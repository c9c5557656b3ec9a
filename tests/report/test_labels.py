"""Point labels (`report.labels.place_labels`): nothing drawn on top of anything.

Checked on drawn figures, in display space: every label placed lies inside
its axes and clear of the other labels and of every marker; a label with no
room is left out and counted; the count's note sits in a corner clear of the
markers, also when the points crowd the default corner.
"""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from lm_coupling.report.labels import MARKER_PX, place_labels  # noqa: E402


def _figure(xs, ys, size=(4.0, 3.0)):
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    ax.plot(xs, ys, "o", markersize=4)
    return fig, ax


def _marker_boxes(ax, xs, ys) -> list[Bbox]:
    points = ax.transData.transform(np.column_stack([xs, ys]))
    return [Bbox.from_bounds(x - MARKER_PX, y - MARKER_PX, 2 * MARKER_PX, 2 * MARKER_PX)
            for x, y in points]  # fmt: skip


def _note(ax):
    notes = [t for t in ax.texts if "left out for space" in t.get_text()]
    assert len(notes) <= 1
    return notes[0] if notes else None


@pytest.mark.parametrize("n_points", [5, 40])
def test_labels_stay_inside_the_axes_and_clear_of_each_other_and_of_every_marker(n_points):
    rng = np.random.default_rng(n_points)
    xs, ys = rng.uniform(0, 1, n_points), rng.uniform(0, 1, n_points)
    fig, ax = _figure(xs, ys)
    texts = [f"model-{i}" for i in range(n_points)]
    placed = place_labels(ax, xs, ys, texts)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    boxes = [note.get_window_extent(renderer) for note in placed]
    markers = _marker_boxes(ax, xs, ys)
    for box in boxes:
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1
        assert frame.y0 <= box.y0 and box.y1 <= frame.y1
        assert not any(box.overlaps(marker) for marker in markers)
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b)
    note = _note(ax)
    left_out = n_points - len(placed)
    if left_out:
        assert note is not None and note.get_text().startswith(f"{left_out} label(s)")
    else:
        assert note is None
    assert {note.get_text() for note in placed} <= set(texts)
    plt.close(fig)


def test_the_left_out_note_avoids_a_corner_the_points_crowd():
    # Many points packed into the bottom-right corner, where the note goes by default.
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.uniform(0.8, 1.0, 60), [0.0, 0.5]])
    ys = np.concatenate([rng.uniform(0.0, 0.2, 60), [1.0, 0.5]])
    fig, ax = _figure(xs, ys, size=(3.0, 2.2))
    ax.set_xlim(0, 1.0)
    ax.set_ylim(0, 1.0)
    place_labels(ax, xs, ys, [f"a-rather-long-name-{i}" for i in range(len(xs))])
    fig.canvas.draw()
    note = _note(ax)
    assert note is not None  # 60 crowded points cannot all be labelled
    box = note.get_window_extent(fig.canvas.get_renderer())
    assert not any(box.overlaps(marker) for marker in _marker_boxes(ax, xs, ys))
    plt.close(fig)
