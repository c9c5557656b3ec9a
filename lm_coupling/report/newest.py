"""Which of several runs' values the report uses: one setting per task, then the newest run.

Per (model, revision, dtype, task): the newest run's setting, except that a
complete run wins over a ``--limit`` run with the same shots; among runs in
that setting, the newest wins per (metric, filter); runs in other settings
are left out, ``status`` "other setting" in ``provenance.csv``, and
`setting_conflicts` says so (docs/report.md, "Settings", rule 1).
"""

from __future__ import annotations

from datetime import datetime

import pandas as pd

from lm_coupling.report.loading import IDENTITY

PROVENANCE_COLUMNS = [
    *IDENTITY,
    "model_path",
    "task",
    "file",
    "date",
    "setting",
    "status",
    "metrics",
]
OTHER_SETTING = "other setting"


def task_setting(ordered: pd.DataFrame, task_keys: list[str]) -> pd.DataFrame:
    """Per task key, the setting its values are taken from (columns ``task_keys + setting``).

    The newest run's, unless it is limited and a complete run with its shots
    exists (then the newest complete run's). ``ordered``: the values, oldest first.
    """
    newest = ordered.drop_duplicates(task_keys, keep="last")[
        [*task_keys, "shots", "limit", "setting"]
    ]
    complete = ordered[ordered["limit"].isna()]
    complete = complete.drop_duplicates([*task_keys, "shots"], keep="last")
    complete = complete[[*task_keys, "shots", "setting"]].rename(columns={"setting": "_complete"})
    merged = newest.merge(complete, on=[*task_keys, "shots"], how="left")
    use_complete = merged["limit"].notna() & merged["_complete"].notna()
    merged["setting"] = merged["setting"].where(~use_complete, merged["_complete"])
    return merged[[*task_keys, "setting"]]


def newest_values(
    values: pd.DataFrame, paths: dict[str, str] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Keep, per task, the newest setting's values; per (metric, filter), the newest run's.

    Returns ``(selected, provenance)``: the winning rows of `LoadedResults.values`,
    and one ``provenance.csv`` row per (identity, task, file); ``paths`` gives
    its ``model_path``.
    """
    task_keys = [*IDENTITY, "task"]
    keys = [*task_keys, "metric", "filter"]
    ordered = values.sort_values("timestamp", kind="stable")
    newest = task_setting(ordered, task_keys)  # newest setting; complete beats --limit
    ordered = ordered.merge(newest.rename(columns={"setting": "_task_setting"}), on=task_keys)
    same = ordered["setting"] == ordered["_task_setting"]
    selected = ordered[same].drop_duplicates(keys, keep="last")
    selected = selected.drop(columns="_task_setting").reset_index(drop=True)
    supplied = {key: set(metrics) for key, metrics in selected.groupby(["file", "task"])["metric"]}
    groups = ordered.groupby([*task_keys, "file", "timestamp"], sort=False)
    prov = []
    for (model, rev, dtype, task, file, ts), group in groups:
        if (file, task) in supplied:
            status = "used"
        elif (group["setting"] != group["_task_setting"]).any():
            status = OTHER_SETTING
        else:
            status = "superseded"
        names = ";".join(sorted(supplied[file, task] if status == "used" else set(group["metric"])))
        date = datetime.fromtimestamp(ts).isoformat(timespec="seconds")
        setting, path = str(group["setting"].iloc[0]), (paths or {}).get(model, model)
        prov.append((model, rev, dtype, path, task, file, date, setting, status, names))
    return selected, pd.DataFrame(prov, columns=PROVENANCE_COLUMNS)


def setting_conflicts(provenance: pd.DataFrame) -> list[str]:
    """One message per (identity, task) whose runs were in different settings.

    Each names the setting used (and its file), and each left-out setting with
    its file and the metrics it had.
    """
    messages = []
    other = provenance[provenance["status"] == OTHER_SETTING]
    used = provenance[provenance["status"] == "used"].groupby([*IDENTITY, "task"])
    for (model, rev, dtype, task), dropped in other.groupby([*IDENTITY, "task"], sort=True):
        rows = used.get_group((model, rev, dtype, task))
        kept = "; ".join(f"{r.setting} ({r.file})" for r in rows.itertuples())
        left = "; ".join(f"{r.setting} ({r.file}: {r.metrics})" for r in dropped.itertuples())
        name = model if rev == "main" else f"{model}@{rev}"
        messages.append(
            f"{name} ({dtype}): task {task} was run in different settings; the leaderboard "
            f"uses {kept} (the newest setting; a complete run wins over a --limit run of "
            f"the same shots), and leaves out the values of {left}. Rerun "
            "the left-out metrics in the newest setting, or move the other runs to their "
            "own results folder, to compare them."
        )
    return messages
