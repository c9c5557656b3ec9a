"""Synthetic-only unit tests of the report's statistics, boundary and naming rules."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import statsmodels.api as sm
from statsmodels.stats.outliers_influence import OLSInfluence

from lm_coupling.report.benchmarks import benchmark_of, parse_step
from lm_coupling.report.boundary import boundary_depth, boundary_layer
from lm_coupling.report.controls import controls_table
from lm_coupling.report.loading import _split_local_checkpoint, display_names, k_setting_name
from lm_coupling.report.stats import (
    CORRELATION_COLUMNS,
    MIN_MODELS,
    cooks_distance,
    correlations,
    holm,
)


def _board(n=8, seed=0):
    rng = np.random.default_rng(seed)
    x = np.linspace(0.2, 0.9, n)
    return pd.DataFrame(
        dict(
            model=[f"m{i}" for i in range(n)],
            coupling=x,
            average=0.1 + 0.5 * x,
            noisy=x + rng.normal(0, 0.1, n),
            n_params=10 ** rng.uniform(6, 9, n),
            n_layers=rng.integers(2, 30, n),
            d_model=rng.integers(64, 4096, n),
        )
    )


def test_exact_linear_data_gives_exact_fit():
    table = correlations(_board(), ["coupling"], ["average"])
    row = table.iloc[0]
    assert list(table.columns) == CORRELATION_COLUMNS
    assert row["slope"] == pytest.approx(0.5, abs=1e-12)
    assert row["intercept"] == pytest.approx(0.1, abs=1e-12)
    assert row["r2"] == pytest.approx(1.0, abs=1e-12)
    assert row["spearman_rho"] == pytest.approx(1.0) and row["kendall_tau"] == pytest.approx(1.0)
    assert row["boot_ci_low"] == pytest.approx(0.5) and row["boot_ci_high"] == pytest.approx(0.5)
    assert bool(row["primary"]) and row["estimator"] == "OLS-HC3" and row["correction"] == "holm"


def test_constant_and_missing_columns_are_skipped_with_reason():
    board = _board().assign(flat=1.0, partial=[0.1, np.nan, 0.3, np.nan, 0.4, np.nan, 0.2, 0.5])
    table = correlations(board, ["flat", "partial", "noisy"], ["average"]).set_index("metric")
    assert "constant" in table.loc["flat", "reason"] and math.isnan(table.loc["flat", "slope"])
    assert table.loc["partial", "n"] == 5 and table.loc["partial", "reason"] == ""
    assert math.isfinite(table.loc["noisy", "p_holm"])
    assert math.isnan(table.loc["flat", "p_holm"])


def test_fewer_than_minimum_models_has_no_p_value():
    table = correlations(_board().head(MIN_MODELS - 1), ["coupling", "noisy"], ["average"])
    assert MIN_MODELS == 5
    assert table["reason"].str.startswith("fewer than 5 models").all()
    assert table[["p_hc3", "p_holm", "spearman_p", "kendall_p", "r2"]].isna().all().all()
    full = correlations(_board().head(MIN_MODELS), ["coupling"], ["average"]).iloc[0]
    assert full["reason"] == "" and math.isfinite(full["p_holm"])


def test_cooks_distance_matches_statsmodels_and_flags_one_point_fits():
    rng = np.random.default_rng(3)
    x = rng.normal(size=10)
    y = 0.3 * x + rng.normal(0, 0.2, 10)
    expected = OLSInfluence(sm.OLS(y, sm.add_constant(x)).fit()).cooks_distance[0]
    np.testing.assert_allclose(cooks_distance(x, y), expected, rtol=1e-8)
    board = pd.DataFrame(dict(model=[f"m{i}" for i in range(10)], x=x, y=y))
    row = correlations(board, ["x"], ["y"], "x").iloc[0]
    assert not row["influential"] and not row["x_log_scale"]
    x_far = np.r_[3.7e5, np.linspace(0.9, 1.1, 9)]  # expodistance at initialisation
    y_far = np.r_[0.25, 0.5 + 0.01 * rng.normal(size=9)]
    far = correlations(pd.DataFrame(dict(model=board["model"], x=x_far, y=y_far)), ["x"], ["y"])
    row = far.iloc[0]
    assert row["influential"] and row["cooks_d_model"] == "m0" and row["x_log_scale"]
    assert row["r2"] > 0.9 and row["r2_without"] < 0.5


@pytest.mark.parametrize(
    "models, expected",
    [
        (["/a/runs/fam/tiny", "/b/x/fam/small"], ["fam/tiny", "fam/small"]),
        (["/a/one/fam/tiny", "/b/two/fam/tiny"], ["one/fam/tiny", "two/fam/tiny"]),
        (["EleutherAI/pythia-160m", "/scratch/EleutherAI/pythia-160m"], None),
        (["gpt2", "./models/gpt2"], ["gpt2", "models/gpt2"]),
    ],
)
def test_display_names_are_unique_tails(models, expected):
    names = display_names(models)
    assert len(set(names.values())) == len(models)  # never merged
    if expected is not None:
        assert [names[m] for m in models] == expected
    else:
        assert names["EleutherAI/pythia-160m"] == "EleutherAI/pythia-160m"


@pytest.mark.parametrize(
    "path, expected",
    [
        ("/runs/fam/tiny/step512", ("/runs/fam/tiny", "step512")),
        ("/runs/out/checkpoint-2000", ("/runs/out", "checkpoint-2000")),
        ("/runs/out/global_step100", ("/runs/out", "global_step100")),
        ("/runs/model_step5_final", ("/runs/model_step5_final", "main")),
        ("/runs/steps", ("/runs/steps", "main")),
    ],
)
def test_local_checkpoint_rule(path, expected):
    assert _split_local_checkpoint(path, "main") == expected


def test_k_setting_names():
    assert k_setting_name("coupling", {"k": 10}) == "coupling_k10"
    assert k_setting_name("coupling", {"k": 0.1}) == "coupling_k0.1"
    assert k_setting_name("alignment_ratio", {"alignment_k": 30}) == "alignment_ratio_k30"
    assert k_setting_name("coupling", {}) == "coupling"
    assert k_setting_name("lss", {"k": 10}) == "lss"


def test_holm_matches_hand_computation():
    p = pd.Series([0.01, 0.04, np.nan, 0.03])
    # sorted 0.01, 0.03, 0.04 -> 3*0.01, max(0.03, 2*0.03), max(0.06, 1*0.04)
    np.testing.assert_allclose(holm(p).to_numpy(), [0.03, 0.06, np.nan, 0.06])


def test_controls_skip_when_too_few_models_and_fill_when_enough():
    small = controls_table(_board(5), ["noisy"])
    partial = small[small["analysis"] == "partial"].iloc[0]
    assert "too few models" in partial["reason"]
    big = controls_table(_board(12), ["noisy"]).set_index("analysis")
    assert big.loc["partial", "df"] == 12 - 2 - 3
    assert big.loc["nested", "r2_full"] >= big.loc["nested", "r2_controls"]
    assert big.loc["exponential", "exp_a"] > 0


def test_boundary_midpoint_rule():
    profile = [0.9, 1.0, 0.9, 0.4, 0.2, 0.2]  # max 1.0 at l=1, final 0.2, midpoint 0.6
    assert boundary_layer(profile) == 3.0
    assert boundary_depth(profile) == pytest.approx(3 / 5)
    assert math.isnan(boundary_layer([0.5, 0.5, 0.5]))


@pytest.mark.parametrize(
    "revision, step",
    [
        ("step1000", 1000),
        ("checkpoint-2000", 2000),
        ("step_3000", 3000),
        ("main", None),
        ("runs/checkpoint-50", 50),
    ],
)
def test_parse_step(revision, step):
    assert parse_step(revision) == step


def test_benchmark_of_offline_names():
    assert benchmark_of("lmc_arc_challenge_offline").column == "arc"
    assert benchmark_of("truthfulqa_mc2").metric == "acc"
    assert benchmark_of("arc_easy") is None
