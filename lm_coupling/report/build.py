"""`build_report`: results folder -> CSV tables, figures and ``summary.md``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from lm_coupling.catalogue import Catalogue
from lm_coupling.plugins.specs import DEFAULT_SAMPLE_OPTION as JACOBIAN_SAMPLE
from lm_coupling.report import figures as fig
from lm_coupling.report.benchmarks import benchmark_of
from lm_coupling.report.checkpoints import independent_rows, series_notes, series_table
from lm_coupling.report.controls import controls_table
from lm_coupling.report.distributions import add_distributions
from lm_coupling.report.ill_defined import mark_ill_defined
from lm_coupling.report.leaderboard import (
    benchmark_scores,
    build_leaderboard,
    geometry_columns,
    geometry_long,
    join_external,
    primary_target,
    read_scores_csv,
    settings_messages,
    target_columns,
)
from lm_coupling.report.loading import IDENTITY, ReportInputError, load_results
from lm_coupling.report.newest import newest_values
from lm_coupling.report.row_settings import setting_notes
from lm_coupling.report.stats import MIN_MODELS, correlations, resolve_primary
from lm_coupling.report.summary import write_summary
from lm_coupling.report.tasksets import TaskSets
from lm_coupling.report.timings import sample_sizes, timings_markdown, timings_table

# Geometry metrics drawn over training when revisions name steps (the primary first).
EMERGENCE_METRICS = 3


@dataclass
class ReportResult:
    """What `build_report` wrote, as DataFrames and paths (None: not computed)."""

    out_dir: Path
    leaderboard: pd.DataFrame
    geometry_long: pd.DataFrame
    provenance: pd.DataFrame
    score_sources: pd.DataFrame
    correlations: pd.DataFrame | None = None
    controls: pd.DataFrame | None = None
    timings: pd.DataFrame | None = None
    checkpoints: pd.DataFrame | None = None
    n_independent: int = 0
    primary_metric: str | None = None
    primary_target: str | None = None
    figures: list[Path] = field(default_factory=list)
    summary: Path | None = None
    notes: list[str] = field(default_factory=list)


def _slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(parts)).strip("_")[-120:]


FIGURE_FORMATS = ("png", "svg", "pdf")
"""Formats a figure can be saved in (``--figure-formats``); PNG alone by default."""


def check_figure_formats(formats: str) -> tuple[str, ...]:
    """``"png,svg"`` as a tuple of known formats.

    Raises:
        ReportInputError: an unknown or empty format list.
    """
    chosen = tuple(dict.fromkeys(w.strip().lower() for w in formats.split(",") if w.strip()))
    unknown = [w for w in chosen if w not in FIGURE_FORMATS]
    if unknown or not chosen:
        raise ReportInputError(
            f"figure formats {', '.join(unknown) or '(none)'} not supported: give a comma "
            f"list of {', '.join(FIGURE_FORMATS)} (e.g. --figure-formats png,svg)"
        )
    return chosen


def _save(figure: Figure, out_dir: Path, name: str, formats: tuple[str, ...]) -> list[Path]:
    """Save ``figure`` in ``formats`` under ``out_dir/figures``."""
    if any(ax.get_aspect() != "auto" for ax in figure.axes):
        figure.canvas.draw()  # constrained layout settles equal-aspect axes on a second pass
    paths = [out_dir / "figures" / f"{name}.{ext}" for ext in formats]
    for path in paths:
        figure.savefig(path, format=path.suffix[1:])
    return paths


def _figure_task(geometry: list[dict[str, Any]]) -> str | None:
    """The task whose per-model figures are drawn: measured on the most models, benchmark first."""
    counts: dict[str, int] = {}
    for geo in geometry:
        if (geo.get("profiles") or geo.get("matrices")) and geo.get("task"):
            counts[str(geo["task"])] = counts.get(str(geo["task"]), 0) + 1
    return min(counts, key=lambda t: (-counts[t], benchmark_of(t) is None, t), default=None)


def _n_layers(geo: dict[str, Any], catalogue: Catalogue) -> int:
    """L of a geometry file's model: recorded, else from the length of a profile's mean."""
    recorded = int((geo.get("model") or {}).get("n_layers") or 0)
    if recorded:
        return recorded
    for name, profile in (geo.get("profiles") or {}).items():
        values = fig.drawable(profile)
        if len(values):
            return len(values) - 1 + catalogue.first_layer(name)
    return 1


PER_MODEL_CHOICES = ("auto", "all", "none")
"""``--per-model-figures``: auto draws them for at most `PER_MODEL_AUTO` model rows."""

PER_MODEL_AUTO = 12
"""Model rows up to which ``auto`` draws every per-model figure (about 0.3 s CPU each)."""


def per_model_note(choice: str, n_rows: int) -> str:
    """The summary's note when the per-model figures are not drawn ("" when they are)."""
    if choice == "all" or (choice == "auto" and n_rows <= PER_MODEL_AUTO):
        return ""
    why = f"{n_rows} model rows, more than {PER_MODEL_AUTO}"
    why = why if choice == "auto" else "--per-model-figures none"
    return (
        f"Per-model figures (profiles_<model>.png, coupling_<model>.png) not drawn ({why}): "
        "geometry_long.csv holds every profile and the geometry files every matrix; "
        "`--per-model-figures all` draws them (about 0.3 s of CPU each)."
    )


def heatmap_source(catalogue: Catalogue) -> tuple[str | None, str | None]:
    """The declared primary metric and the first matrix it stores in ``catalogue`` (or Nones).

    Each model's heatmap draws that matrix.
    """
    metric = Catalogue.installed().primary_metric()
    entry = catalogue.metrics.get(metric) if metric is not None else None
    stored = [name for name in (entry.profiles if entry else ()) if name in catalogue.matrices()]
    return (metric, stored[0]) if stored else (None, None)


def _per_model_figures(
    geometry: list[dict[str, Any]], out_dir: Path, catalogue: Catalogue, formats
) -> list[Path]:
    task = _figure_task(geometry)
    heatmap_metric, heatmap_matrix = heatmap_source(catalogue)
    paths = []
    for geo in [g for g in geometry if str(g.get("task")) == task]:
        identity = tuple(geo["identity"])
        n_tasks = sum(1 for g in geometry if tuple(g["identity"]) == identity)
        name = identity[0] if identity[1] == "main" else f"{identity[0]} @ {identity[1]}"
        title = f"{name}, task {task} (1 of {n_tasks} measured; all in geometry_long.csv)"
        slug = _slug(*identity)
        profiles = geo.get("profiles") or {}
        figure = fig.profiles_figure(profiles, _n_layers(geo, catalogue), title, catalogue)
        if figure is not None:
            paths += _save(figure, out_dir, f"profiles_{slug}", formats)
        matrix = ((geo.get("matrices") or {}).get(heatmap_matrix) or {}).get("mean")
        if matrix:
            section = geo.get(heatmap_metric) or {}  # its K and the spectral gap's verdict
            heatmap = fig.coupling_figure(matrix, section.get("k"), title)
            mark_ill_defined(
                heatmap.axes[0], section.get("ill_defined"), section.get("spectral_gap")
            )
            paths += _save(heatmap, out_dir, f"coupling_{slug}", formats)
    return paths


def emergence_columns(board: pd.DataFrame, primary: str | None, catalogue: Catalogue) -> list[str]:
    """The columns drawn over training: the primary metric's, then `EMERGENCE_METRICS` more.

    In catalogue order, a metric's K-named columns with it.
    """
    columns = geometry_columns(board)
    order = {name: i for i, name in enumerate(catalogue.metrics)}
    ranked = sorted(columns, key=lambda c: order.get(catalogue.base_metric(c), len(order)))
    first = [c for c in ranked if primary is not None and catalogue.base_metric(c) == primary]
    first = first or [c for c in ranked if c == primary]
    rest = [c for c in ranked if c not in first and catalogue.is_metric(c)]
    return first + rest[:EMERGENCE_METRICS]


MIN_SCATTER_MODELS = 3
"""Fewest independent models with a fig1a scatter: one point shows no relation, and any
line passes through two (docs/report.md, "The figures")."""


def scatter_note(n_models: int) -> str:
    """The summary's note when `MIN_SCATTER_MODELS` is not reached ("" otherwise)."""
    if n_models >= MIN_SCATTER_MODELS:
        return ""
    return (
        f"No fig1a scatter panels: {n_models} independent model(s), and a metric against a "
        f"score is drawn from {MIN_SCATTER_MODELS} models on (one point shows no relation, "
        "any line passes through two); the values are in leaderboard.csv."
    )


def _figures(
    result: ReportResult, models: pd.DataFrame, sets: TaskSets, loaded, formats, per_model: bool
) -> list[Path]:
    """Every figure; ``models`` (one row per independent model) feeds the fig1a panels."""
    board, corr, target = result.leaderboard, result.correlations, result.primary_target
    out, catalogue = result.out_dir, loaded.catalogue
    (out / "figures").mkdir(parents=True, exist_ok=True)
    paths = []
    for row in corr[corr["target"] == target].to_dict("records") if corr is not None else []:
        if row["n"] < MIN_SCATTER_MODELS:
            continue  # too few points for a scatter (scatter_note; the CSV row has them)
        used = sets.used.get(row["metric"], "")
        tasks = f"{len(used.split(';'))} task(s)" if used else "each model's own tasks (mixed)"
        ax = fig.metric_vs_score(
            models, row["metric"], target, row, tasks=tasks, catalogue=catalogue
        )
        paths += _save(ax.figure, out, f"fig1a_{_slug(row['metric'])}_vs_{_slug(target)}", formats)
    if per_model:
        paths += _per_model_figures(loaded.geometry, out, catalogue, formats)
    steps = board.dropna(subset=["step"]).groupby("model")["step"].nunique()
    if len(steps) and steps.max() >= 2 and target is not None:
        shown = emergence_columns(board, result.primary_metric, catalogue)
        axes = fig.training_dynamics(board, shown, target, catalogue)
        paths += _save(axes[0][0].figure, out, "emergence", formats)
    return paths


def task_set_notes(board: pd.DataFrame, sets: TaskSets, targets: list[str]) -> list[str]:
    """Warnings for models measured or scored on different task sets."""
    notes = []
    for metric in sets.mixed:
        per_model = board[f"{metric}__tasks"].dropna().unique()
        notes.append(
            f"WARNING: models were measured on different task sets for {metric} "
            f"(no task common to all: {' | '.join(sorted(map(str, per_model)))}); each model's "
            "value is the mean over its own tasks, so these values are not comparable."
        )
    for metric, dropped in sets.dropped.items():
        undefined = sets.undefined.get(metric, [])
        missing = [unit for unit in dropped if unit not in undefined]
        reasons = []
        if missing:
            reasons.append(f"left out because only some models have them: {', '.join(missing)}")
        if undefined:
            reasons.append(
                "left out because the value is undefined (NaN) on some models, although every "
                f"model measured them: {', '.join(undefined)}"
            )
        notes.append(
            f"{metric} is averaged over the tasks every model has ({sets.used[metric]}); "
            f"{'; '.join(reasons)}."
        )
    partial = [t for t in targets if 0 < board[t].notna().sum() < len(board)]
    if partial:
        counts = ", ".join(f"{t} ({int(board[t].notna().sum())}/{len(board)})" for t in partial)
        notes.append(
            "WARNING: models were run on different tasks; scores present on only some "
            f"models: {counts}. Each score column is correlated on the models that have it."
        )
    return notes


def build_report(
    results_dir: str | Path,
    out_dir: str | Path | None = None,
    scores_csv: str | Path | None = None,
    primary: str | None = None,
    seed: int = 0,
    figure_formats: str = "png",
    checkpoint: str = "last",
    per_model_figures: str = "auto",
) -> ReportResult:
    """Read a results folder and write the report (see docs/report.md).

    Args:
        results_dir: folder holding lm-eval runs (searched recursively).
        out_dir: where to write (default ``<results_dir>/report``).
        scores_csv: external scores with a ``model`` column and benchmark columns.
        primary: geometry metric of the primary test (against the average, or
            the score present on most models when no model has all six);
            default: the one its plugin declares primary (`Catalogue.primary_metric`).
        seed: bootstrap seed.
        figure_formats: comma list of the formats of every figure (`FIGURE_FORMATS`).
        checkpoint: a series' row in the across-model statistics: ``"last"``,
            ``"first"`` or a revision name.
        per_model_figures: ``"auto"`` (up to `PER_MODEL_AUTO` rows), ``"all"``, ``"none"``.

    Returns:
        The tables and paths written.

    Raises:
        ReportInputError: missing folder, no readable results file, a bad scores
            CSV or option, or a ``checkpoint`` revision that some series lacks.
    """
    formats = check_figure_formats(figure_formats)
    if per_model_figures not in PER_MODEL_CHOICES:
        raise ReportInputError(
            f"per-model figures {per_model_figures!r}: give one of {', '.join(PER_MODEL_CHOICES)}"
        )
    loaded = load_results(results_dir)
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    selected, provenance = newest_values(loaded.values, loaded.paths)
    sources = benchmark_scores(selected)
    if scores_csv is not None:
        ids = selected[IDENTITY].drop_duplicates()
        sources = join_external(sources, ids, read_scores_csv(scores_csv), str(scores_csv))
    board, sets = build_leaderboard(selected, sources, loaded)
    warned = settings_messages(board, provenance, selected)
    metrics, targets = geometry_columns(board), target_columns(board)
    notes = task_set_notes(board, sets, targets) + [f"WARNING: {m}" for m in warned]
    notes += [f"skipped {s}" for s in loaded.skipped] + loaded.notes
    notes += setting_notes(board, selected)
    if scores_csv is not None:
        n_external = int((sources["source"] == str(scores_csv)).sum())
        notes.append(
            f"{n_external} benchmark scores came from --scores {scores_csv}; the others "
            "from the runs' results files (see score_sources.csv)."
        )
    long = geometry_long(selected, loaded)
    result = ReportResult(out, board, long, provenance, sources, notes=notes)
    independence = independent_rows(board, checkpoint)
    models = board.loc[independence.used].reset_index(drop=True)  # one row per model
    n_models = result.n_independent = independence.n_models
    result.primary_metric = resolve_primary(metrics, primary)
    result.primary_target = primary_target(models, targets)
    if n_models < MIN_MODELS:
        notes.append(
            f"{len(board)} model row(s): at least {MIN_MODELS} independent models are needed "
            f"for any fit or p-value and these rows hold {n_models}, so the "
            "statistics tables are descriptive only (every row says why)."
        )
    if result.primary_target is None:
        notes.append("Statistics skipped: no task score was found.")
    else:
        result.correlations = correlations(
            models, metrics, targets, primary, seed, result.primary_target, sets.used
        )
        result.controls = controls_table(models, metrics, result.primary_target, seed)
    per_model = per_model_note(per_model_figures, len(board))
    notes += [per_model] if per_model else []
    if result.primary_target is not None and scatter_note(n_models):
        notes.append(scatter_note(n_models))
    if independence.series:
        result.checkpoints = series_table(board, independence, [*targets, *metrics])
    timed = timings_table(loaded.geometry)
    result.timings = timed if len(timed) else None
    for name, table in vars(result).items():  # every table, as <field>.csv
        if isinstance(table, pd.DataFrame):
            table.to_csv(out / f"{name}.csv", index=False)
    result.figures = _figures(result, models, sets, loaded, formats, not per_model)
    add_distributions(loaded.runs, result, formats)
    result.summary = write_summary(
        out,
        result.primary_metric,
        result.figures,
        notes,
        result.primary_target,
        timings_markdown(timed, sample_sizes(loaded.geometry, JACOBIAN_SAMPLE), JACOBIAN_SAMPLE),
        independent=n_models,
        checkpoints=series_notes(board, independence),
    )
    return result
