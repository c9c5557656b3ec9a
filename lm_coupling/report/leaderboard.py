"""Build the leaderboard table (one row per model identity) and the long geometry table.

The columns of ``leaderboard.csv`` and ``geometry_long.csv`` are listed in
docs/report.md, "The tables"; which tasks a geometry value is averaged over
is `lm_coupling.report.tasksets`, what a row was measured with
`lm_coupling.report.row_settings`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lm_coupling.catalogue import Catalogue
from lm_coupling.report.benchmarks import (
    AVERAGE,
    BENCHMARKS,
    BOUNDARY_COLUMN,
    benchmark_of,
    parse_step,
)
from lm_coupling.report.boundary import boundary_depth, boundary_profile
from lm_coupling.report.loading import (
    IDENTITY,
    LoadedResults,
    ReportInputError,
    RunFile,
    SettingsWarning,
)
from lm_coupling.report.newest import setting_conflicts
from lm_coupling.report.row_settings import (
    ROW_SETTING_COLUMNS,
    cross_row_messages,
    mixed_messages,
    row_settings,
)
from lm_coupling.report.tasksets import (
    TaskSets,
    documents_measured,
    geometry_table,
    scored_groups,
    task_unit,
)

LONG_COLUMNS = [*IDENTITY, "task", "metric", "layer", "value", "stderr", "n"]
SOURCE_COLUMNS = [*IDENTITY, "benchmark", "task", "metric", "filter", "setting", "value", "source"]
# Counts (and every ``<metric>__n``): nullable integers in the CSV (``4``, not ``4.0``).
INTEGER_COLUMNS = ("step", "n_params", "n_layers", "d_model", "n_benchmarks")


def _first_filter(rows: pd.DataFrame, filters: tuple[str, ...] | None) -> pd.DataFrame:
    """One row per (identity, task, metric): the first filter in ``filters`` order, else first."""
    if filters is not None:
        rank = {f: i for i, f in enumerate(filters)}
        rows = rows[rows["filter"].isin(rank)]
        rows = rows.assign(_rank=rows["filter"].map(rank)).sort_values("_rank", kind="stable")
    return rows.drop_duplicates([*IDENTITY, "task", "metric"], keep="first")


def in_open_llm_setting(task: str, shots: Any) -> bool:
    """Whether a run of ``task`` with ``shots`` few-shot examples is in the Open LLM v1 setting."""
    bench = benchmark_of(task)
    return bench is not None and pd.notna(shots) and int(shots) == bench.shots


def benchmark_scores(selected: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard score of every (identity, benchmark) in the Open LLM v1 setting."""
    scores = selected[selected["kind"] == "score"]
    parts = []
    for bench in BENCHMARKS:
        tasks = [t for t in scores["task"].unique() if benchmark_of(t) == bench]
        rows = scores[scores["task"].isin(tasks) & (scores["metric"] == bench.metric)]
        keep = [in_open_llm_setting(t, s) for t, s in zip(rows["task"], rows["shots"], strict=True)]
        rows = rows[pd.Series(keep, index=rows.index, dtype=bool)]
        rows = _first_filter(rows, bench.filters).drop_duplicates(IDENTITY, keep="first")
        parts.append(rows.assign(benchmark=bench.column, source=rows["file"]))
    return pd.concat(parts, ignore_index=True).reindex(columns=SOURCE_COLUMNS)


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


def join_external(
    scores: pd.DataFrame, identities: pd.DataFrame, external: pd.DataFrame, path: str
) -> pd.DataFrame:
    """Replace run scores with the ``--scores`` CSV's (matched on the name or its last part)."""
    columns = [b.column for b in BENCHMARKS if b.column in external.columns]
    names = external["model"].astype(str)
    rows = []
    for ident in identities.itertuples(index=False, name=None):
        hits = external[names == ident[0]]
        hits = hits if len(hits) else external[names == Path(ident[0]).name]
        match = hits.iloc[-1] if len(hits) else None
        for column in columns if match is not None else []:
            value = pd.to_numeric(match[column], errors="coerce")
            if pd.notna(value):
                blank = dict.fromkeys(("task", "metric", "filter", "setting"), "")
                rows.append(
                    dict(
                        zip(IDENTITY, ident, strict=True),
                        **blank,
                        benchmark=column,
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


SCORE_PREFIX = "score:"
AUX_SEPARATOR = "__"


def task_score_column(task: str, metric: str, filt: str) -> str:
    """``score:<task>:<metric>`` (``,<filter>`` appended unless the filter is ``none``)."""
    suffix = "" if filt in ("none", "", None) else f",{filt}"
    return f"{SCORE_PREFIX}{task}:{metric}{suffix}"


def task_scores(selected: pd.DataFrame) -> pd.DataFrame:
    """Primary scores of the tasks outside the Open LLM v1 columns, one column each.

    Tasks that are no benchmark, and benchmarks run outside the v1 setting.
    """
    groups = scored_groups(selected)
    rows = selected[(selected["kind"] == "score") & selected["primary_score"].astype(bool)]
    keep = [
        not in_open_llm_setting(task, shots) and task_unit(task, group, groups) == task
        for task, group, shots in zip(rows["task"], rows["group"], rows["shots"], strict=True)
    ]
    rows = rows[pd.Series(keep, index=rows.index, dtype=bool)]
    ranked = [
        _first_filter(part, getattr(benchmark_of(task), "filters", None))
        for task, part in rows.groupby("task")
    ]
    rows = pd.concat(ranked) if ranked else rows
    rows = rows.drop_duplicates([*IDENTITY, "task"], keep="first")
    if rows.empty:
        return pd.DataFrame(index=pd.MultiIndex.from_tuples([], names=IDENTITY))
    rows = rows.assign(
        column=[task_score_column(t, m, f) for t, m, f in rows[["task", "metric", "filter"]].values]
    )
    wide = rows.pivot_table(index=IDENTITY, columns="column", values="value", aggfunc="first")
    return wide[sorted(wide.columns)]


GEOMETRY_ROW_COLUMNS = [*IDENTITY, "task", "metric", "unit", "value", "n", "k_used", "file"]


def geometry_rows(selected: pd.DataFrame, loaded: LoadedResults) -> pd.DataFrame:
    """One row per (identity, task, metric): value, unit, documents measured, K used.

    A value's geometry file is the one beside its own results file, else the
    newest for its model and task; the thought/fixation boundary rows follow
    (one per geometry file with a boundary profile of the catalogue).
    """
    catalogue, geometry = loaded.catalogue, loaded.geometry
    lookup = {(tuple(g["identity"]), str(g.get("task"))): g for g in geometry}
    groups = scored_groups(selected)
    keys = selected[[*IDENTITY, "task"]].itertuples(index=False, name=None)
    group_of = dict(zip(keys, selected["group"], strict=True))
    rows = []
    for r in _first_filter(selected[selected["kind"] == "geometry"], None).to_dict("records"):
        ident, task, base = tuple(r[k] for k in IDENTITY), r["task"], r["base_metric"]
        doc = loaded.by_results.get((str(r["file"]), task)) or lookup.get((ident, task))
        section = (doc or {}).get(base)  # a plugin's own section, by metric name
        k_used = section.get("k") if isinstance(section, dict) else None
        k_used = k_used if k_used is not None else r["k_used"]
        n = documents_measured(doc, base, r["n"], catalogue)
        unit = task_unit(task, r["group"], groups)
        k_used = math.nan if k_used is None else float(k_used)
        rows.append((*ident, task, r["metric"], unit, r["value"], n, k_used, r["file"]))
    for doc in geometry:
        profile = boundary_profile(doc.get("profiles") or {}, catalogue.boundary_profiles())
        if profile is not None:
            task = str(doc.get("task", ""))
            unit = task_unit(task, group_of.get((*doc["identity"], task), ""), groups)
            n = float(doc.get("n_documents") or math.nan)
            rows.append(
                (
                    *doc["identity"],
                    task,
                    BOUNDARY_COLUMN,
                    unit,
                    boundary_depth(profile),
                    n,
                    math.nan,
                    str(doc.get("results_file", "")),
                )
            )
    frame = pd.DataFrame(rows, columns=GEOMETRY_ROW_COLUMNS)
    return frame.astype({"value": float, "n": float})


def build_leaderboard(
    selected: pd.DataFrame, scores: pd.DataFrame, loaded: LoadedResults
) -> tuple[pd.DataFrame, TaskSets]:
    """``leaderboard.csv`` from the newest values, the benchmark scores and the folder's files.

    Returns the table and its geometry `TaskSets`.
    """
    rows = geometry_rows(selected, loaded)
    wide, sets = geometry_table(rows)
    board = row_columns(selected, loaded.shapes, scores, loaded.runs)
    if len(wide.columns):  # the geometry columns go before the settings columns
        head = board.drop(columns=ROW_SETTING_COLUMNS)
        head = head.merge(wide.reset_index(), on=IDENTITY, how="left")
        board = head.join(board[ROW_SETTING_COLUMNS])
    board = board.sort_values(IDENTITY, kind="stable").reset_index(drop=True)
    for column in [c for c in board.columns if c in INTEGER_COLUMNS or c.endswith("__n")]:
        board[column] = as_counts(board[column])
    return board, sets


def row_columns(
    selected: pd.DataFrame,
    shapes: pd.DataFrame,
    scores: pd.DataFrame,
    runs: list[RunFile],
) -> pd.DataFrame:
    """The leaderboard's columns other than geometry, one row per identity of ``selected``.

    Identity, step, shape, the benchmarks, ``n_benchmarks``, ``average``, the
    ``score:`` columns and the settings columns, in ``selected``'s order.
    """
    ids = selected[IDENTITY].drop_duplicates()
    board = ids.merge(shapes, on=IDENTITY, how="left")
    board.insert(3, "step", board["revision"].map(parse_step).astype("Int64"))
    bench_cols = [b.column for b in BENCHMARKS if b.column in set(scores["benchmark"])]
    if bench_cols:
        wide = scores.pivot_table(
            index=IDENTITY, columns="benchmark", values="value", aggfunc="first"
        )
        board = board.merge(wide[bench_cols].reset_index(), on=IDENTITY, how="left")
    board["n_benchmarks"] = board[bench_cols].notna().sum(axis=1)
    board[AVERAGE] = board[bench_cols].mean(axis=1).where(board["n_benchmarks"] == len(BENCHMARKS))
    extra = task_scores(selected)
    if len(extra.columns):
        board = board.merge(extra.reset_index(), on=IDENTITY, how="left")
    settings = row_settings(selected, runs)
    return board.merge(settings.reset_index(), on=IDENTITY, how="left")


def as_counts(values: pd.Series) -> pd.Series:
    """``values`` as nullable integers when every non-missing one is whole, else unchanged."""
    numbers = pd.to_numeric(values, errors="coerce")
    finite = numbers.dropna().astype(float)
    whole = bool(np.isfinite(finite).all() and (finite % 1 == 0).all())
    return numbers.round().astype("Int64") if whole else values


def geometry_long(selected: pd.DataFrame, loaded: LoadedResults) -> pd.DataFrame:
    """Per-task geometry: scalars (``layer`` empty) and per-layer profiles (docs/report.md)."""
    rows = geometry_rows(selected, loaded)
    rows = rows[rows["metric"] != BOUNDARY_COLUMN]
    stderr = _first_filter(selected[selected["kind"] == "geometry"], None)
    rows = rows.merge(
        stderr[[*IDENTITY, "task", "metric", "stderr"]],
        on=[*IDENTITY, "task", "metric"],
        how="left",
    )
    profiles = _profile_rows(loaded.geometry, loaded.catalogue)
    parts = [rows.assign(layer=pd.NA)[LONG_COLUMNS], profiles]
    parts = [p for p in parts if len(p)]
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=LONG_COLUMNS)
    out["layer"] = out["layer"].astype("Int64")
    out["n"] = as_counts(out["n"])
    return out.sort_values(
        [*IDENTITY, "task", "metric", "layer"], kind="stable", na_position="first"
    ).reset_index(drop=True)


def _profile_rows(geometry: list[dict[str, Any]], catalogue: Catalogue) -> pd.DataFrame:
    """Every per-layer profile entry of ``geometry`` as rows of ``LONG_COLUMNS``."""
    rows = []
    for item in geometry:
        for name, profile in (item.get("profiles") or {}).items():
            mean = profile.get("mean") or []
            if not mean or any(isinstance(v, list) for v in mean):
                continue  # per-layer vectors (singular values): in the geometry file only
            first, blank = catalogue.first_layer(name), [math.nan] * len(mean)
            layers = list(range(first, first + len(mean)))
            err, count = profile.get("stderr") or blank, profile.get("n") or blank
            rows.append((*item["identity"], item.get("task", ""), name, layers, mean, err, count))
    frame = pd.DataFrame(rows, columns=LONG_COLUMNS).explode(LONG_COLUMNS[-4:])
    return frame.astype({"value": float, "stderr": float, "n": float})


def geometry_columns(board: pd.DataFrame) -> list[str]:
    """The geometry metric columns of a leaderboard, in table order (no companions)."""
    fixed = {*IDENTITY, "step", "n_params", "n_layers", "d_model", "n_benchmarks", AVERAGE}
    fixed |= {b.column for b in BENCHMARKS} | set(ROW_SETTING_COLUMNS)
    return [
        c
        for c in board.columns
        if c not in fixed and not c.startswith(SCORE_PREFIX) and AUX_SEPARATOR not in c
    ]


def target_columns(board: pd.DataFrame) -> list[str]:
    """Score columns: the benchmarks present, ``average``, then ``score:<task>:<metric>``."""
    fixed = [c for c in (*[b.column for b in BENCHMARKS], AVERAGE) if c in board.columns]
    return fixed + [c for c in board.columns if c.startswith(SCORE_PREFIX)]


def primary_target(board: pd.DataFrame, targets: list[str]) -> str | None:
    """``average`` when any model has all six benchmarks, else the score on the most models."""
    present = [t for t in targets if board[t].notna().any()]
    if AVERAGE in present:
        return AVERAGE
    return max(present, key=lambda t: int(board[t].notna().sum()), default=None)


def settings_messages(
    board: pd.DataFrame, provenance: pd.DataFrame, selected: pd.DataFrame
) -> list[str]:
    """Everything the leaderboard combines across settings, each also a `SettingsWarning`.

    `setting_conflicts` (values left out), `mixed_messages` (rows combining
    metric options) and `cross_row_messages` (a task in several settings).
    """
    table = board.set_index(IDENTITY)[["mixed_settings"]].fillna("")
    messages = setting_conflicts(provenance) + mixed_messages(table) + cross_row_messages(selected)
    for message in messages:
        warnings.warn(message, SettingsWarning, stacklevel=3)
    return messages
