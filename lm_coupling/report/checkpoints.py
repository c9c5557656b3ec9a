"""Checkpoint series: which leaderboard rows are independent models (docs/report.md).

Rows that share ``model`` are one model. The across-model statistics count
one row per model, its last checkpoint by default (steps by step, other
revision names, then ``main``; several dtypes: the first); a series gets
``checkpoints.csv`` and ``emergence.png`` instead, with no p-value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from lm_coupling.report.benchmarks import SCHEMA_VERSION, parse_step
from lm_coupling.report.loading import ReportInputError

SERIES_COLUMNS = [
    "schema_version",
    "model",
    "revision",
    "dtype",
    "step",
    "position",
    "n_checkpoints",
    "across_models",
    "quantity",
    "value",
]


def revision_order(revision: object) -> tuple[int, float, str]:
    """Sort key of a revision within a series: steps by step, other names, then ``main`` last."""
    text = str(revision)
    step = parse_step(text)
    if step is not None:
        return (0, float(step), text)
    return (2 if text == "main" else 1, math.inf, text)


@dataclass
class Independence:
    """Which rows of a leaderboard the across-model statistics use.

    Attributes:
        rule: ``last``, ``first`` or a revision name.
        used: the leaderboard index of the rows used, one per model.
        series: per model with several rows, their index in series order.
    """

    rule: str
    used: list[int]
    series: dict[str, list[int]] = field(default_factory=dict)

    @property
    def n_models(self) -> int:
        """Independent models: the rows the across-model statistics count."""
        return len(self.used)


def independent_rows(board: pd.DataFrame, checkpoint: str = "last") -> Independence:
    """One row per model of ``board``: the ``checkpoint`` ``"last"``, ``"first"`` or a revision.

    Raises:
        ReportInputError: an empty rule, or a revision name that some series lacks.
    """
    rule = str(checkpoint).strip()
    if not rule:
        raise ReportInputError(
            "--checkpoint is empty: give last, first or a revision name such as step1000"
        )
    used, series, lacking = [], {}, []
    for model, rows in board.groupby("model", sort=False):
        pairs = zip(rows["revision"], rows["dtype"], strict=True)
        keys = [(revision_order(r), str(d)) for r, d in pairs]
        order = [i for _, i in sorted(zip(keys, rows.index, strict=True))]
        if len(order) > 1:
            series[str(model)] = order
        revisions = [str(board.at[i, "revision"]) for i in order]
        if rule in ("last", "first"):
            wanted = revisions[-1 if rule == "last" else 0]
        else:
            wanted = rule if rule in revisions or len(order) == 1 else None
        if wanted is None:
            lacking.append(f"{model} ({', '.join(dict.fromkeys(revisions))})")
        else:
            used.append(order[revisions.index(wanted)] if wanted in revisions else order[0])
    if lacking:
        raise ReportInputError(
            f"--checkpoint {rule}: no such revision in {len(lacking)} checkpoint series: "
            f"{'; '.join(lacking)}. Give last, first or a revision every series has."
        )
    return Independence(rule, sorted(used), series)


def _label(board: pd.DataFrame, index: int) -> str:
    revision, dtype = str(board.at[index, "revision"]), str(board.at[index, "dtype"])
    dtypes = board.loc[board["model"] == board.at[index, "model"], "dtype"].nunique()
    return revision + (f" ({dtype})" if dtypes > 1 else "")


def series_notes(board: pd.DataFrame, independence: Independence, shown: int = 10) -> list[str]:
    """Sentences for ``summary.md``: each series and the checkpoint the statistics took."""
    if not independence.series:
        return []
    chosen = set(independence.used)
    n_rows, n_series = len(board), len(independence.series)
    lines = [
        f"{n_rows} leaderboard rows are {independence.n_models} independent "
        f"model{'' if independence.n_models == 1 else 's'}: "
        f"{n_series} model(s) have several checkpoints (or dtypes), and checkpoints of one "
        "run are not independent samples. The across-model statistics (correlations.csv, "
        "controls.csv, the primary test, the fig1a panels) count one row per model: its "
        f"{_rule_words(independence.rule)}. Each series is drawn against the step in "
        "emergence.png and tabulated in checkpoints.csv, with no p-value."
    ]
    for model, order in list(independence.series.items())[:shown]:
        taken = next(i for i in order if i in chosen)
        revisions = list(dict.fromkeys(str(board.at[i, "revision"]) for i in order))
        listed = ", ".join(
            revisions if len(revisions) <= 6 else [*revisions[:3], "...", *revisions[-2:]]
        )
        lines.append(
            f"{model}: {len(order)} rows ({listed}); the statistics take {_label(board, taken)}."
        )
    if n_series > shown:
        lines.append(f"... and {n_series - shown} more series (checkpoints.csv, `across_models`).")
    return lines


def _rule_words(rule: str) -> str:
    if rule == "last":
        return "last checkpoint (`main` counts as the last; `--checkpoint` to choose another)"
    if rule == "first":
        return "first checkpoint (`--checkpoint first`)"
    return f"revision {rule} (`--checkpoint {rule}`)"


def series_table(
    board: pd.DataFrame, independence: Independence, quantities: list[str]
) -> pd.DataFrame:
    """``checkpoints.csv``: every checkpoint of every series, one row per quantity (docs/report.md).

    Missing values are left out; no statistic across checkpoints is computed.
    """
    chosen = set(independence.used)
    rows = []
    for order in independence.series.values():
        for position, index in enumerate(order, start=1):
            model, revision, dtype = board.loc[index, ["model", "revision", "dtype"]]
            head = (model, revision, dtype, parse_step(str(revision)), position, len(order))
            for quantity in quantities:
                value = pd.to_numeric(board.at[index, quantity], errors="coerce")
                if pd.notna(value):
                    rows.append((*head, index in chosen, quantity, float(value)))
    table = pd.DataFrame(rows, columns=[c for c in SERIES_COLUMNS if c != "schema_version"])
    table["step"] = table["step"].astype("Int64")
    table.insert(0, "schema_version", SCHEMA_VERSION)
    return table
