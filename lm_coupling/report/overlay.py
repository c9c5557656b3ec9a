"""Per-layer profiles of several models or checkpoints on one axis per quantity.

`profiles_overlay` draws, for one task, every model's norm, windowed LSS,
logit-lens entropy and TV-to-target profiles (those measured) in one panel
each, one line per model. Models of different depth are put on one axis by
relative depth: state l of a model with L blocks is drawn at ``l / L``
(windowed LSS, one value per block l = 1..L, at ``l / L`` too). Entropy and
TV are on the fixed [0, 1] axis (`lm_coupling.report.figures.unit_axis`);
norms spanning more than two decades across models get a log axis. When the
models are checkpoints of one training run (revisions naming steps), lines
are coloured by step on a sequential colour map, early light and late dark,
so that the order of training reads from the colours; otherwise each model
gets its own colour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from lm_coupling.report.benchmarks import parse_step
from lm_coupling.report.figures import (
    LSS_WINDOW,
    PROFILE_LABELS,
    UNIT_PROFILES,
    new_axes,
    unit_axis,
)
from lm_coupling.report.stats import spans_decades

OVERLAY_PROFILES = ("norm", "windowed_lss", "logit_lens_entropy", "tv_to_target")
MAX_LEGEND = 16


def _name(identity: Sequence[str]) -> str:
    model, revision = str(identity[0]), str(identity[1])
    return model if revision == "main" else f"{model}@{revision}"


def _mean(profile: Mapping[str, Any] | None) -> np.ndarray:
    values = (profile or {}).get("mean") or []
    if any(isinstance(v, list) for v in values):
        return np.empty(0)
    return np.asarray([math.nan if v is None else v for v in values], dtype=float)


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


def overlay_names(entries: list[dict[str, Any]]) -> list[str]:
    """The profiles drawn: those measured on at least two models (windowed LSS: L >= 11)."""
    names = []
    for name in OVERLAY_PROFILES:
        count = 0
        for entry in entries:
            values = _mean((entry.get("profiles") or {}).get(name))
            deep = name != "windowed_lss" or entry["n_layers"] >= LSS_WINDOW
            count += bool(len(values) and np.isfinite(values).any() and deep)
        if count >= 2:
            names.append(name)
    return names


def profiles_overlay(entries: list[dict[str, Any]], task: str) -> Figure | None:
    """One panel per profile, one line per model, x = relative depth l / L.

    Args:
        entries: one per model: ``identity`` (model, revision, dtype),
            ``n_layers`` and ``profiles`` (a geometry file's profiles for ``task``).
        task: the task the profiles were measured on (for the title).

    Returns:
        The figure, or None when fewer than two models have a common profile.
    """
    entries = sorted(
        entries, key=lambda e: (str(e["identity"][0]), parse_step(str(e["identity"][1])) or 0)
    )
    names = overlay_names(entries)
    if not names:
        return None
    axes = new_axes(len(names), figsize=(3.3 * len(names), 3.9))
    colours, legend_title = _colours(entries)
    handles: dict[str, Any] = {}
    for ax, name in zip(axes, names, strict=True):
        shown = []
        for entry, colour in zip(entries, colours, strict=True):
            values = _mean((entry.get("profiles") or {}).get(name))
            n_layers = entry["n_layers"] or max(len(values) - (name != "windowed_lss"), 1)
            if not len(values) or (name == "windowed_lss" and n_layers < LSS_WINDOW):
                continue
            first = 1 if name == "windowed_lss" else 0
            depth = (np.arange(len(values)) + first) / n_layers
            (line,) = ax.plot(depth, values, marker="o", ms=2.5, lw=1.2, color=colour)
            handles.setdefault(_name(entry["identity"]), line)
            shown.append(values)
        joined = np.concatenate(shown) if shown else np.empty(0)
        if name in UNIT_PROFILES:
            unit_axis(ax, joined)
        elif name == "norm" and spans_decades(joined[np.isfinite(joined) & (joined > 0)]):
            ax.set_yscale("log")
        ax.set_xlim(-0.03, 1.03)
        ax.set_xlabel("relative depth l / L")
        ax.set_title(f"{PROFILE_LABELS.get(name, name)}\n({len(shown)} models)", fontsize=9)
    figure = axes[0].figure
    _legend(figure, handles, legend_title)
    note = _lss_note(names, entries)
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


def _lss_note(names: list[str], entries: list[dict[str, Any]]) -> str:
    """A title line when windowed LSS is left out, or drawn for only the deep models."""
    measured = any("windowed_lss" in (e.get("profiles") or {}) for e in entries)
    if "windowed_lss" not in names and measured:
        return f"\nwindowed LSS omitted: fewer than two models have L >= {LSS_WINDOW} blocks"
    if "windowed_lss" in names and any(e["n_layers"] < LSS_WINDOW for e in entries):
        return f"\nwindowed LSS: only the models with L >= {LSS_WINDOW} blocks (its window)"
    return ""
