"""The README's run command, ``lm-coupling demo``: five bundled models, bundled tasks, lm_eval."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from chance import chance_threshold
from scorer import loglikelihoods
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm_coupling.demo.assets import bundled_model_path, independent_model_paths

pytestmark = pytest.mark.slow
INDEPENDENT = [path.name for path in independent_model_paths()]

# Offline multiple-choice task -> accuracy of a guess.
MULTIPLE_CHOICE = {
    "lmc_arc_easy_offline": 0.25,
    "lmc_arc_challenge_offline": 0.25,
    "lmc_winogrande_offline": 0.5,
    "lmc_hellaswag_offline": 0.25,
}
MMLU_SUBTASKS = {
    "lmc_mmlu_offline_astronomy": "astronomy",
    "lmc_mmlu_offline_high_school_biology": "high_school_biology",
    "lmc_mmlu_offline_elementary_mathematics": "elementary_mathematics",
}
GEOMETRY = ("lss", "expodistance", "equidistance", "logit_lens_entropy")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    out = root / "results"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("LM_COUPLING_DATA_DIR", None)
    # --no-real: the bundled models alone (SmolLM2's demo run is tests/real's)
    command = [sys.executable, "-m", "lm_coupling", "demo", "--no-real", "--out", str(out)]
    # Run outside the checkout, so that `-m` imports the installed package, as the test does.
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    (root / "stdout.txt").write_text(done.stdout)
    (root / "stderr.txt").write_text(done.stderr)
    (results,) = out.glob("tiny-gpt2/results_*.json")  # folders are named after the model
    return out, json.loads(results.read_text())


def test_bundled_model_beats_chance_through_lm_eval(demo_run):
    _, data = demo_run
    results, n_samples = data["results"], data["n-samples"]
    # The bundled model, from whichever copy of the package the run imported.
    evaluated = Path(data["config"]["model_args"]["pretrained"])
    assert evaluated.parts[-4:] == bundled_model_path().parts[-4:]
    weights = "model.safetensors"
    assert (evaluated / weights).read_bytes() == (bundled_model_path() / weights).read_bytes()
    for task, chance in MULTIPLE_CHOICE.items():
        n = n_samples[task]["effective"]
        assert n >= 20, task
        hits = round(results[task]["acc,none"] * n)
        assert hits >= chance_threshold(n, chance), (task, hits, n)
    # The MMLU format (answer with the option's letter) stays near chance at this scale (see
    # README, "A model family trained here"): every held-out item is scored (10 per subject),
    # but no accuracy is expected of it.
    for task in MMLU_SUBTASKS:
        assert n_samples[task] == {"original": 10, "effective": 10}, task
    # Generated answers: a guessed number is almost never right, so any exact match counts.
    assert results["lmc_gsm8k_offline"]["exact_match,flexible-extract"] > 0


def _gold(sample: dict) -> int:
    """Index of the right choice (WinoGrande's samples record the shared continuation)."""
    if "option1" in sample["doc"]:
        return int(sample["doc"]["answer"]) - 1
    return int(sample["target"])


def test_lm_eval_loglikelihoods_match_the_demo_scorer(demo_run):
    """lm-eval's per-choice log-likelihoods (samples files) equal an independent scorer's.

    `scorer.loglikelihoods` gets lm-eval's own requests (few-shot contexts
    included), scores each alone without padding, and must agree.
    """
    out, _ = demo_run
    model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path(), local_files_only=True)
    for task in (*MULTIPLE_CHOICE, *MMLU_SUBTASKS):
        (path,) = out.glob(f"tiny-gpt2/samples_{task}_*.jsonl")
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        assert samples, task
        for sample in samples:
            pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
            theirs = [float(resp[0][0]) for resp in sample["resps"]]
            ours = loglikelihoods(model.eval(), tokenizer, pairs)
            assert ours == pytest.approx(theirs, abs=1e-4), (task, sample["doc_id"])
            assert sample["acc"] == float(int(np.argmax(ours)) == _gold(sample)), task


def test_geometry_sits_beside_accuracy_and_in_the_leaderboard(demo_run):
    out, data = demo_run
    for task in (*MULTIPLE_CHOICE, *MMLU_SUBTASKS, "lmc_gsm8k_offline"):
        for metric in GEOMETRY:
            # Geometry does not depend on lm-eval's answer filters: one filter carries it
            # (GSM8K scores one generation under two filters).
            keys = [k for k in data["results"][task] if k.split(",")[0] == metric]
            assert len(keys) == 1, (task, metric, keys)
            assert math.isfinite(data["results"][task][keys[0]]), (task, metric)
    assert any("coupling,none" in data["results"][task] for task in MULTIPLE_CHOICE)
    board = pd.read_csv(out / "leaderboard.csv")
    board = board[board["model"].str.endswith("tiny-gpt2")].reset_index(drop=True)
    assert len(board) == 1 and 0.0 < board.loc[0, "coupling_k10"] <= 1.0  # named after its K
    # The demo's few-shot setting is not the Open LLM v1 one: only 0-shot TruthfulQA fills
    # its v1 column; the other tasks have columns of their own (docs/report.md, Settings).
    assert math.isfinite(board.loc[0, "truthfulqa"])
    assert math.isfinite(board.loc[0, "score:lmc_arc_challenge_offline:acc_norm"])
    assert (out / "report" / "summary.md").exists()


def test_every_demo_document_is_captured_in_lm_evals_batches(demo_run):
    _, data = demo_run
    capture = data["config"]["lm_coupling"]["capture"]
    assert set(capture) >= {*MULTIPLE_CHOICE, *MMLU_SUBTASKS, "lmc_gsm8k_offline"}
    for task, counts in capture.items():
        n_docs = data["n-samples"][task]["effective"]
        assert counts == {"in_batch": n_docs, "alone": 0, "cached": 0, "failed": 0}, task


def test_demo_prints_the_table_names_folders_and_describes_its_data(demo_run):
    """The quick start shows lm-eval's table with the geometry rows (issue 27, items 6, 10)."""
    out, _ = demo_run
    stdout = (out.parent / "stdout.txt").read_text()
    table = stdout.replace(" ", "")
    assert "|Tasks|Version|Filter|n-shot|Metric|" in table  # lm-eval's own table (make_table)
    for metric in ("acc", "lss", "coupling", "logit_lens_entropy"):
        assert f"|{metric}|" in table, metric
    # Every model's folder is named after the model, not its absolute site-packages path.
    folders = {
        p.name
        for p in out.iterdir()
        if p.is_dir() and p.name != "report" and not p.name.startswith(".")  # the report index
    }
    assert folders == {"tiny-gpt2", *INDEPENDENT}
    for name in folders:  # one table per model
        assert f"\n{name}:\n" in stdout, name
    summary = (out / "report" / "summary.md").read_text()
    assert "What the demo's data is" in summary and "invented world" in summary
    assert "Models (5)" in summary and "Documents per task and model:" in summary


def test_default_demo_fits_across_five_independent_models(demo_run):
    """The report's primary test is a real fit across the five bundled models (issue 27 item 6)."""
    out, _ = demo_run
    board = pd.read_csv(out / "leaderboard.csv")
    names = {Path(model).name for model in board["model"]}
    assert names == {"tiny-gpt2", *INDEPENDENT}, names
    correlations = pd.read_csv(out / "report" / "correlations.csv")
    (primary,) = correlations[correlations["primary"]].itertuples()
    assert (primary.metric, primary.target, primary.n) == ("coupling_k10", "truthfulqa", 5)
    assert math.isfinite(primary.slope) and 0.0 <= primary.p_hc3 <= 1.0
    # The fit is the OLS line through the leaderboard's five points.
    points = board[["coupling_k10", "truthfulqa"]].to_numpy(dtype=float)
    slope, intercept = np.polyfit(points[:, 0], points[:, 1], 1)
    assert primary.slope == pytest.approx(slope, rel=1e-6)
    assert primary.intercept == pytest.approx(intercept, rel=1e-6, abs=1e-9)
    summary = (out / "report" / "summary.md").read_text()
    assert "Primary test: across 5 independent models" in summary
    assert "fewer than 5 models" not in summary.split("## Primary test")[1].split("##")[0]


def test_printed_paths_exist_after_the_folders_are_renamed(demo_run):
    """Every file the demo names (``-> <geometry file>``) is where it says, after the renames."""
    out, _ = demo_run
    stderr = (out.parent / "stderr.txt").read_text()
    named = [line.rsplit(" -> ", 1)[1].strip() for line in stderr.splitlines() if " -> " in line]
    assert named, stderr[-2000:]
    assert all(Path(path).is_file() for path in named), named
    assert all(Path(path).parent.parent == out for path in named), named
