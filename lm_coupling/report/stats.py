"""Across-model correlations of geometry with benchmark scores (``correlations.csv``).

Estimator: OLS of the score on the metric with HC3 robust errors; p-values
of the whole family Holm-adjusted. The bootstrap resamples models with
replacement (``numpy.random.default_rng(seed)``, ``N_BOOT`` draws; draws with
a constant metric are dropped, ``n_boot`` counts those kept) and gives the
percentile 95% interval of the slope. Below ``MIN_MODELS`` (5) models a pair
gets no fit, p-value or Holm adjustment, and ``reason`` says why.

Influence: ``cooks_d_max`` is the largest Cook's distance (infinite at
leverage 1), ``cooks_d_model`` its model, ``influential`` whether it exceeds
``COOKS_THRESHOLD`` = 1 (Cook and Weisberg's cut-off), ``r2_without`` the R^2
refitted without that model. ``x_log_scale``: the metric is positive and
spans more than two decades (the figures use a log axis).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import stats

from lm_coupling.report.benchmarks import SCHEMA_VERSION

N_BOOT = 2000
MIN_MODELS = 5
DECADES = 2.0
COOKS_THRESHOLD = 1.0
ALPHA = 0.05  # a fit is significant when its Holm-adjusted p is below this (`significant`)
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
    "cooks_d_max",
    "cooks_d_model",
    "influential",
    "r2_without",
    "x_log_scale",
]
CORRELATION_COLUMNS = [
    "schema_version",
    "metric",
    "target",
    "task_set",
    *FIT_COLUMNS,
    "p_holm",
    "primary",
    "estimator",
    "correction",
    "reason",
]


def paired(
    x: pd.Series, y: pd.Series, labels: pd.Series | None = None
) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, list[str]]:
    """The models where both columns are finite, as float arrays (and their labels if given)."""
    xv = pd.to_numeric(x, errors="coerce").to_numpy(dtype=float)
    yv = pd.to_numeric(y, errors="coerce").to_numpy(dtype=float)
    keep = np.isfinite(xv) & np.isfinite(yv)
    if labels is None:
        return xv[keep], yv[keep]
    return xv[keep], yv[keep], [str(v) for v in np.asarray(labels)[keep]]


def spans_decades(values: np.ndarray, decades: float = DECADES) -> bool:
    """True when ``values`` are all positive and span more than ``decades`` powers of ten."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    return bool(len(values)) and values.min() > 0 and values.max() / values.min() > 10**decades


def cooks_distance(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cook's distance of each point in the OLS fit of y on [1, x].

    ``D_i = e_i^2 / (p s^2) * h_i / (1 - h_i)^2`` (p = 2 parameters, s^2 the
    residual variance, h_i the leverage), as statsmodels ``OLSInfluence``
    computes it. A point of leverage 1 (it alone fixes the slope) gets
    ``inf``; a perfect fit (s = 0) gives 0 everywhere.
    """
    import statsmodels.api as sm  # here, not at import: `lm-coupling --help` stays light

    design = sm.add_constant(x, has_constant="add")
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        res = sm.OLS(y, design).fit()
        hat = np.einsum("ij,ji->i", design, np.linalg.pinv(design))
        resid = res.resid
        dof = max(len(x) - 2, 1)
        s2 = float(resid @ resid) / dof
        if s2 <= 1e-300:
            return np.zeros(len(x))
        cooks = resid**2 / (2 * s2) * hat / (1 - hat) ** 2
    return np.where(hat >= 1 - 1e-9, np.inf, cooks)


def influence(x: np.ndarray, y: np.ndarray, labels: list[str] | None) -> dict[str, object]:
    """The influence columns of a fit (see the module docstring)."""
    cooks = cooks_distance(x, y)
    top = int(np.argmax(cooks))
    keep = np.arange(len(x)) != top
    r2_without = math.nan
    if np.ptp(x[keep]) > 0 and np.ptp(y[keep]) > 0:
        r2_without = float(np.corrcoef(x[keep], y[keep])[0, 1] ** 2)
    return dict(
        cooks_d_max=float(cooks[top]),
        cooks_d_model=labels[top] if labels else str(top),
        influential=bool(cooks[top] > COOKS_THRESHOLD),
        r2_without=r2_without,
    )


def skip_reason(x: np.ndarray, y: np.ndarray, min_n: int = MIN_MODELS) -> str:
    """Why a fit cannot be made ("" when it can)."""
    if len(x) < min_n:
        return (
            f"fewer than {min_n} models with both values (n={len(x)}): no fit or p-value reported"
        )
    if np.ptp(x) == 0:
        return "metric is constant across models"
    if np.ptp(y) == 0:
        return "score is constant across models"
    return ""


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


def fit_pair(
    x: np.ndarray, y: np.ndarray, seed: int = 0, labels: list[str] | None = None
) -> dict[str, object]:
    """All across-model statistics of y (scores) against x (metric): ``FIT_COLUMNS``, ``reason``.

    Statistics are NaN and ``reason`` says why when the pair cannot be fitted
    (fewer than ``MIN_MODELS`` models, or a constant column); ``labels`` name
    the models for ``cooks_d_model``.
    """
    out: dict[str, object] = {c: math.nan for c in FIT_COLUMNS}
    out.update(n=len(x), cooks_d_model="", influential=False, x_log_scale=spans_decades(x))
    out["reason"] = skip_reason(x, y)
    if out["reason"]:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import statsmodels.api as sm  # here, not at import (see cooks_distance)

        res = sm.OLS(y, sm.add_constant(x, has_constant="add")).fit(cov_type="HC3")
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
        **influence(x, y, labels),
    )
    text = ("reason", "cooks_d_model", "influential", "x_log_scale")
    return {k: (v if k in text else float(v)) for k, v in out.items()}


def significant(fit) -> bool:
    """Whether a ``correlations.csv`` row's Holm-adjusted p (the family's) is below `ALPHA`."""
    p = fit.get("p_holm", math.nan) if fit is not None else math.nan
    return bool(p is not None and math.isfinite(float(p)) and float(p) < ALPHA)


def holm(p_values: pd.Series) -> pd.Series:
    """Holm-adjusted p-values over the finite entries (NaN stays NaN; Holm 1979).

    With the p-values sorted ascending, the adjusted value of the i-th is
    ``min(1, max_{j <= i} (m - j + 1) p_(j))`` (statsmodels ``multipletests``).
    """
    from statsmodels.stats.multitest import multipletests

    out = pd.Series(np.nan, index=p_values.index)
    values = pd.to_numeric(p_values, errors="coerce").astype(float)
    finite = values.notna() & np.isfinite(values)
    if finite.any():
        out[finite] = multipletests(values[finite].to_numpy(), method="holm")[1]
    return out


def model_labels(board: pd.DataFrame) -> pd.Series:
    """``model`` or ``model@revision`` (revision other than main) for each leaderboard row."""
    labels = board["model"].astype(str)
    if "revision" in board.columns:
        rev = board["revision"].astype(str)
        labels = labels.where(rev.isin(["main", "nan", ""]), labels + "@" + rev)
    return labels


def resolve_primary(metrics: list[str], primary: str | None) -> str | None:
    """The primary test's column: ``primary`` (default: the declared one), else a ``primary_*``."""
    if primary is None:
        from lm_coupling.catalogue import Catalogue

        primary = Catalogue.installed().primary_metric()
        if primary is None:
            return None
    if primary in metrics:
        return primary
    return next((m for m in metrics if m.startswith(f"{primary}_")), None)


def correlations(
    board: pd.DataFrame,
    metrics: list[str],
    targets: list[str],
    primary: str | None = None,
    seed: int = 0,
    primary_target: str = "average",
    task_sets: dict[str, str] | None = None,
) -> pd.DataFrame:
    """Every geometry metric against every score column (``CORRELATION_COLUMNS``).

    Args:
        board: the leaderboard, one row per independent model.
        metrics: geometry columns.
        targets: score columns.
        primary: metric of the primary test (default: the declared one).
        seed: bootstrap seed (the same for every pair).
        primary_target: score column of the primary test.
        task_sets: per metric, the tasks its values averaged (``task_set``).

    ``p_holm`` adjusts ``p_hc3`` over the rows that have one.
    """
    rows = []
    main = resolve_primary(metrics, primary)
    labels = model_labels(board)
    for metric in metrics:
        for target in targets:
            x, y, names = paired(board[metric], board[target], labels)
            row = dict(metric=metric, target=target, **fit_pair(x, y, seed, names))
            row["task_set"] = (task_sets or {}).get(metric, "")
            row["primary"] = metric == main and target == primary_target
            rows.append(row)
    table = pd.DataFrame(rows, columns=[c for c in CORRELATION_COLUMNS if c != "schema_version"])
    table["p_holm"] = holm(table["p_hc3"])
    for column in ("primary", "influential", "x_log_scale"):
        table[column] = table[column].fillna(False).astype(bool)
    table = table.assign(schema_version=SCHEMA_VERSION, estimator=ESTIMATOR, correction=CORRECTION)
    table["reason"] = table["reason"].fillna("")
    return table[CORRELATION_COLUMNS]
