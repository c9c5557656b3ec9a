"""`build_report`: results folder -> CSV tables, figures and ``summary.md``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from lm_coupling.report import figures as fig
from lm_coupling.report.benchmarks import AVERAGE, benchmark_of
from lm_coupling.report.controls import controls_table
from lm_coupling.report.leaderboard import (
    benchmark_scores,
    build_leaderboard,
    geometry_columns,
    geometry_long,
    join_external,
    read_scores_csv,
    target_columns,
)
from lm_coupling.report.loading import IDENTITY, load_results, newest_values
from lm_coupling.report.stats import MIN_MODELS, correlations, resolve_primary
from lm_coupling.report.summary import write_summary
from lm_coupling.report.tokenwise import tokenwise_figure, with_tokenwise
from lm_coupling.report.within_model import within_model

# Geometry drawn over training when revisions name steps (besides the primary metric).
TRAINING_METRICS = ("coupling", "lss", "expodistance")


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
    within_model: pd.DataFrame | None = None
    primary_metric: str | None = None
    figures: list[Path] = field(default_factory=list)
    summary: Path | None = None
    notes: list[str] = field(default_factory=list)


def _slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(parts)).strip("_")[-120:]


def _save(axes_owner, out_dir: Path, name: str) -> list[Path]:
    figure = axes_owner.figure
    paths = [out_dir / "figures" / f"{name}.{ext}" for ext in ("png", "svg")]
    for path in paths:
        figure.savefig(path, format=path.suffix[1:])
    return paths


def _model_geometry(geometry: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """One geometry file per identity: a benchmark task first, then by task name."""
    best: dict[tuple, dict[str, Any]] = {}
    for geo in sorted(
        geometry, key=lambda g: (benchmark_of(str(g.get("task"))) is None, str(g.get("task")))
    ):
        best.setdefault(geo["identity"], geo)
    return best


def _per_model_figures(geometry: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    paths = []
    for identity, geo in _model_geometry(geometry).items():
        slug = _slug(*identity)
        profiles = geo.get("profiles") or {}
        names = [n for n in fig.PROFILE_LABELS if (profiles.get(n) or {}).get("mean")]
        if names:
            axes = fig.new_axes(len(names), figsize=(3.0 * len(names), 3.0))
            boundary = fig.profile_boundary(profiles)
            for ax, name in zip(axes, names, strict=True):
                prof = profiles[name]
                fig.layer_profile(prof["mean"], name, boundary, ax=ax, stderr=prof.get("stderr"))
            axes[0].figure.suptitle(f"{identity[0]} ({geo.get('task')})", fontsize=9)
            paths += _save(axes[0], out_dir, f"profiles_{slug}")
        matrix = ((geo.get("matrices") or {}).get("coupling") or {}).get("mean")
        if matrix:
            axes = fig.new_axes(2, figsize=(10.0, 4.5))
            fig.coupling_heatmap(matrix, ax=axes[0])
            fig.coupling_graph(matrix, ax=axes[1])
            paths += _save(axes[0], out_dir, f"coupling_{slug}")
    return paths


def _figures(board, corr, primary, geometry, out_dir: Path) -> list[Path]:
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    paths = []
    if corr is not None:
        for row in corr[corr["target"] == AVERAGE].to_dict("records"):
            ax = fig.metric_vs_score(board, row["metric"], AVERAGE, fit=row)
            paths += _save(ax, out_dir, f"fig1a_{_slug(row['metric'])}_vs_average")
    paths += _per_model_figures(geometry, out_dir)
    for identity, geo in with_tokenwise(geometry).items():
        axes = tokenwise_figure(geo, f"{identity[0]} {identity[1]} ({geo.get('task')})")
        paths += _save(axes, out_dir, f"tokenwise_{_slug(*identity)}")
    if board.dropna(subset=["step"]).groupby("model")["step"].nunique().max() >= 2:
        shown = [c for c in dict.fromkeys((primary, *TRAINING_METRICS)) if c in board.columns]
        axes = fig.training_dynamics(board, shown, AVERAGE)
        paths += _save(axes[0][0], out_dir, "emergence")
    return paths


def _score_notes(sources: pd.DataFrame, scores_csv) -> list[str]:
    notes = []
    if scores_csv is not None:
        ext = sources[sources["source"] == str(scores_csv)]
        notes.append(
            f"{len(ext)} benchmark scores came from --scores {scores_csv}; the others "
            "from the runs' results files (see score_sources.csv)."
        )
    return notes


def build_report(
    results_dir: str | Path,
    out_dir: str | Path | None = None,
    scores_csv: str | Path | None = None,
    primary: str = "coupling",
    seed: int = 0,
) -> ReportResult:
    """Read a results folder and write the report (see DESIGN.md section 7).

    Args:
        results_dir: folder holding lm-eval runs (searched recursively).
        out_dir: where to write (default ``<results_dir>/report``).
        scores_csv: external scores with a ``model`` column and benchmark columns.
        primary: geometry metric of the primary test (against the average).
        seed: bootstrap seed.

    Returns:
        The tables and paths written.

    Raises:
        ReportInputError: missing folder, no readable results file, or a bad scores CSV.
    """
    loaded = load_results(results_dir)
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    selected, provenance = newest_values(loaded.values)
    sources = benchmark_scores(selected)
    if scores_csv is not None:
        ids = selected[IDENTITY].drop_duplicates()
        sources = join_external(sources, ids, read_scores_csv(scores_csv), str(scores_csv))
    board = build_leaderboard(selected, loaded.shapes, sources, loaded.geometry)
    result = ReportResult(
        out,
        board,
        geometry_long(selected, loaded.geometry),
        provenance,
        sources,
        notes=[f"skipped {s}" for s in loaded.skipped],
    )
    result.notes += _score_notes(sources, scores_csv)
    metrics, targets = geometry_columns(board), target_columns(board)
    result.primary_metric = resolve_primary(metrics, primary)
    if len(board) < MIN_MODELS:
        result.notes.append(
            f"Statistics skipped: {len(board)} model row(s), at least "
            f"{MIN_MODELS} are needed; tables are descriptive only."
        )
    elif not targets:
        result.notes.append("Statistics skipped: no leaderboard benchmark score was found.")
    else:
        result.correlations = correlations(board, metrics, targets, primary, seed)
        result.controls = controls_table(board, metrics, AVERAGE, seed)
    wm = within_model(loaded.runs)
    result.within_model = wm if len(wm) else None
    tables = {
        "leaderboard": board,
        "geometry_long": result.geometry_long,
        "provenance": provenance,
        "score_sources": sources,
        "correlations": result.correlations,
        "controls": result.controls,
        "within_model": result.within_model,
    }
    for name, table in tables.items():
        if table is not None:
            table.to_csv(out / f"{name}.csv", index=False)
    result.figures = _figures(
        board, result.correlations, result.primary_metric, loaded.geometry, out
    )
    result.summary = write_summary(out, result.primary_metric, result.figures, result.notes)
    return result
