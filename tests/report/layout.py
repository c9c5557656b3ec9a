"""Layout checks on a drawn figure: text inside the canvas, no two texts overlapping."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.text import Text


def visible_texts(fig: Figure) -> list[Text]:
    """Every non-empty visible text of a figure (titles, labels, tick labels, annotations)."""
    fig.canvas.draw()
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):  # ticks outside the view are not drawn
            low, high = sorted(axis.get_view_interval())
            span = (high - low) * 1e-9
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not low - span <= tick.get_loc() <= high + span:
                    hidden.update((id(tick.label1), id(tick.label2)))
        if not ax.axison:  # an axes drawn without its axis lines, ticks and labels
            for axis in (ax.xaxis, ax.yaxis):
                hidden.update(map(id, axis.get_ticklabels(which="both")))
                hidden.update((id(axis.label), id(axis.get_offset_text())))
    found = []
    for text in fig.findobj(Text):
        if id(text) in hidden:
            continue
        if text.get_visible() and text.get_text().strip() and text.figure is fig:
            if text.get_alpha() == 0:
                continue
            found.append(text)
    return found


def layout_problems(fig: Figure, pad: float = 0.5) -> list[str]:
    """Texts cut off by the canvas edge and pairs of texts that overlap."""
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    boxes = []
    problems = []
    for text in visible_texts(fig):
        box = text.get_window_extent(renderer)
        if box.width == 0 or box.height == 0:
            continue
        if (
            box.x0 < canvas.x0 - pad
            or box.y0 < canvas.y0 - pad
            or box.x1 > canvas.x1 + pad
            or box.y1 > canvas.y1 + pad
        ):
            problems.append(f"cut off: {text.get_text()!r}")
        boxes.append((text.get_text(), box.shrunk(0.98, 0.9)))
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1 :]:
            if box_a.overlaps(box_b):
                problems.append(f"overlap: {a!r} / {b!r}")
    return problems
