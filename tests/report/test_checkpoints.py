"""Checkpoint series are not independent models (issue 27, item 7).

Across-model statistics count one row per model (its last checkpoint by
default); a series gets ``checkpoints.csv`` and ``emergence.png`` instead,
with no p-value.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from make_results import model_rows, write_row

from lm_coupling.report import ReportInputError, build_report
from lm_coupling.report.checkpoints import independent_rows, revision_order, series_table
from lm_coupling.report.stats import correlations

STEPS = [0, 1, 2, 4, 8, 16, 32, 64]


def _board(steps=STEPS) -> pd.DataFrame:
    """Two runs x len(steps) checkpoints (rows deliberately out of step order), then 5 models."""
    rows = []
    for run, slope in (("fam/tiny", 0.004), ("fam/small", 0.003)):
        for step in reversed(steps):
            rows.append(
                dict(model=run, revision=f"step{step}", dtype="float32",
                     coupling=0.6 + slope * step, average=0.25 + 0.005 * step)
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_series_count_once_and_take_their_last_checkpoint():
    board = _board()
    chosen = independent_rows(board)
    assert chosen.n_models == 2 and set(chosen.series) == {"fam/tiny", "fam/small"}
    taken = board.loc[chosen.used]
    assert set(taken["revision"]) == {"step64"}  # the last step, not the last row
    first = board.loc[independent_rows(board, "first").used]
    assert set(first["revision"]) == {"step0"}
    named = board.loc[independent_rows(board, "step8").used]
    assert set(named["revision"]) == {"step8"}
    with pytest.raises(ReportInputError, match="no such revision in 2 checkpoint series"):
        independent_rows(board, "step3")
    # Across the 16 rows a fit would be "significant"; across the 2 models there is none.
    fit = correlations(board.loc[chosen.used], ["coupling"], ["average"]).iloc[0]
    assert fit["n"] == 2 and math.isnan(fit["p_hc3"]) and "fewer than 5" in fit["reason"]


def test_main_is_the_last_revision_and_dtypes_of_one_model_are_one_model():
    assert sorted(["main", "step10", "v2", "step2"], key=revision_order) == [
        "step2", "step10", "v2", "main",
    ]  # fmt: skip
    board = pd.DataFrame(
        dict(
            model=["a", "a", "a", "b"],
            revision=["main", "main", "step5", "main"],
            dtype=["float32", "bfloat16", "float32", "auto"],
        )
    )
    chosen = independent_rows(board)
    assert chosen.n_models == 2
    assert board.loc[chosen.used, ["model", "revision", "dtype"]].values.tolist() == [
        ["a", "main", "bfloat16"],  # the last revision; of its dtypes the first by name
        ["b", "main", "auto"],
    ]


def test_series_table_has_every_checkpoint_and_marks_the_one_taken():
    board = _board()
    table = series_table(board, independent_rows(board), ["average", "coupling"])
    assert len(table) == 2 * len(STEPS) * 2
    for run, group in table[table["quantity"] == "coupling"].groupby("model"):
        group = group.sort_values("position")
        assert group["step"].tolist() == STEPS  # in step order, whatever the row order
        assert group["across_models"].tolist() == [False] * (len(STEPS) - 1) + [True]
        source = board[board["model"] == run].set_index("revision")["coupling"]
        np.testing.assert_array_equal(group["value"], source.loc[[f"step{s}" for s in STEPS]])
    assert not [c for c in table.columns if c == "p" or c.startswith("p_")]  # no p-value


@pytest.mark.slow
def test_report_of_two_runs_of_eight_checkpoints_counts_two_models(real_runs, tmp_path):
    """A synthetic results folder: two runs x 8 checkpoints (real lm_eval files, cloned)."""
    base = model_rows(real_runs, 4)
    day = 0
    for run, quality in ((base[0], 0.0), (base[1], 0.1)):
        for i, step in enumerate(STEPS):
            q = 0.1 + quality + 0.08 * i
            row = dict(run, revision=f"step{step}", q=q, acc_norm=min(1.0, 0.2 + 0.6 * q))
            day += 1
            write_row(tmp_path, row["run"], row, f"2025-03-{day:02d}T10-00-00.000000")
    result = build_report(tmp_path)
    assert len(result.leaderboard) == 16 and result.n_independent == 2
    summary = result.summary.read_text()
    assert "16 model rows, n = 2 independent models" in summary
    assert "## Checkpoints" in summary and "the statistics take step64" in summary
    corr = pd.read_csv(result.out_dir / "correlations.csv")
    assert (corr["n"] <= 2).all() and corr["p_hc3"].isna().all()
    assert "p = " not in summary  # no p-value anywhere in the summary
    table = pd.read_csv(result.out_dir / "checkpoints.csv")
    taken = table[table["across_models"]]
    assert set(taken["revision"]) == {"step64"} and taken["model"].nunique() == 2
    assert set(table["step"]) == set(STEPS)
    names = {p.name for p in result.figures}
    assert "emergence.png" in names
    assert (result.out_dir / "figures" / "emergence.png").stat().st_size > 1000
