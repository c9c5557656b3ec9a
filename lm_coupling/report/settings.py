"""The setting each value of the report was measured with, read from lm-eval's results JSON.

Shots, limit and metric options, as docs/report.md ("Settings") defines
them; the rule that keeps one setting per task is `lm_coupling.report.newest`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TaskSetting:
    """Shots and limit of one task in one run (see the module docstring)."""

    shots: int | None
    limit: float | None = None

    def label(self) -> str:
        """``25-shot``, ``5-shot, limit 4``, or ``shots unknown`` for old files."""
        text = "shots unknown" if self.shots is None else f"{self.shots}-shot"
        if self.limit is not None:
            text += f", limit {self.limit:g}"
        return text


def _parsed(value: Any, kind: type = float) -> Any:
    try:
        return None if value is None else kind(value)
    except (TypeError, ValueError):
        return None


def task_settings(data: dict[str, Any], tasks: list[str]) -> dict[str, TaskSetting]:
    """The `TaskSetting` of every task (and group) in ``tasks`` of one results JSON."""
    n_shot = data.get("n-shot") or {}
    configs = data.get("configs") or {}
    samples = data.get("n-samples") or {}
    limit = _parsed((data.get("config") or {}).get("limit"))
    children: dict[str, list[str]] = {}
    for group, subtasks in (data.get("group_subtasks") or {}).items():
        children[str(group)] = [str(t) for t in subtasks] if isinstance(subtasks, list) else []

    def own(task: str) -> TaskSetting | None:
        shots = _parsed(n_shot.get(task), int)
        if shots is None:
            shots = _parsed((configs.get(task) or {}).get("num_fewshot"), int)
        count = samples.get(task) or {}
        original, effective = _parsed(count.get("original")), _parsed(count.get("effective"))
        if original is not None and effective is not None:
            cut = effective if effective < original else None
        elif task in configs or task in n_shot:
            cut = limit
        else:
            return None if shots is None else TaskSetting(shots, None)
        return TaskSetting(shots, cut)

    def setting(task: str, seen: frozenset[str] = frozenset()) -> TaskSetting:
        found = own(task)
        if task not in children or task in seen:
            return found or TaskSetting(None, None)
        parts = [setting(t, seen | {task}) for t in children[task]]
        shots = {p.shots for p in parts}
        limits = [p.limit for p in parts if p.limit is not None]
        group_shots = found.shots if found and found.shots is not None else None
        if group_shots is None and len(shots) == 1:
            group_shots = next(iter(shots))
        return TaskSetting(group_shots, min(limits) if limits else None)

    return {task: setting(task) for task in tasks}


def metric_options(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(options used, options requested where changed)`` of a run's geometry metrics."""
    lmc = (data.get("config") or {}).get("lm_coupling") or {}
    used, asked = lmc.get("options"), lmc.get("options_requested")
    return tuple(dict(x) if isinstance(x, dict) else {} for x in (used, asked))


def options_text(options: dict[str, Any], requested: dict[str, Any] | None = None) -> str:
    """``k=47 (asked 100), norm=l1, ...``: options in key order, each changed K with its ask."""
    requested = requested or {}
    parts = []
    for key in sorted(options):
        text = f"{key}={options[key]}"
        if key in requested and requested[key] != options[key]:
            text += f" (asked {requested[key]})"
        parts.append(text)
    return ", ".join(parts)


def differing_options(runs: list[dict[str, Any]], ignored: frozenset[str]) -> dict[str, list[Any]]:
    """Option keys with different values in ``runs`` -> the values seen.

    ``ignored``: options that never make two runs' values incomparable, the
    sample sizes (`Catalogue.sample_options`) and the numerical routes
    (`Catalogue.method_options`).
    """
    seen: dict[str, list[Any]] = {}
    for options in runs:
        for key, value in options.items():
            if key in ignored:
                continue
            values = seen.setdefault(key, [])
            if value not in values:
                values.append(value)
    return {k: v for k, v in sorted(seen.items()) if len(v) > 1}
