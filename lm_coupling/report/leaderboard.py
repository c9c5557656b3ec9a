"""Build the leaderboard table (one row per model identity) and the long geometry table.

Columns of ``leaderboard.csv``: ``model, revision, dtype, step, n_params,
n_layers, d_model``, one column per benchmark present (``arc, hellaswag,
mmlu, truthfulqa, winogrande, gsm8k``: scores in [0, 1]), ``n_benchmarks``,
``average`` (the mean over the benchmarks present in that row), then one column
per geometry metric and ``thought_fixation_boundary``.

A model's geometry value is the mean of its per-task values over the
leaderboard benchmark tasks that carry it; a model whose geometry was measured
only on other tasks gets the mean over those tasks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lm_coupling.report.benchmarks import (
    AVERAGE,
    BENCHMARKS,
    BOUNDARY_COLUMN,
    benchmark_of,
    parse_step,
)
from lm_coupling.report.boundary import boundary_depth, boundary_profile
from lm_coupling.report.loading import IDENTITY, ReportInputError, load_results, newest_values

LONG_COLUMNS = [*IDENTITY, "task", "metric", "layer", "value", "stderr", "n"]
SOURCE_COLUMNS = [*IDENTITY, "benchmark", "task", "metric", "filter", "value", "source"]
PROFILE_NAMES = ("norm", "windowed_lss", "logit_lens_entropy", "tv_to_target")


def _first_filter(rows: pd.DataFrame, filters: tuple[str, ...] | None) -> pd.DataFrame:
    """One row per (identity, task, metric): the first filter in ``filters`` order, else first."""
    if filters is not None:
        rank = {f: i for i, f in enumerate(filters)}
        rows = rows[rows["filter"].isin(rank)]
        rows = rows.assign(_rank=rows["filter"].map(rank)).sort_values("_rank", kind="stable")
    return rows.drop_duplicates([*IDENTITY, "task", "metric"], keep="first")


def benchmark_scores(selected: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard score of every (identity, benchmark), columns ``SOURCE_COLUMNS``."""
    scores = selected[selected["kind"] == "score"]
    parts = []
    for bench in BENCHMARKS:
        tasks = [t for t in scores["task"].unique() if benchmark_of(t) == bench]
        rows = scores[scores["task"].isin(tasks) & (scores["metric"] == bench.metric)]
        rows = _first_filter(rows, bench.filters).drop_duplicates(IDENTITY, keep="first")
        parts.append(rows.assign(benchmark=bench.column, source=rows["file"]))
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return out.reindex(columns=SOURCE_COLUMNS)


def read_scores_csv(path: str | Path) -> pd.DataFrame:
    """Read external scores: a ``model`` column and benchmark columns (and/or ``average``).

    Raises:
        ReportInputError: the file is unreadable or lacks a ``model`` column.
    """
    try:
        table = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise ReportInputError(f"cannot read --scores file {path}: {exc}") from exc
    if "model" not in table.columns:
        raise ReportInputError(
            f"--scores file {path} has columns {list(table.columns)}; expected a 'model' "
            "column and benchmark columns such as arc, hellaswag, mmlu, truthfulqa, "
            "winogrande, gsm8k"
        )
    return table


def _match_external(model: str, external: pd.DataFrame) -> pd.Series | None:
    names = external["model"].astype(str)
    for candidate in (model, Path(model).name):
        hits = external[names == candidate]
        if len(hits):
            return hits.iloc[-1]
    return None


def join_external(
    scores: pd.DataFrame, identities: pd.DataFrame, external: pd.DataFrame, path: str
) -> pd.DataFrame:
    """Replace run scores with external ones where the ``--scores`` CSV has them.

    A model matches on its full name or on the last part of a local path.
    External values win over the runs' own (runs made with ``--limit`` score
    only a few documents).
    """
    columns = [b.column for b in BENCHMARKS if b.column in external.columns]
    rows = []
    for ident in identities.itertuples(index=False):
        match = _match_external(ident.model, external)
        if match is None:
            continue
        for column in columns:
            value = pd.to_numeric(match[column], errors="coerce")
            if pd.notna(value):
                rows.append(
                    dict(
                        model=ident.model,
                        revision=ident.revision,
                        dtype=ident.dtype,
                        benchmark=column,
                        task="",
                        metric="",
                        filter="",
                        value=float(value),
                        source=str(path),
                    )
                )
    if not rows:
        return scores
    ext = pd.DataFrame(rows, columns=SOURCE_COLUMNS)
    keep = scores.merge(ext[[*IDENTITY, "benchmark"]], how="left", indicator=True)
    keep = keep[keep["_merge"] == "left_only"].drop(columns="_merge")
    return pd.concat([keep, ext], ignore_index=True)


def _geometry_means(selected: pd.DataFrame) -> pd.DataFrame:
    geo = _first_filter(selected[selected["kind"] == "geometry"], None)
    geo = geo.assign(_bench=geo["task"].map(lambda t: benchmark_of(t) is not None).astype(bool))
    has_bench = geo.groupby([*IDENTITY, "metric"])["_bench"].transform("any")
    geo = geo[geo["_bench"] | ~has_bench]
    return geo.pivot_table(index=IDENTITY, columns="metric", values="value", aggfunc="mean")


def _boundaries(geometry: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for geo in geometry:
        profile = boundary_profile(geo.get("profiles") or {})
        if profile is not None:
            bench = benchmark_of(str(geo.get("task", ""))) is not None
            rows.append(
                dict(
                    zip(IDENTITY, geo["identity"], strict=True),
                    value=boundary_depth(profile),
                    bench=bench,
                )
            )
    table = pd.DataFrame(rows, columns=[*IDENTITY, "value", "bench"])
    if table.empty:
        return pd.DataFrame(
            columns=[BOUNDARY_COLUMN], index=pd.MultiIndex.from_tuples([], names=IDENTITY)
        )
    has_bench = table.groupby(IDENTITY)["bench"].transform("any")
    table = table[table["bench"] | ~has_bench]
    return table.groupby(IDENTITY)[["value"]].mean().rename(columns={"value": BOUNDARY_COLUMN})


def build_leaderboard(
    selected: pd.DataFrame,
    shapes: pd.DataFrame,
    scores: pd.DataFrame,
    geometry: list[dict[str, Any]],
) -> pd.DataFrame:
    """Assemble ``leaderboard.csv`` (see the module docstring for the columns)."""
    ids = selected[IDENTITY].drop_duplicates()
    board = ids.merge(shapes, on=IDENTITY, how="left")
    board.insert(3, "step", board["revision"].map(parse_step).astype("Int64"))
    bench_cols = [b.column for b in BENCHMARKS if b.column in set(scores["benchmark"])]
    if bench_cols:
        wide = scores.pivot_table(
            index=IDENTITY, columns="benchmark", values="value", aggfunc="first"
        )
        board = board.merge(wide[bench_cols].reset_index(), on=IDENTITY, how="left")
    board["n_benchmarks"] = board[bench_cols].notna().sum(axis=1) if bench_cols else 0
    board[AVERAGE] = board[bench_cols].mean(axis=1) if bench_cols else np.nan
    means = _geometry_means(selected)
    board = board.merge(means.reset_index(), on=IDENTITY, how="left")
    board = board.merge(_boundaries(geometry).reset_index(), on=IDENTITY, how="left")
    return board.sort_values(IDENTITY, kind="stable").reset_index(drop=True)


def geometry_long(selected: pd.DataFrame, geometry: list[dict[str, Any]]) -> pd.DataFrame:
    """Per-task geometry: scalars (``layer`` empty) and per-layer profiles from geometry files."""
    geo = _first_filter(selected[selected["kind"] == "geometry"], None)
    rows = [geo.assign(layer=pd.NA)[LONG_COLUMNS]]
    for item in geometry:
        for name, profile in (item.get("profiles") or {}).items():
            mean = profile.get("mean") or []
            stderr = profile.get("stderr") or [math.nan] * len(mean)
            count = profile.get("n") or [math.nan] * len(mean)
            frame = pd.DataFrame(dict(value=mean, stderr=stderr, n=count), dtype=float)
            frame = frame.assign(layer=range(len(mean)), task=item.get("task", ""), metric=name)
            for key, value in zip(IDENTITY, item["identity"], strict=True):
                frame[key] = value
            rows.append(frame[LONG_COLUMNS])
    out = (
        pd.concat([r for r in rows if len(r)], ignore_index=True)
        if any(len(r) for r in rows)
        else pd.DataFrame(columns=LONG_COLUMNS)
    )
    out["layer"] = out["layer"].astype("Int64")
    return out.sort_values(
        [*IDENTITY, "task", "metric", "layer"], kind="stable", na_position="first"
    ).reset_index(drop=True)


def geometry_columns(board: pd.DataFrame) -> list[str]:
    """The geometry metric columns of a leaderboard, in table order."""
    fixed = {*IDENTITY, "step", "n_params", "n_layers", "d_model", "n_benchmarks", AVERAGE}
    fixed |= {b.column for b in BENCHMARKS}
    return [c for c in board.columns if c not in fixed]


def target_columns(board: pd.DataFrame) -> list[str]:
    """Benchmark columns present, then ``average``."""
    return [c for c in (*[b.column for b in BENCHMARKS], AVERAGE) if c in board.columns]


def write_leaderboard(results_dir: str | Path) -> Path:
    """Rebuild ``results_dir/leaderboard.csv`` from every run in the folder.

    The same table as the report's ``leaderboard.csv``, without the
    statistics and figures: the run command refreshes it after every run.
    """
    loaded = load_results(results_dir)
    selected, _ = newest_values(loaded.values)
    board = build_leaderboard(selected, loaded.shapes, benchmark_scores(selected), loaded.geometry)
    path = Path(results_dir) / "leaderboard.csv"
    board.to_csv(path, index=False)
    return path
