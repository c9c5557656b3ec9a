"""Which tasks a model's geometry value is averaged over, the same for every model.

Tasks of a scored group (MMLU's subjects) are pooled into the group, weighted
by documents. A model's value is the mean over the units every model with the
metric measured; the others are left out (`TaskSets.dropped`). With no common
unit each value is the model's own mean and `TaskSets.mixed` names the metric.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from lm_coupling.catalogue import Catalogue
from lm_coupling.report.loading import IDENTITY


@dataclass
class TaskSets:
    """The task sets of the geometry columns.

    Attributes:
        used: metric -> the units every model was averaged over ("" when mixed).
        mixed: metrics whose models share no unit (each averaged over its own).
        dropped: metric -> units left out because some models lack them.
        undefined: metric -> those of ``dropped`` every model measured but some
            have NaN for (a profile with no thought/fixation boundary).
    """

    used: dict[str, str] = field(default_factory=dict)
    mixed: list[str] = field(default_factory=list)
    dropped: dict[str, list[str]] = field(default_factory=dict)
    undefined: dict[str, list[str]] = field(default_factory=dict)


def scored_groups(selected: pd.DataFrame) -> set[str]:
    """Tasks that have a score of their own and are the group of another task."""
    groups = set(selected["group"].dropna()) - {""}
    scored = selected[(selected["kind"] == "score") & selected["primary_score"].astype(bool)]
    return groups & set(scored["task"])


def task_unit(task: str, group: str, groups: set[str]) -> str:
    """The unit a task counts in: its group when the group is scored, else the task."""
    return group if group in groups else task


def documents_measured(
    geo: dict[str, Any] | None,
    base_metric: str,
    fallback: float,
    catalogue: Catalogue | None = None,
) -> float:
    """Documents a metric was measured on in one task (``n_measured``, else ``n_sampled``)."""
    if geo is not None:
        measured = geo.get("n_measured") or {}
        if isinstance(measured, dict) and measured.get(base_metric) is not None:
            return float(measured[base_metric])
        section = geo.get(base_metric)
        sampled = catalogue is not None and base_metric in catalogue.sampled_metrics()
        if sampled and isinstance(section, dict) and section.get("n_sampled") is not None:
            return float(section["n_sampled"])
    return float(fallback)


def group_sums(frame: pd.DataFrame, keys: list[str], columns: list[str]) -> pd.DataFrame:
    """Per group of ``keys`` (first-appearance order): each column's sum (NaN as 0), ``_size``.

    Each sum uses its group's rows alone (``numpy.add.reduceat``): pandas'
    grouped sum carries round-off from one group into the next, so a model's
    value would depend on which other models are in the folder.
    """
    if frame.empty:
        return pd.DataFrame(columns=[*keys, *columns, "_size"])
    codes = frame.groupby(keys, sort=False).ngroup().to_numpy()
    order = np.argsort(codes, kind="stable")
    ranked = codes[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    out = frame[keys].iloc[order[starts]].reset_index(drop=True)
    for column in columns:
        values = frame[column].to_numpy(dtype=float)[order]
        out[column] = np.add.reduceat(np.where(np.isnan(values), 0.0, values), starts)
    out["_size"] = np.diff(np.r_[starts, len(order)])
    return out


def _unit_values(rows: pd.DataFrame) -> pd.DataFrame:
    """Pool tasks into units: document-weighted mean, summed documents."""
    rows = rows.assign(_w=rows["n"].where(rows["n"] > 0, 1.0).fillna(1.0))
    rows = rows.assign(_wv=rows["value"] * rows["_w"])
    keys = [*IDENTITY, "metric", "unit"]
    pooled = group_sums(rows, keys, ["_wv", "_w", "n"])
    pooled["value"] = pooled["_wv"] / pooled["_w"]
    return pooled[[*keys, "value", "n"]]


def geometry_table(long: pd.DataFrame) -> tuple[pd.DataFrame, TaskSets]:
    """Per model, from `geometry_rows`' table: each metric's value and companion columns.

    Returns ``(wide, sets)``: by identity, ``<metric>``, ``<metric>__tasks``,
    ``<metric>__n`` (and ``<metric>__k_used``), and the `TaskSets`.
    """
    every_metric = list(dict.fromkeys(long["metric"]))
    every_id = pd.MultiIndex.from_frame(long[IDENTITY].drop_duplicates()) if len(long) else None
    n_models = len(every_id) if every_id is not None else 0
    measured_by = long.drop_duplicates([*IDENTITY, "metric", "unit"]).groupby(["metric", "unit"])
    measured_by_all = {key for key, rows in measured_by if len(rows) == n_models}
    long = long[np.isfinite(long["value"].astype(float))]
    units = _unit_values(long)  # every metric at once: one pass, not one per metric
    keys = list(units[[*IDENTITY, "metric", "unit"]].itertuples(index=False, name=None))
    of_model: dict[str, dict[tuple, set[str]]] = {}
    for *identity, metric, unit in keys:
        of_model.setdefault(metric, {}).setdefault(tuple(identity), set()).add(unit)
    sets = TaskSets()
    shared: dict[str, set[str]] = {}
    for metric, models in of_model.items():
        every = set().union(*models.values())
        shared[metric] = set.intersection(*models.values())
        if shared[metric]:
            sets.used[metric] = ";".join(sorted(shared[metric]))
            if every - shared[metric]:
                sets.dropped[metric] = sorted(every - shared[metric])
                undefined = [u for u in sets.dropped[metric] if (metric, u) in measured_by_all]
                if undefined:
                    sets.undefined[metric] = undefined
        else:
            sets.mixed.append(metric)
            sets.used[metric] = ""
    kept = [not shared[m] or u in shared[m] for *_, m, u in keys]
    units = units[np.asarray(kept, dtype=bool)]
    per_model = group_sums(units, [*IDENTITY, "metric"], ["value", "n"])
    by_model = units.groupby([*IDENTITY, "metric"], sort=False)
    per_model["tasks"] = by_model["unit"].agg(_joined).to_numpy()
    has_k = set(long.loc[long["k_used"].notna(), "metric"])
    pairs = zip(long["metric"], long["unit"], strict=True)
    with_k = [m in has_k and (not shared[m] or u in shared[m]) for m, u in pairs]
    with_k = long[np.asarray(with_k, dtype=bool)].groupby([*IDENTITY, "metric"], sort=False)
    k_used = with_k["k_used"].agg(lambda k: _joined(k.dropna().astype(int)))
    columns: dict[str, pd.Series] = {}
    for metric in of_model:  # in order of each metric's first finite value
        rows = per_model[per_model["metric"] == metric].set_index(IDENTITY)
        columns[metric] = rows["value"] / rows["_size"]
        columns[f"{metric}__tasks"] = rows["tasks"]
        columns[f"{metric}__n"] = rows["n"]
        if metric in has_k:
            columns[f"{metric}__k_used"] = k_used.xs(metric, level="metric")
    for metric in every_metric:  # measured, but NaN on every model: keep the column
        if metric not in columns:
            columns[metric] = pd.Series(np.nan, index=every_id, dtype=float)
            sets.used[metric] = ""
    wide = pd.DataFrame(columns, index=every_id)
    return wide, sets


def _joined(values) -> str:
    """The distinct values, sorted, joined by ``;``."""
    return ";".join(str(v) for v in sorted(set(values)))
