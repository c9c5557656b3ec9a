"""Across-model correlations of geometry with benchmark scores.

Every function returns a tidy DataFrame with the columns listed in its
docstring (``CORRELATION_COLUMNS``). Estimator: OLS of the score on the metric
with HC3 heteroskedasticity-robust errors (``estimator = "OLS-HC3"``); the
p-values of the whole family are adjusted with Holm's step-down method
(``correction = "holm"``). The bootstrap resamples models with replacement
(``numpy.random.default_rng(seed)``, ``N_BOOT`` draws) and gives the
percentile 95% interval of the OLS slope; draws whose metric column is
constant are dropped (``n_boot`` counts the draws kept).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import statsmodels.api as sm
from scipy import stats
from statsmodels.stats.multitest import multipletests

from lm_coupling.report.benchmarks import SCHEMA_VERSION

N_BOOT = 2000
MIN_MODELS = 3
ESTIMATOR = "OLS-HC3"
CORRECTION = "holm"
FIT_COLUMNS = [
    "n",
    "slope",
    "intercept",
    "r2",
    "pearson_r",
    "p_hc3",
    "ci_low",
    "ci_high",
    "spearman_rho",
    "spearman_p",
    "kendall_tau",
    "kendall_p",
    "boot_ci_low",
    "boot_ci_high",
    "n_boot",
]
CORRELATION_COLUMNS = [
    "schema_version",
    "metric",
    "target",
    *FIT_COLUMNS,
    "p_holm",
    "primary",
    "estimator",
    "correction",
    "reason",
]


def paired(x: pd.Series, y: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """The models where both columns are finite, as float arrays."""
    xv = pd.to_numeric(x, errors="coerce").to_numpy(dtype=float)
    yv = pd.to_numeric(y, errors="coerce").to_numpy(dtype=float)
    keep = np.isfinite(xv) & np.isfinite(yv)
    return xv[keep], yv[keep]


def skip_reason(x: np.ndarray, y: np.ndarray, min_n: int = MIN_MODELS) -> str:
    """Why a fit cannot be made ("" when it can)."""
    if len(x) < min_n:
        return f"fewer than {min_n} models with both values (n={len(x)})"
    if np.ptp(x) == 0:
        return "metric is constant across models"
    if np.ptp(y) == 0:
        return "score is constant across models"
    return ""


def ols_hc3(x: np.ndarray, y: np.ndarray):
    """``statsmodels`` OLS of y on [1, x] with HC3 errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sm.OLS(y, sm.add_constant(x, has_constant="add")).fit(cov_type="HC3")


def bootstrap_slope(x: np.ndarray, y: np.ndarray, seed: int, n_boot: int = N_BOOT):
    """Percentile 95% interval of the OLS slope over models resampled with replacement.

    Returns:
        ``(low, high, n_kept)``; NaN bounds when no draw had a varying metric.
    """
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    xs, ys = x[idx], y[idx]
    xc = xs - xs.mean(axis=1, keepdims=True)
    sxx = (xc**2).sum(axis=1)
    ok = sxx > 1e-12 * max(1.0, float(np.max(x**2)))
    slopes = (xc[ok] * (ys[ok] - ys[ok].mean(axis=1, keepdims=True))).sum(axis=1) / sxx[ok]
    if not len(slopes):
        return math.nan, math.nan, 0
    low, high = np.percentile(slopes, [2.5, 97.5])
    return float(low), float(high), int(ok.sum())


def fit_pair(x: np.ndarray, y: np.ndarray, seed: int = 0) -> dict[str, float]:
    """All across-model statistics of y against x (``FIT_COLUMNS`` plus ``reason``).

    Returns:
        A dict; statistics are NaN and ``reason`` says why when the pair
        cannot be fitted (fewer than 3 models, or a constant column).
    """
    out: dict[str, float | str] = {c: math.nan for c in FIT_COLUMNS}
    out["n"] = len(x)
    out["reason"] = skip_reason(x, y)
    if out["reason"]:
        return out
    res = ols_hc3(x, y)
    ci = np.asarray(res.conf_int(alpha=0.05))[1]
    rho, rho_p = stats.spearmanr(x, y)
    tau, tau_p = stats.kendalltau(x, y)
    low, high, kept = bootstrap_slope(x, y, seed)
    out.update(
        slope=res.params[1],
        intercept=res.params[0],
        r2=res.rsquared,
        pearson_r=float(np.corrcoef(x, y)[0, 1]),
        p_hc3=res.pvalues[1],
        ci_low=ci[0],
        ci_high=ci[1],
        spearman_rho=rho,
        spearman_p=rho_p,
        kendall_tau=tau,
        kendall_p=tau_p,
        boot_ci_low=low,
        boot_ci_high=high,
        n_boot=kept,
    )
    return {k: (float(v) if k not in ("reason",) else v) for k, v in out.items()}


def holm(p_values: pd.Series) -> pd.Series:
    """Holm-adjusted p-values over the finite entries (NaN stays NaN)."""
    out = pd.Series(np.nan, index=p_values.index)
    finite = p_values.notna() & np.isfinite(p_values.astype(float))
    if finite.any():
        out[finite] = multipletests(p_values[finite].astype(float), method="holm")[1]
    return out


def resolve_primary(metrics: list[str], primary: str) -> str | None:
    """The metric column the primary test uses: ``primary`` itself, else the first ``primary_*``."""
    if primary in metrics:
        return primary
    return next((m for m in metrics if m.startswith(f"{primary}_")), None)


def correlations(
    board: pd.DataFrame,
    metrics: list[str],
    targets: list[str],
    primary: str = "coupling",
    seed: int = 0,
) -> pd.DataFrame:
    """Every geometry metric against every benchmark and the average.

    Args:
        board: the leaderboard, one row per model.
        metrics: geometry columns.
        targets: score columns (benchmarks, ``average``).
        primary: metric of the primary test (against ``average``).
        seed: bootstrap seed (the same seed for every pair).

    Returns:
        ``CORRELATION_COLUMNS``; ``p_holm`` adjusts ``p_hc3`` over all rows.
    """
    rows = []
    main = resolve_primary(metrics, primary)
    for metric in metrics:
        for target in targets:
            x, y = paired(board[metric], board[target])
            row = dict(metric=metric, target=target, **fit_pair(x, y, seed))
            row["primary"] = metric == main and target == "average"
            rows.append(row)
    table = pd.DataFrame(rows, columns=[c for c in CORRELATION_COLUMNS if c != "schema_version"])
    table["p_holm"] = holm(table["p_hc3"])
    table["primary"] = table["primary"].astype(bool)
    table = table.assign(schema_version=SCHEMA_VERSION, estimator=ESTIMATOR, correction=CORRECTION)
    table["reason"] = table["reason"].fillna("")
    return table[CORRELATION_COLUMNS]
