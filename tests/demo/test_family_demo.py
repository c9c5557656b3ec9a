"""``lm-coupling demo --family``: every checkpoint through the real lm_eval, then the report."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pandas as pd
import pytest

pytestmark = pytest.mark.slow

GEOMETRY = ("coupling_k10", "lss", "expodistance")  # coupling is named after its K


@pytest.fixture(scope="module")
def family_report(trained_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    family = trained_family / "fam"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("LM_COUPLING_DATA_DIR", None)
    command = [sys.executable, "-m", "lm_coupling", "demo", "--family", str(family)]
    command += ["--limit", "2"]  # results go to <family>/results by default
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not (root / "results").exists()
    return family / "results" / "report", done.stdout


def test_every_checkpoint_is_a_leaderboard_row_with_its_step(family_report):
    report, _ = family_report
    board = pd.read_csv(report / "leaderboard.csv")
    assert sorted(board["step"]) == [0, 1200]
    assert set(board["revision"]) == {"step0", "step1200"}
    assert board["model"].str.endswith("fam/tiny").all()
    # lmc_demo is 2-shot (1-shot MMLU, GSM8K): of the Open LLM v1 columns only the
    # 0-shot TruthfulQA is in its setting, so no average; the others are score: columns.
    assert board["average"].isna().all() and (board["n_benchmarks"] == 1).all()
    for column in ("truthfulqa", "score:lmc_arc_challenge_offline:acc_norm", *GEOMETRY):
        assert board[column].map(math.isfinite).all(), column
    # Training moved the weights, and with them the hidden-state geometry.
    first, last = board.sort_values("step")[list(GEOMETRY)].to_numpy()
    assert (first != last).any()


def test_report_draws_geometry_and_accuracy_over_training(family_report):
    report, stdout = family_report
    assert (report / "figures" / "emergence.png").stat().st_size > 1000
    assert not (report / "figures" / "emergence.svg").exists()  # PNG alone by default
    assert "emergence" in (report / "summary.md").read_text()
    assert str(report) in stdout


def test_checkpoints_of_one_run_are_one_model_with_a_series_of_their_own(family_report):
    """Issue 27, item 7: two checkpoints of one run are n = 1 model, not 2, and no p-value."""
    report, _ = family_report
    summary = (report / "summary.md").read_text()
    assert "2 model rows, n = 1 independent model (" in summary
    assert "the statistics take step1200" in summary  # the last checkpoint, named
    corr = pd.read_csv(report / "correlations.csv")
    assert (corr["n"] <= 1).all() and corr["p_hc3"].isna().all()
    series = pd.read_csv(report / "checkpoints.csv")
    assert sorted(series["step"].unique()) == [0, 1200]
    assert set(series.loc[series["across_models"], "revision"]) == {"step1200"}
