"""`lm-coupling sweep` over two checkpoints of one training run through the real lm_eval.

Interrupted after the first model and rerun, it ends with the same report as
an uninterrupted sweep; a deliberately broken model is recorded and skipped;
the report treats the checkpoints as one model's series.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def family(trained_family):
    root = trained_family  # holds fam/, trained once per test run (tests/conftest.py)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{this is not json")
    return root


def sweep(root, out, *extra):
    models = f"{root}/fam/tiny/step{{0,1200}},{root}/broken"
    command = [sys.executable, "-m", "lm_coupling", "sweep", models]
    command += ["--tasks", "lmc_hellaswag_offline", "--output_path", str(out), "--limit", "2"]
    command += ["--metrics", "coupling,lss", "--model_args", "dtype=float32", "--quiet"]
    command += ["--metadata", json.dumps({"lmc_data_dir": str(root / "fam" / "tasks_data")})]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("LM_COUPLING_DATA_DIR", None)
    done = subprocess.run(
        [*command, *extra], env=env, capture_output=True, text=True, timeout=1800, cwd=root
    )
    return done


def leaderboard(out):
    return pd.read_csv(out / "report" / "leaderboard.csv").sort_values(["model", "revision"])


def test_interrupted_and_resumed_sweep_equals_an_uninterrupted_one(family):
    resumed = family / "resumed"
    first = sweep(family, resumed, "--max-models", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopped after 1 model" in first.stderr
    assert len(list(resumed.rglob("results_*.json"))) == 1
    assert not (resumed / "report").exists()

    second = sweep(family, resumed)
    assert second.returncode == 1, second.stderr[-3000:]  # the broken model failed
    assert "step0: complete in the folder, skipped" in second.stderr
    assert len(list(resumed.rglob("results_*.json"))) == 2  # step0 was not run again
    status = pd.read_csv(resumed / "sweep_status.csv").set_index("model")
    assert status.loc[f"{family}/broken", "status"] == "failed"
    assert "not a valid JSON" in status.loc[f"{family}/broken", "error"]
    assert set(status.loc[status["status"] == "done"].index) == {
        f"{family}/fam/tiny/step0",
        f"{family}/fam/tiny/step1200",
    }

    whole = family / "whole"
    uninterrupted = sweep(family, whole)
    assert uninterrupted.returncode == 1, uninterrupted.stderr[-3000:]
    board = leaderboard(resumed)
    assert list(board["revision"]) == ["step0", "step1200"]
    score = "score:lmc_hellaswag_offline:acc_norm"  # 0-shot: not the Open LLM v1 setting
    assert board[["coupling_k10", "lss", score]].notna().all().all()  # K in the name
    assert (board["n_benchmarks"] == 0).all() and board["average"].isna().all()
    pd.testing.assert_frame_equal(
        board.reset_index(drop=True), leaderboard(whole).reset_index(drop=True)
    )
    # Training moved the weights, and with them the hidden-state geometry.
    first, last = board[["coupling_k10", "lss"]].to_numpy()
    assert (first != last).any()
    # Two checkpoints of one run are n = 1 model, with a series of their own and no
    # p-value (issue 27, item 7): checkpoints.csv and emergence.png, the last step taken.
    report = whole / "report"
    summary = (report / "summary.md").read_text()
    assert "2 model rows, n = 1 independent model (" in summary
    assert "the statistics take step1200" in summary
    assert (pd.read_csv(report / "correlations.csv")["n"] <= 1).all()
    series = pd.read_csv(report / "checkpoints.csv")
    assert sorted(series["step"].unique()) == [0, 1200]
    assert set(series.loc[series["across_models"], "revision"]) == {"step1200"}
    assert (report / "figures" / "emergence.png").stat().st_size > 1000
