"""Attach per-document geometry to lm-eval tasks' own results.

Each selected task's ``process_results`` is wrapped so that the document's
geometry is added to the metrics it returns: lm-eval then aggregates it (mean,
stderr), prints it, writes it to the results JSON and samples JSONL, gathers
it across ranks and logs it to W&B like ``acc``.
"""

from __future__ import annotations

import functools
import warnings
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
        task.process_results = _with_geometry(task.process_results, name, session)
        task._lmc_wrapped = True
        session.add_task(name, task)


def _with_geometry(process_results, task_name: str, session: GeometrySession):
    @functools.wraps(process_results)
    def process_results_with_geometry(doc, results):
        metrics = process_results(doc, results)
        try:
            plan = session.plan_for(task_name, doc)
            if plan is None or not isinstance(metrics, dict):
                return metrics
            geometry = session.geometry_for(plan)
            return {**metrics, **session.document_values(plan, geometry, record=True)}
        except Exception as exc:  # never lose the benchmark's own scores
            warnings.warn(
                f"lm-coupling: task {task_name!r}: geometry not attached to a document ({exc!r})",
                GeometryWarning,
                stacklevel=2,
            )
            return metrics

    return process_results_with_geometry
