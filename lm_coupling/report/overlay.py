"""Per-layer profiles of several models or checkpoints on one axis per quantity.

`profiles_overlay` draws, for one task, every per-layer profile of the
catalogue (`lm_coupling.catalogue.Catalogue`) measured on at least two
models, built-in or third-party alike, in one panel each, one line per
model. Models of different depth are put on one axis by relative depth:
state l of a model with L blocks is drawn at ``l / L``, and so is block l
of a profile over blocks (l = 1..L). A profile declared bounded to [0, 1]
is on the fixed [0, 1] axis (`lm_coupling.report.figures.unit_axis`); an
unbounded one spanning more than two decades across models gets a log axis. When the
models are checkpoints of one training run (revisions naming steps), lines
are coloured by step on a sequential colour map, early light and late dark,
so that the order of training reads from the colours; otherwise each model
gets its own colour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from lm_coupling.catalogue import Catalogue
from lm_coupling.report.benchmarks import parse_step
from lm_coupling.report.figures import (
    catalogue_or_installed,
    drawable,
    new_panels,
    panel_title,
    unit_axis,
)
from lm_coupling.report.stats import spans_decades

MAX_LEGEND = 16


def _name(identity: Sequence[str]) -> str:
    model, revision = str(identity[0]), str(identity[1])
    return model if revision == "main" else f"{model}@{revision}"


def _colours(entries: list[dict[str, Any]]) -> tuple[list, str]:
    """One colour per entry and the legend title (by step for checkpoints of one model)."""
    steps = [parse_step(str(e["identity"][1])) for e in entries]
    models = {str(e["identity"][0]) for e in entries}
    if len(models) == 1 and all(s is not None for s in steps) and len(entries) > 1:
        order = np.argsort(np.argsort(steps))
        cmap = colormaps["viridis_r"]
        shades = [cmap(0.15 + 0.75 * i / max(len(entries) - 1, 1)) for i in order]
        return shades, f"{next(iter(models))}: step (light = early)"
    cycle = colormaps["tab10" if len(entries) <= 10 else "tab20"]
    return [cycle(i % cycle.N) for i in range(len(entries))], "model"


def _deep_enough(entry: dict[str, Any], min_blocks: int) -> bool:
    return not min_blocks or (entry["n_layers"] or 0) >= min_blocks


def overlay_names(entries: list[dict[str, Any]], catalogue: Catalogue | None = None) -> list[str]:
    """The profiles drawn: those measured on at least two models deep enough for them.

    In catalogue order, then any profile of the geometry files the catalogue
    does not describe (drawn as a profile over states).
    """
    catalogue = catalogue_or_installed(catalogue)
    order = [*catalogue.plotted_profiles()]
    for entry in entries:
        order += [n for n in entry.get("profiles") or {} if n not in catalogue.profiles]
    names = []
    for name in dict.fromkeys(order):
        min_blocks = catalogue.profile(name).min_blocks
        count = 0
        for entry in entries:
            values = drawable((entry.get("profiles") or {}).get(name))
            measured = bool(len(values) and np.isfinite(values).any())
            count += measured and _deep_enough(entry, min_blocks)
        if count >= 2:
            names.append(name)
    return names


def profiles_overlay(
    entries: list[dict[str, Any]], task: str, catalogue: Catalogue | None = None
) -> Figure | None:
    """One panel per profile, one line per model, x = relative depth l / L.

    Args:
        entries: one per model: ``identity`` (model, revision, dtype),
            ``n_layers`` and ``profiles`` (a geometry file's profiles for ``task``).
        task: the task the profiles were measured on (for the title).
        catalogue: the runs' catalogue (labels, axes, bounds; default: the
            installed plugins').

    Returns:
        The figure, or None when fewer than two models have a common profile.
    """
    catalogue = catalogue_or_installed(catalogue)
    entries = sorted(
        entries, key=lambda e: (str(e["identity"][0]), parse_step(str(e["identity"][1])) or 0)
    )
    names = overlay_names(entries, catalogue)
    if not names:
        return None
    axes = new_panels(len(names), cell=(3.3, 3.9))
    colours, legend_title = _colours(entries)
    handles: dict[str, Any] = {}
    for ax, name in zip(axes, names, strict=True):
        spec = catalogue.profile(name)
        first = spec.first_layer
        shown = []
        for entry, colour in zip(entries, colours, strict=True):
            values = drawable((entry.get("profiles") or {}).get(name))
            if not len(values) or not _deep_enough(entry, spec.min_blocks):
                continue
            n_layers = entry["n_layers"] or max(len(values) - 1 + first, 1)
            depth = (np.arange(len(values)) + first) / n_layers
            (line,) = ax.plot(depth, values, marker="o", ms=2.5, lw=1.2, color=colour)
            handles.setdefault(_name(entry["identity"]), line)
            shown.append(values)
        joined = np.concatenate(shown) if shown else np.empty(0)
        if spec.bounds is not None:  # any declared interval
            unit_axis(ax, joined, bounds=spec.bounds)
        elif spans_decades(joined[np.isfinite(joined) & (joined > 0)]):
            ax.set_yscale("log")
        ax.set_xlim(-0.03, 1.03)
        ax.set_xlabel("relative depth l / L" + (" (blocks l = 1..L)" if first else ""))
        ax.set_title(f"{panel_title(spec.label)}\n({len(shown)} models)", fontsize=9)
    figure = axes[0].figure
    _legend(figure, handles, legend_title)
    note = _shallow_note(names, entries, catalogue)
    figure.suptitle(f"per-layer profiles of {len(entries)} models, task {task}{note}", fontsize=9)
    return figure


def _legend(figure: Figure, handles: dict[str, Any], title: str) -> None:
    """One legend below the panels; past `MAX_LEGEND` entries, the first and last half."""
    labels = list(handles)
    if len(labels) > MAX_LEGEND:  # keep the first and last: the colour order says the rest
        keep = labels[: MAX_LEGEND // 2] + labels[-MAX_LEGEND // 2 :]
        handles = {k: handles[k] for k in keep}
        title += f"; {len(labels) - len(keep)} more not listed"
    figure.legend(
        list(handles.values()),
        list(handles),
        loc="outside lower center",
        ncol=min(4, len(handles)),
        fontsize=7,
        title=title,
        title_fontsize=7,
    )


def _shallow_note(names: list[str], entries: list[dict[str, Any]], catalogue: Catalogue) -> str:
    """Title lines for profiles left out, or drawn for only the models deep enough for them."""
    lines = []
    for name in catalogue.plotted_profiles():
        spec = catalogue.profile(name)
        if not spec.min_blocks:
            continue
        measured = any(name in (e.get("profiles") or {}) for e in entries)
        shallow = [e for e in entries if not _deep_enough(e, spec.min_blocks)]
        if name not in names and measured:
            lines.append(
                f"{spec.label} omitted: fewer than two models have L >= {spec.min_blocks} blocks"
            )
        elif name in names and shallow:
            lines.append(f"{spec.label}: only the models with L >= {spec.min_blocks} blocks")
    return "".join(f"\n{line}" for line in lines)
