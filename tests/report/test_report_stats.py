"""Synthetic-only unit tests of the report's statistics, boundary and naming rules."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from lm_coupling.report.benchmarks import benchmark_of, parse_step
from lm_coupling.report.boundary import boundary_depth, boundary_layer
from lm_coupling.report.controls import controls_table
from lm_coupling.report.stats import CORRELATION_COLUMNS, correlations, holm


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
    board = _board().assign(flat=1.0, partial=[0.1, np.nan, 0.3, np.nan, np.nan, np.nan, 0.2, 0.5])
    table = correlations(board, ["flat", "partial", "noisy"], ["average"]).set_index("metric")
    assert "constant" in table.loc["flat", "reason"] and math.isnan(table.loc["flat", "slope"])
    assert table.loc["partial", "n"] == 4 and table.loc["partial", "reason"] == ""
    assert math.isfinite(table.loc["noisy", "p_holm"])
    assert math.isnan(table.loc["flat", "p_holm"])


def test_fewer_than_three_models():
    table = correlations(_board().head(2), ["coupling"], ["average"])
    assert table.iloc[0]["reason"].startswith("fewer than 3") and table.iloc[0]["n"] == 2


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
