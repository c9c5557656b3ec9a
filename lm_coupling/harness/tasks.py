"""Attach per-document geometry to lm-eval tasks' own results.

Each selected task's ``process_results`` is wrapped so that the document's
geometry is added to the metrics it returns: lm-eval then aggregates it (mean,
stderr), prints it, writes it to the results JSON and samples JSONL, gathers
it across ranks and logs it to W&B like ``acc``.

lm-eval calls ``process_results(doc, results)`` without the document's id;
the task's ``doc_iterator``, which yields ``(doc_id, doc)`` right before lm-eval
scores that document, is wrapped to tell the glue which document it is, so
documents are identified by ``(task, doc_id)`` as their requests are (two
identical documents stay two documents).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from lm_coupling.errors import GeometryWarning
from lm_coupling.harness.registry import attach_to_task
from lm_coupling.harness.session import GeometrySession


def attach_geometry(tasks: dict[str, Any], session: GeometrySession) -> None:
    """Wrap every task's ``process_results`` and declare the metrics on it."""
    for name, task in tasks.items():
        if getattr(task, "_lmc_wrapped", False):
            continue
        attach_to_task(task, session.selection.specs)
        cursor: dict[str, int | None] = {"doc_id": None}
        task.doc_iterator = _tracking_doc_id(task.doc_iterator, cursor)
        task.process_results = _with_geometry(task.process_results, name, session, cursor)
        task._lmc_wrapped = True
        session.add_task(name, task)


def _tracking_doc_id(doc_iterator: Callable, cursor: dict[str, int | None]) -> Callable:
    @functools.wraps(doc_iterator)
    def doc_iterator_tracking_id(*args: Any, **kwargs: Any) -> Iterator[tuple[int, Any]]:
        for doc_id, doc in doc_iterator(*args, **kwargs):
            cursor["doc_id"] = doc_id
            yield doc_id, doc
        cursor["doc_id"] = None

    return doc_iterator_tracking_id


def _with_geometry(
    process_results: Callable, task_name: str, session: GeometrySession, cursor: dict
) -> Callable:
    @functools.wraps(process_results)
    def process_results_with_geometry(doc, results):
        metrics = process_results(doc, results)
        try:
            doc_id = cursor["doc_id"]
            if doc_id is None:
                raise RuntimeError(
                    "process_results was called outside lm-eval's document loop, so the "
                    "document is unknown"
                )
            plan = session.plan_for(task_name, doc_id)
            if plan is None or not isinstance(metrics, dict):
                return metrics
            geometry = session.geometry_for(plan)
            return {**metrics, **session.document_values(plan, geometry, record=True)}
        except Exception as exc:  # never lose the benchmark's own scores
            warnings.warn(
                f"lm-coupling: task {task_name!r} document {cursor['doc_id']}: geometry not "
                f"attached ({exc!r})",
                GeometryWarning,
                stacklevel=2,
            )
            return metrics

    return process_results_with_geometry
