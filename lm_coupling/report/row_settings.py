"""What each leaderboard row was measured with: shots, limit and metric options.

The columns ``settings``, ``limited``, ``metric_options`` and
``mixed_settings`` of ``leaderboard.csv`` (docs/report.md, "Settings"), and
the summary's notes and warnings about them.
"""

from __future__ import annotations

import pandas as pd

from lm_coupling.catalogue import Catalogue
from lm_coupling.report.benchmarks import benchmark_of
from lm_coupling.report.loading import IDENTITY, RunFile
from lm_coupling.report.settings import differing_options, options_text
from lm_coupling.report.tasksets import scored_groups, task_unit

ROW_SETTING_COLUMNS = ["settings", "limited", "metric_options", "mixed_settings"]


def _settings_text(rows: pd.DataFrame, groups: set[str]) -> tuple[str, str]:
    units: dict[str, set[str]] = {}
    limited = set()
    for task, group, label, limit in rows[["task", "group", "setting", "limit"]].itertuples(
        index=False
    ):
        unit = task_unit(task, group, groups)
        units.setdefault(label, set()).add(unit)
        if pd.notna(limit):
            limited.add(unit)
    text = "; ".join(f"{label}: {', '.join(sorted(u))}" for label, u in sorted(units.items()))
    return text, ";".join(sorted(limited))


def _options_of(files: list[str], runs: dict[str, RunFile]) -> list[tuple[dict, dict]]:
    found: list[tuple[dict, dict]] = []
    for file in files:
        run = runs.get(file)
        if run is None or not run.options:
            continue
        pair = (run.options, run.options_requested)
        if pair not in found:
            found.append(pair)
    return found


def _mixed_text(geometry: pd.DataFrame, runs: dict[str, RunFile]) -> str:
    methods = Catalogue.installed().method_options()
    parts = []
    for metric, rows in geometry.groupby("metric", sort=True):
        files = list(dict.fromkeys(rows["file"]))
        options = [used for used, _ in _options_of(files, runs)]
        sample = frozenset().union(
            *(runs[f].catalogue.sample_options() for f in files if f in runs)
        )
        diffs = differing_options(options, sample | methods)
        if diffs:
            seen = ", ".join(f"{k}={'/'.join(map(str, v))}" for k, v in diffs.items())
            parts.append(f"{metric}: {seen}")
    return "; ".join(parts)


def row_settings(selected: pd.DataFrame, runs: list[RunFile]) -> pd.DataFrame:
    """The `ROW_SETTING_COLUMNS` of every row of ``selected`` (`newest_values`), by identity."""
    by_file = {str(run.path): run for run in runs}
    groups = scored_groups(selected)
    records, index = [], []
    for identity, rows in selected.groupby(IDENTITY, sort=False):
        settings, limited = _settings_text(rows, groups)
        geometry = rows[rows["kind"] == "geometry"]
        options = _options_of(list(dict.fromkeys(geometry["file"])), by_file)
        used = " | ".join(options_text(u, r) for u, r in options)
        records.append((settings, limited, used, _mixed_text(geometry, by_file)))
        index.append(tuple(identity))
    frame = pd.DataFrame(records, columns=ROW_SETTING_COLUMNS)
    frame.index = pd.MultiIndex.from_frame(pd.DataFrame(index, columns=IDENTITY))
    return frame


def mixed_messages(table: pd.DataFrame) -> list[str]:
    """One warning text per row whose ``mixed_settings`` is not empty."""
    messages = []
    for identity, mixed in table["mixed_settings"].items():
        if not mixed:
            continue
        model, revision, dtype = identity
        name = model if revision == "main" else f"{model}@{revision}"
        messages.append(
            f"{name} ({dtype}): the leaderboard row combines runs with different metric "
            f"options ({mixed}); each such value averages tasks measured differently. Rerun "
            "those tasks with one --metric_args to compare them."
        )
    return messages


def _outside_open_llm(selected: pd.DataFrame) -> list[str]:
    """One note listing the benchmark tasks run with other shots than the Open LLM v1's."""
    parts = []
    scores = selected[(selected["kind"] == "score") & selected["primary_score"].astype(bool)]
    for task, rows in scores.groupby("task", sort=True):
        bench = benchmark_of(task)
        if bench is None:
            continue
        shots = rows.drop_duplicates(IDENTITY)["shots"]
        other = shots[shots.isna() | (shots != bench.shots)]
        if len(other):
            seen = "/".join(sorted({"unknown" if pd.isna(s) else f"{int(s)}" for s in other}))
            parts.append(
                f"{task} {seen}-shot on {len(other)} row(s) (v1: {bench.shots}-shot, "
                f"column '{bench.column}')"
            )
    if not parts:
        return []
    return [
        "Benchmark tasks run outside the Open LLM v1 setting: "
        + "; ".join(parts)
        + ". Their scores are in score:<task>:<metric> columns, not in the benchmark "
        "columns or the average."
    ]


def setting_notes(board: pd.DataFrame, selected: pd.DataFrame) -> list[str]:
    """Notes for ``summary.md`` on settings.

    Benchmark runs outside the Open LLM v1 setting, ``--limit`` rows, and each
    K that a model changed (asked vs used).
    """
    notes = _outside_open_llm(selected)
    limited = board[board["limited"].fillna("") != ""] if "limited" in board else board.iloc[:0]
    if len(limited):
        notes.append(
            f"{len(limited)} row(s) have values measured on a --limit subset of documents "
            "(column 'limited'): they are estimates on a few documents, not full benchmark "
            "scores."
        )
    for column in [c for c in board.columns if c.endswith("__k_used")]:
        metric = column.removesuffix("__k_used")
        asked = metric.rsplit("_k", 1)[-1]
        used = board[column].dropna().astype(str)
        changed = sorted({u for u in used if u and u != asked})
        if changed:
            notes.append(
                f"{metric}: K asked {asked}, used {', '.join(changed)} on some models "
                f"(K is capped at d_model - 1; see {column})."
            )
    return notes


def cross_row_messages(selected: pd.DataFrame) -> list[str]:
    """One message per task measured in different settings on different rows."""
    messages = []
    per_row = selected.drop_duplicates([*IDENTITY, "task"])
    for task, rows in per_row.groupby("task", sort=True):
        counts = rows["setting"].value_counts()
        if len(counts) > 1:
            seen = ", ".join(f"{label} ({n} row(s))" for label, n in sorted(counts.items()))
            messages.append(
                f"task {task} was measured in different settings on different rows: {seen}; "
                "its score column and the geometry means over it compare models measured "
                "differently (see the 'settings' column)."
            )
    return messages
