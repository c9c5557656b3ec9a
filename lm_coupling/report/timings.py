"""Where a run's geometry time went: ``timings.csv`` and the summary's timings section.

Read from each geometry file's ``timings`` section (docs/outputs.md):
``seconds_per_document`` per group (``forward_capture``, ``jacobian``,
``jacobian_forward``, ``jacobian_products``, ``factorisation``, ``metrics``,
and ``plugin:<name>``: each plugin's own seconds), ``n_documents`` and
``n_documents_per_part``. The summary gives, per model, the seconds per
document of each group, the Jacobian work per task at the run's sample size,
and each plugin's share of the capture time (docs/report.md, "timings.csv").
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from lm_coupling.report.loading import IDENTITY
from lm_coupling.report.summary import markdown_table

TIMING_COLUMNS = [*IDENTITY, "task", "group", "seconds_per_document", "n_documents"]
GROUPS = (
    "forward_capture",
    "jacobian",
    "jacobian_forward",
    "jacobian_products",
    "factorisation",
    "metrics",
)
JACOBIAN_GROUPS = ("jacobian_products", "factorisation")
PLUGIN_GROUP = "plugin:"  # a plugin's own seconds: ``plugin:builtin.trajectory``
CAPTURE_GROUPS = ("forward_capture", "metrics")


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def timings_table(geometry: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per (identity, task, group) of the geometry files with a ``timings`` section."""
    rows = []
    for geo in geometry:
        timings = geo.get("timings")
        if not isinstance(timings, dict):
            continue
        per_doc = timings.get("seconds_per_document") or {}
        n_docs = _number(timings.get("n_documents"))
        per_part = timings.get("n_documents_per_part") or {}
        known = [g for g in GROUPS if g in per_doc]
        others = sorted(g for g in per_doc if g not in GROUPS)
        for group in known + others:
            seconds, n = _number(per_doc[group]), _number(per_part.get(group, n_docs))
            if math.isfinite(seconds):
                rows.append((*geo["identity"], str(geo.get("task", "")), group, seconds, n))
    table = pd.DataFrame(rows, columns=TIMING_COLUMNS)
    table["n_documents"] = pd.to_numeric(table["n_documents"]).round().astype("Int64")
    return table.sort_values([*IDENTITY, "task"], kind="stable").reset_index(drop=True)


def _per_model(table: pd.DataFrame) -> pd.DataFrame:
    """Seconds per document per group and model: the mean over tasks weighted by documents."""
    weights = table["n_documents"].astype(float).fillna(1.0).clip(lower=1.0)
    frame = table.assign(_w=weights, _ws=table["seconds_per_document"] * weights)
    pooled = frame.groupby([*IDENTITY, "group"], sort=False)[["_ws", "_w"]].sum()
    pooled["seconds"] = pooled["_ws"] / pooled["_w"]
    wide = pooled["seconds"].unstack("group")
    order = [g for g in GROUPS if g in wide.columns]
    return wide[order + sorted(c for c in wide.columns if c not in GROUPS)]


def sample_sizes(geometry: list[dict[str, Any]], option: str) -> dict[tuple, float]:
    """The sample-size ``option`` of each identity's runs (the largest, when they differ)."""
    found: dict[tuple, float] = {}
    for geo in geometry:
        value = _number((geo.get("options") or {}).get(option))
        key = tuple(geo["identity"])
        if math.isfinite(value):
            found[key] = max(found.get(key, value), value)
    return found


def jacobian_seconds(row: pd.Series) -> float:
    """Jacobian work per sampled document: ``jacobian``, else products + factorisation."""
    whole = row.get("jacobian")
    if whole is not None and pd.notna(whole):
        return float(whole)
    parts = [row.get(g) for g in JACOBIAN_GROUPS]
    parts = [float(v) for v in parts if v is not None and pd.notna(v)]
    return sum(parts) if parts else math.nan


def timings_markdown(table: pd.DataFrame, sizes: dict[tuple, float], option: str) -> str:
    """The summary section ("" without timings); ``sizes``: `sample_sizes` of ``option``."""
    if table.empty:
        return ""
    wide = _per_model(table)
    plugins = wide[[c for c in wide.columns if c.startswith(PLUGIN_GROUP)]]
    wide = wide[[c for c in wide.columns if not c.startswith(PLUGIN_GROUP)]]
    intro = (
        "Seconds per document, by metric group (means over the documents measured, "
        "weighted over tasks; every row in `timings.csv`). The Jacobian work (`jacobian`, "
        "else `jacobian_products` + `factorisation`) is paid once per *sampled* document, so "
        f"a task costs about `{option}` times it: lower `{option}` in "
        "`--metric_args` when that column dominates."
    )
    rows = []
    for identity, row in wide.iterrows():
        jac, docs = jacobian_seconds(row), sizes.get(tuple(identity))
        ok = docs is not None and math.isfinite(jac)
        per_task = f"{jac * docs:.3g} s at {option}={docs:g}" if ok else ""
        cells = ["" if pd.isna(v) else f"{v:.3g}" for v in row]
        rows.append([*map(str, identity), *cells, per_task])
    columns = [*IDENTITY, *wide.columns, "Jacobian work per task"]
    lines = [intro, "", markdown_table(pd.DataFrame(rows, columns=columns))]
    return "\n".join(lines + plugin_shares(plugins, wide))


def plugin_shares(plugins: pd.DataFrame, wide: pd.DataFrame) -> list[str]:
    """Per model, each plugin's seconds per document and share of the capture time.

    Capture time: ``forward_capture`` + ``metrics`` (the forward pass with the
    reducers, then ``lmc_compute_batch``); a plugin's seconds: its reducer and
    its ``lmc_compute_batch``.
    """
    lines = []
    for identity, row in plugins.iterrows():
        spent = {c[len(PLUGIN_GROUP) :]: v for c, v in row.items() if pd.notna(v)}
        total = sum(float(wide.loc[identity].get(g, 0.0) or 0.0) for g in CAPTURE_GROUPS)
        if not spent:
            continue
        shares = [
            f"{name} {seconds:.3g} s ({100 * seconds / total:.0f}%)" if total > 0 else name
            for name, seconds in sorted(spent.items(), key=lambda item: -item[1])
        ]
        model = " ".join(map(str, identity))
        lines.append(f"\nPlugins of {model}, per document (share of the capture time): ")
        lines[-1] += "; ".join(shares) + "."
    return lines
