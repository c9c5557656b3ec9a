"""Attach per-document geometry to the tasks lm-eval loads for a run.

`GeometryTaskManager` is lm-eval's ``TaskManager`` for one run: each task it
loads has its ``process_results`` wrapped so that the document's geometry is
added to the metrics it returns (lm-eval then aggregates, prints, writes,
gathers and logs it like ``acc``), and its ``doc_iterator`` wrapped to say
which document is scored (``process_results`` gets no id). Geometry does not
depend on lm-eval's answer filters: it is added to a document's first filtered
result only, so each metric appears once per task.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from lm_eval.tasks import TaskManager

from lm_coupling.errors import DataUnavailableError
from lm_coupling.geometry import DocumentGeometry
from lm_coupling.harness.lm_eval_registry import attach_to_task
from lm_coupling.harness.plan import DocumentPlan
from lm_coupling.harness.session import GeometrySession
from lm_coupling.harness.tasks_dir import data_unavailable

MeasureAlone = Callable[[DocumentPlan], DocumentGeometry]
"""Measures one document's prompt alone (`CouplingHFLM.measure_alone`)."""


class GeometryTaskManager(TaskManager):
    """lm-eval's task manager for one geometry run: loaded tasks get its session.

    Built by `sharing_index` (a new ``TaskManager`` indexes every task folder: about 15 s).
    """

    session: GeometrySession
    measure_alone: MeasureAlone

    @classmethod
    def sharing_index(
        cls,
        manager: TaskManager,
        session: GeometrySession,
        metadata: dict[str, Any],
        *,
        measure_alone: MeasureAlone,
    ) -> GeometryTaskManager:
        """A manager for ``session`` reusing ``manager``'s task index, with the run's metadata.

        ``measure_alone`` (`CouplingHFLM.measure_alone`) measures the documents
        lm-eval answered from its cache.
        """
        from lm_coupling.harness.lm_eval_adapter import share_task_index

        shared = cls.__new__(cls)
        share_task_index(shared, manager, metadata)  # lm-eval has no public route for this
        shared.session = session
        shared.measure_alone = measure_alone
        return shared

    def load(self, task_list: Any) -> Any:
        """lm-eval's ``load``, then the session attached to every task loaded.

        Raises:
            DataUnavailableError: a task's data cannot be downloaded (offline), or
                an offline task's data file is empty or missing.
        """
        try:
            loaded = super().load(task_list)
        except ConnectionError as exc:
            raise data_unavailable(task_list, exc) from exc
        except (ValueError, OSError) as exc:
            if getattr(exc, "lmc_data_error", False):  # an offline task's data file
                raise DataUnavailableError(str(exc)) from exc
            raise
        attach_geometry(loaded.get("tasks", {}), self.session, self.measure_alone)
        return loaded


def attach_geometry(
    tasks: dict[str, Any], session: GeometrySession, measure_alone: MeasureAlone
) -> None:
    """Wrap every task's ``process_results`` and declare the metrics on it."""
    for name, task in tasks.items():
        if getattr(task, "_lmc_session", None) is session:
            continue
        attach_to_task(task, session.selection.specs)
        cursor: dict[str, int | None] = {"doc_id": None}
        task.doc_iterator = _tracking_doc_id(task.doc_iterator, cursor)
        task.process_results = _with_geometry(
            task.process_results, name, session, cursor, measure_alone
        )
        task._lmc_session = session
        session.plans.add_task(name, task)


def _tracking_doc_id(doc_iterator: Callable, cursor: dict[str, int | None]) -> Callable:
    @functools.wraps(doc_iterator)
    def doc_iterator_tracking_id(*args: Any, **kwargs: Any) -> Iterator[tuple[int, Any]]:
        for doc_id, doc in doc_iterator(*args, **kwargs):
            cursor["doc_id"] = doc_id
            yield doc_id, doc
        cursor["doc_id"] = None

    return doc_iterator_tracking_id


def _with_geometry(
    process_results: Callable,
    task_name: str,
    session: GeometrySession,
    cursor: dict,
    measure_alone: MeasureAlone,
) -> Callable:
    @functools.wraps(process_results)
    def process_results_with_geometry(doc, results):
        metrics = process_results(doc, results)
        doc_id = cursor["doc_id"]
        if not isinstance(metrics, dict) or session.records.scored(task_name, doc_id):
            return metrics  # a later filter of a scored document: geometry is shown once
        try:
            if doc_id is None:
                raise RuntimeError(
                    "process_results was called outside lm-eval's document loop, so the "
                    "document is unknown"
                )
            session.complete_task(task_name, measure_alone)  # deferred metrics, once per task
            plan = session.plans.plan_for(task_name, doc_id)
            if plan is None:
                return metrics
            geometry = session.measurements.geometry_for(plan, measure_alone)
            return {**metrics, **session.document_values(plan, geometry)}
        except Exception as exc:  # the benchmark's own scores are kept; the cause is recorded
            where = traceback.extract_tb(exc.__traceback__)[-1]
            session.records.internal_failure(
                task_name,
                doc_id,
                f"{exc!r} at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}",
            )
            return metrics

    return process_results_with_geometry
