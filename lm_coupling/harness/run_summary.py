"""The end-of-run account: on how many documents each selected metric was computed.

One line per task, built from the geometry documents that
`lm_coupling.harness.outputs` writes (plain dicts, as in the JSON files). A
metric computed on no document of a task is an error-level line, and so is a
task with no geometry at all: a missing table row is never silent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SummaryLine:
    """One task's line of the end-of-run account.

    Attributes:
        task: lm-eval task name.
        text: the line, without the ``lm-coupling:`` prefix.
        error: a selected metric was computed on 0 documents (or the task has
            no geometry at all).
    """

    task: str
    text: str
    error: bool


def measured_counts(document: Mapping[str, Any]) -> dict[str, int]:
    """Documents each metric of a geometry document was computed on (its ``n_measured``)."""
    recorded = document.get("n_measured") or {}
    return {m: int(recorded.get(m, 0) or 0) for m in document.get("metrics") or []}


def task_line(
    task: str,
    document: Mapping[str, Any] | None,
    path: Path | None = None,
    sampled: Iterable[str] = (),
    selected: Iterable[str] = (),
    expected: Iterable[str] = (),
) -> SummaryLine:
    """The account of one task.

    Args:
        task: the task name.
        document: its geometry document, or None when no file was written.
        path: where the geometry file is.
        sampled: metrics computed on a document sample (marked ``sampled``).
        selected: the run's selected metrics (named when ``document`` is None).
        expected: metrics whose NaN is an expected answer (``nan_expected``):
            NaN on every document is said, not an error.
    """
    if document is None:
        names = ", ".join(selected) or "the selected metrics"
        return SummaryLine(
            task, f"{task}: no document measured: {names} computed on 0 documents", True
        )
    counts = measured_counts(document)
    total = int(document.get("n_documents") or 0)
    sampled = set(sampled)
    parts = [
        f"{metric} {n}/{total}{' (sampled)' if metric in sampled else ''}"
        for metric, n in counts.items()
    ]
    zero = [metric for metric, n in counts.items() if n == 0 and metric not in expected]
    text = f"{task}: {', '.join(parts) or 'no metrics'}"
    answered = [metric for metric, n in counts.items() if n == 0 and metric in expected]
    if answered:
        text += f"; NaN on every document, an expected answer: {', '.join(answered)}"
    if zero:
        text += f"; computed on 0 documents: {', '.join(zero)}"
    if path is not None:
        text += f" -> {path}"
    return SummaryLine(task, text, bool(zero) or not counts)


def summary_lines(
    tasks: Iterable[str],
    documents: Mapping[str, tuple[Path | None, Mapping[str, Any]]],
    sampled: Iterable[str] = (),
    selected: Iterable[str] = (),
    expected: Iterable[str] = (),
) -> list[SummaryLine]:
    """One line per task of the run, in the order of ``tasks``.

    Args:
        tasks: every task lm-eval evaluated (groups excluded).
        documents: task -> (geometry file path, geometry document) for the
            tasks that got a file; tasks absent here measured nothing.
        sampled: metrics computed on a document sample.
        selected: the run's selected metrics.
        expected: metrics whose NaN is an expected answer (`task_line`).
    """
    sampled, selected, expected = tuple(sampled), tuple(selected), tuple(expected)
    lines = []
    for task in tasks:
        path, document = documents.get(task, (None, None))
        lines.append(task_line(task, document, path, sampled, selected, expected))
    return lines


def leaf_tasks(results: Mapping[str, Any]) -> list[str]:
    """The tasks of lm-eval's results dict, without its groups."""
    groups = {g for g, subtasks in (results.get("group_subtasks") or {}).items() if subtasks}
    return sorted(t for t in (results.get("results") or {}) if t not in groups)
