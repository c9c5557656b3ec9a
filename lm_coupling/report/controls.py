"""``controls.csv``: does geometry say more about accuracy than model size does?

``analysis`` says which fields of a row are filled:

- ``control``: a size variable (``log_n_params`` = log10 of the parameter
  count, ``n_layers``, ``d_model``) against the score, with the statistics
  of ``correlations.csv``;
- ``partial``: metric and score are residualized on ``[1, controls]`` by OLS;
  ``partial_r`` is the Pearson r of the residuals, its p from
  ``t = r sqrt(df / (1 - r^2))``, ``df = n - 2 - k`` (k controls);
- ``nested``: OLS of the score on the controls, then on controls plus the
  metric: ``r2_gain`` and the F-test of the added term (``compare_f_test``);
- ``exponential``: ``score = exp_a * exp(exp_b * metric)`` (the coupling
  paper's Figure 8) by OLS of ``log(score)`` over scores > 0; ``exp_r2_log``
  in log space, ``exp_r2`` in the original space, beside ``linear_r2``.

Controls constant over the models are dropped; a row is skipped with a
``reason`` when ``n <= k + 2`` or the design is rank deficient.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import stats

from lm_coupling.report.benchmarks import AVERAGE, SCHEMA_VERSION
from lm_coupling.report.stats import FIT_COLUMNS, fit_pair, model_labels, paired, skip_reason

CONTROL_VARIABLES = ("log_n_params", "n_layers", "d_model")
CONTROL_COLUMNS = [
    "schema_version",
    "analysis",
    "metric",
    "target",
    "controls",
    *FIT_COLUMNS,
    "partial_r",
    "partial_p",
    "df",
    "r2_controls",
    "r2_full",
    "r2_gain",
    "f_stat",
    "f_p",
    "exp_a",
    "exp_b",
    "exp_r2_log",
    "exp_r2",
    "linear_r2",
    "estimator",
    "reason",
]


def control_frame(board: pd.DataFrame) -> pd.DataFrame:
    """The size variables of each model: ``log_n_params`` (log10), ``n_layers``, ``d_model``."""
    n_params = pd.to_numeric(board.get("n_params"), errors="coerce")
    frame = pd.DataFrame(index=board.index)
    frame["log_n_params"] = np.log10(n_params.where(n_params > 0))
    for name in ("n_layers", "d_model"):
        frame[name] = pd.to_numeric(board.get(name), errors="coerce")
    return frame.astype(float)


def _design(board: pd.DataFrame, metric: str, target: str):
    """Rows with metric, target and every usable control finite; the controls kept."""
    ctrl = control_frame(board)
    usable = [c for c in CONTROL_VARIABLES if ctrl[c].notna().any()]
    data = ctrl[usable].assign(
        _x=pd.to_numeric(board[metric], errors="coerce"),
        _y=pd.to_numeric(board[target], errors="coerce"),
    )
    data = data.dropna()
    kept = [c for c in usable if data[c].nunique() > 1]
    return data, kept


def _controls_reason(data: pd.DataFrame, kept: list[str]) -> str:
    n, k = len(data), len(kept)
    base = skip_reason(data["_x"].to_numpy(), data["_y"].to_numpy())
    if base:
        return base
    if not kept:
        return "no size control varies across these models"
    if n <= k + 2:
        return f"too few models for {k} controls (n={n}, need n > {k + 2})"
    design = np.column_stack([np.ones(n), data[[*kept, "_x"]].to_numpy(dtype=float)])
    if np.linalg.matrix_rank(design) < design.shape[1]:
        return "controls and metric are collinear (rank-deficient design)"
    return ""


def partial_and_nested(board: pd.DataFrame, metric: str, target: str = AVERAGE) -> list[dict]:
    """The ``partial`` and ``nested`` rows of one metric (see the module docstring)."""
    data, kept = _design(board, metric, target)
    common = dict(metric=metric, target=target, controls=";".join(kept), n=len(data))
    reason = _controls_reason(data, kept)
    partial = dict(common, analysis="partial", estimator="OLS-residualization", reason=reason)
    nested = dict(common, analysis="nested", estimator="OLS-F", reason=reason)
    if reason:
        return [partial, nested]
    import statsmodels.api as sm  # here, not at import: `lm-coupling --help` stays light

    z = sm.add_constant(data[kept].to_numpy(), has_constant="add")
    x, y = data["_x"].to_numpy(), data["_y"].to_numpy()
    rx = x - z @ np.linalg.lstsq(z, x, rcond=None)[0]
    ry = y - z @ np.linalg.lstsq(z, y, rcond=None)[0]
    r = float(np.corrcoef(rx, ry)[0, 1])
    df = len(data) - 2 - len(kept)
    t = r * math.sqrt(df / max(1.0 - r**2, 1e-300))
    partial.update(partial_r=r, partial_p=float(2 * stats.t.sf(abs(t), df)), df=float(df))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restricted = sm.OLS(y, z).fit()
        full = sm.OLS(y, np.column_stack([z, x])).fit()
        f_stat, f_p, _ = full.compare_f_test(restricted)
    nested.update(
        r2_controls=restricted.rsquared,
        r2_full=full.rsquared,
        r2_gain=full.rsquared - restricted.rsquared,
        f_stat=float(f_stat),
        f_p=float(f_p),
        df=float(full.df_resid),
    )
    return [partial, nested]


def exponential_fit(board: pd.DataFrame, metric: str, target: str = AVERAGE) -> dict:
    """The ``exponential`` row: ``score = a exp(b x)`` by OLS of log(score), beside the line."""
    x, y = paired(board[metric], board[target])
    keep = y > 0
    x, y = x[keep], y[keep]
    row = dict(
        analysis="exponential",
        metric=metric,
        target=target,
        controls="",
        n=len(x),
        estimator="OLS-log",
        reason=skip_reason(x, y),
    )
    if row["reason"]:
        return row
    import statsmodels.api as sm  # here, not at import: `lm-coupling --help` stays light

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        log_fit = sm.OLS(np.log(y), sm.add_constant(x, has_constant="add")).fit()
        line = sm.OLS(y, sm.add_constant(x, has_constant="add")).fit()
    a, b = math.exp(log_fit.params[0]), float(log_fit.params[1])
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - a * np.exp(b * x)) ** 2).sum())
    row.update(
        exp_a=a,
        exp_b=b,
        exp_r2_log=float(log_fit.rsquared),
        exp_r2=1 - ss_res / ss_tot,
        linear_r2=float(line.rsquared),
    )
    return row


def controls_table(
    board: pd.DataFrame, metrics: list[str], target: str = AVERAGE, seed: int = 0
) -> pd.DataFrame:
    """All rows of ``controls.csv`` (columns ``CONTROL_COLUMNS``)."""
    rows = []
    ctrl = control_frame(board)
    if target in board.columns:
        labels = model_labels(board)
        for name in CONTROL_VARIABLES:
            x, y, names = paired(ctrl[name], board[target], labels)
            rows.append(
                dict(
                    analysis="control",
                    metric=name,
                    target=target,
                    controls="",
                    estimator="OLS-HC3",
                    **fit_pair(x, y, seed, names),
                )
            )
        for metric in metrics:
            rows.extend(partial_and_nested(board, metric, target))
            rows.append(exponential_fit(board, metric, target))
    table = pd.DataFrame(rows, columns=CONTROL_COLUMNS).assign(schema_version=SCHEMA_VERSION)
    table["reason"] = table["reason"].fillna("")
    for column in ("influential", "x_log_scale"):
        table[column] = table[column].fillna(False).astype(bool)
    return table
