"""Per-document distributions that a task mean hides: two groups with the mean between them.

Where a task's documents fall in two groups far apart (SmolLM2-135M's
``prompt_entropy_min_layer``: every document's lowest state at l/L = 0.10 or
0.97, the mean 0.48 is no document's), the mean describes none of them.
`two_groups` reads the values alone; every per-document metric the run's
catalogue declares is examined. Each case is drawn as a strip of its
documents' values with the mean marked (``figures/distributions.png``) and
counted in ``summary.md``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GAP_SHARE = 0.5  # the widest step covers this share of the values' range
MIN_RELATIVE_GAP = 0.1  # ... and this share of max(|v_1|, |v_n|): 0.92 vs 0.95 is one group
MIN_DOCUMENTS = 4  # fewest documents examined
MIN_GROUP = 2  # fewest documents on each side (one far document is an outlier)
MAX_ROWS = 12  # strips drawn at most (the summary lists every case)


@dataclass(frozen=True)
class TwoGroups:
    """The two groups of a task's per-document values and the mean that falls between them."""

    mean: float
    low: tuple[float, float, int]
    """(smallest, largest, count) of the lower group."""
    high: tuple[float, float, int]
    """(smallest, largest, count) of the upper group."""


def two_groups(values: Sequence[float], gap_share: float = GAP_SHARE) -> TwoGroups | None:
    """The two groups when the mean of ``values`` falls in a gap no document fills, else None.

    Sorted values ``v_1 <= ... <= v_n`` (NaN left out), the widest step
    ``v_{i+1} - v_i`` at i; two-valued when ``n >= MIN_DOCUMENTS``, the step
    is at least ``gap_share * (v_n - v_1) > 0`` and `MIN_RELATIVE_GAP` of
    ``max(|v_1|, |v_n|)``, ``v_i < mean < v_{i+1}`` and each side holds at
    least `MIN_GROUP` documents.
    """
    kept = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if len(kept) < MIN_DOCUMENTS or kept[-1] <= kept[0]:
        return None
    steps = [b - a for a, b in zip(kept, kept[1:], strict=False)]
    i = max(range(len(steps)), key=steps.__getitem__)
    mean = sum(kept) / len(kept)
    if steps[i] < gap_share * (kept[-1] - kept[0]) or not kept[i] < mean < kept[i + 1]:
        return None
    if steps[i] < MIN_RELATIVE_GAP * max(abs(kept[0]), abs(kept[-1])):
        return None
    if min(i + 1, len(kept) - i - 1) < MIN_GROUP:
        return None
    low, high = kept[: i + 1], kept[i + 1 :]
    return TwoGroups(mean, (low[0], low[-1], len(low)), (high[0], high[-1], len(high)))


def _document_values(path: Path, names: Sequence[str]) -> dict[str, list[float]]:
    """Per metric, one value per document of a samples file (the first row of each doc_id)."""
    seen: set[Any] = set()
    out: dict[str, list[float]] = {name: [] for name in names}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("doc_id") in seen:
            continue
        seen.add(row.get("doc_id"))
        for name in names:
            value = row.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[name].append(float(value))
    return out


def _cases(runs) -> list[tuple[str, str, str, list[float], TwoGroups, Any]]:
    """(model, task, metric, values, groups, catalogue) of every hidden two-valued distribution."""
    newest: dict[tuple, Any] = {}
    for run in runs:
        for task in run.samples:
            key = (tuple(run.identity), task)
            if key not in newest or run.timestamp > newest[key].timestamp:
                newest[key] = run
    cases = []
    for (identity, task), run in sorted(newest.items(), key=lambda kv: str(kv[0])):
        catalogue = run.catalogue
        names = [n for n, e in catalogue.metrics.items() if not e.task_level]
        for name, values in _document_values(run.samples[task], names).items():
            groups = two_groups(values)
            if groups is not None:
                cases.append((str(identity[0]), task, name, values, groups, catalogue))
    return cases


def _fmt(a: float, b: float) -> str:
    return f"{a:.3g}" if abs(b - a) < 5e-4 * max(1.0, abs(a)) else f"{a:.3g}-{b:.3g}"


def _note(model: str, task: str, name: str, groups: TwoGroups, catalogue) -> str:
    lo, hi = groups.low, groups.high
    return (
        f"{catalogue.label(name)} ({name}), {model} on {task}: the mean {groups.mean:.3g} is "
        f"no document's value; {lo[2]} documents at {_fmt(lo[0], lo[1])} and {hi[2]} at "
        f"{_fmt(hi[0], hi[1])} (figures/distributions.png)."
    )


def _figure(cases, path: Path, formats: Sequence[str]) -> list[Path]:
    from matplotlib.figure import Figure

    shown = cases[:MAX_ROWS]
    fig = Figure(figsize=(6.4, 0.55 + 0.75 * len(shown)), layout="constrained")
    axes = fig.subplots(len(shown), 1, squeeze=False)
    for ax, (model, task, name, values, groups, catalogue) in zip(axes[:, 0], shown, strict=True):
        n = len(values)
        jitter = [((i * 0.618) % 1.0 - 0.5) * 0.5 for i in range(n)]
        ax.scatter(values, jitter, s=14, color="tab:blue", alpha=0.8, label="documents")
        ax.axvline(groups.mean, color="tab:red", lw=1.5, label=f"task mean {groups.mean:.3g}")
        bounds = catalogue.bounds(name)
        if bounds is not None:
            ax.set_xlim(bounds[0] - 0.02 * (bounds[1] - bounds[0]), bounds[1] * 1.02)
        ax.set_ylim(-0.6, 1.0)  # room for the legend above the points
        ax.set_yticks([])
        ax.set_title(f"{catalogue.label(name)}: {model}, {task} ({n} documents)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper center", ncol=2, frameon=False)
    paths = [path.with_suffix(f".{ext}") for ext in formats]
    for out in paths:
        fig.savefig(out, format=out.suffix[1:], dpi=110)
    return paths


def add_distributions(runs, result, formats: Sequence[str]) -> int:
    """Add to ``result`` the figure and a note for every hidden two-valued distribution.

    ``runs``: the parsed results files with their samples files. Returns the count.
    """
    cases = _cases(runs)
    if not cases:
        return 0
    folder = Path(result.out_dir) / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    result.figures.extend(_figure(cases, folder / "distributions.png", formats))
    result.notes.extend(_note(m, t, n, g, c) for m, t, n, _, g, c in cases)
    if len(cases) > MAX_ROWS:
        result.notes.append(f"distributions.png draws the first {MAX_ROWS} of {len(cases)} cases.")
    return len(cases)
