"""The end-of-run account: on how many documents each selected metric was computed.

One line per task, from the geometry documents (plain dicts, as in the JSON
files). A metric computed on no document of a task is an error-level line, and
so is a task with no geometry at all: a missing table row is never silent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple


class SummaryLine(NamedTuple):
    """One task's line: the task, the text (no ``lm-coupling:`` prefix), whether an error."""

    task: str
    text: str
    error: bool


def measured_counts(document: Mapping[str, Any]) -> dict[str, int]:
    """Documents each metric of a geometry document was computed on (its ``n_measured``)."""
    recorded = document.get("n_measured") or {}
    return {m: int(recorded.get(m, 0) or 0) for m in document.get("metrics") or []}


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
        sampled: metrics computed on a document sample (marked ``sampled``).
        selected: the run's selected metrics (named for a task without geometry).
        expected: metrics whose NaN is an expected answer (``nan_expected``):
            NaN on every document is said, not an error.
    """
    sampled, expected = set(sampled), set(expected)
    names = ", ".join(selected) or "the selected metrics"
    lines = []
    for task in tasks:
        path, document = documents.get(task, (None, None))
        if document is None:
            text = f"{task}: no document measured: {names} computed on 0 documents"
            lines.append(SummaryLine(task, text, True))
            continue
        counts = measured_counts(document)
        total = int(document.get("n_documents") or 0)
        parts = [
            f"{metric} {n}/{total}{' (sampled)' if metric in sampled else ''}"
            for metric, n in counts.items()
        ]
        text = f"{task}: {', '.join(parts) or 'no metrics'}"
        answered = [metric for metric, n in counts.items() if n == 0 and metric in expected]
        zero = [metric for metric, n in counts.items() if n == 0 and metric not in expected]
        if answered:
            text += f"; NaN on every document, an expected answer: {', '.join(answered)}"
        if zero:
            text += f"; computed on 0 documents: {', '.join(zero)}"
        if path is not None:
            text += f" -> {path}"
        lines.append(SummaryLine(task, text, bool(zero) or not counts))
    return lines


def leaf_tasks(results: Mapping[str, Any]) -> list[str]:
    """The tasks of lm-eval's results dict, without its groups."""
    groups = {g for g, subtasks in (results.get("group_subtasks") or {}).items() if subtasks}
    return sorted(t for t in (results.get("results") or {}) if t not in groups)
