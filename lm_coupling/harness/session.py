"""State of one geometry run: selection, plans, measured documents, outputs.

One `GeometrySession` lives for one ``lm_eval ... --metrics`` run. The model
wrapper fills it during the forward passes; the task glue reads it when lm-eval
scores each document; the run's end writes the geometry files.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from lm_coupling.errors import GeometryWarning
from lm_coupling.geometry import DocumentGeometry, GeometryRunner
from lm_coupling.harness.plan import DocumentPlan, GeometryKey, doc_fingerprint, plan_task
from lm_coupling.selection import Selection

_ACTIVE: GeometrySession | None = None


def active_session() -> GeometrySession | None:
    """The session of the run in progress, if any."""
    return _ACTIVE


def set_active_session(session: GeometrySession | None) -> None:
    """Make ``session`` the one the model wrapper and task glue use."""
    global _ACTIVE
    _ACTIVE = session


@dataclass
class TaskRecords:
    """Per-document geometry of one task, as lm-eval scored it."""

    doc_ids: list[int] = field(default_factory=list)
    documents: list[DocumentGeometry] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)


class GeometrySession:
    """Everything one run measures, keyed the way lm-eval asks for it."""

    def __init__(self, selection: Selection):
        self.selection = selection
        self.runner: GeometryRunner | None = None
        self.model_shape: dict[str, Any] = {}
        self.tasks: dict[str, Any] = {}
        self.plans: dict[tuple[str, str], DocumentPlan] = {}
        self.plans_by_key: dict[GeometryKey, list[DocumentPlan]] = defaultdict(list)
        self.measured: dict[GeometryKey, DocumentGeometry] = {}
        self.records: dict[str, TaskRecords] = defaultdict(TaskRecords)
        self.cache = None  # a GeometryCache when lm-eval's --use_cache is on
        self.model = None  # the CouplingHFLM measuring this run
        self.cache_path_prefix: str | None = None  # lm-eval's --use_cache path
        self.generation_keys: dict[str, GeometryKey] = {}
        self.results: dict[str, Any] | None = None  # lm-eval's results, once saved
        self._scored: set[tuple[str, int]] = set()
        self._warned: set[tuple[str, int]] = set()
        self._planned = False

    # -- planning ---------------------------------------------------------
    def add_task(self, name: str, task: Any) -> None:
        """Register a task whose documents get geometry."""
        self.tasks[name] = task

    def plan(self) -> None:
        """Plan every registered task's documents (once their requests exist)."""
        if self._planned:
            return
        coupling_docs = self.selection.options.get("coupling_docs")
        for name, task in self.tasks.items():
            if not getattr(task, "_instances", None):
                continue
            fingerprints = {}
            for instance in task.instances:
                if instance.doc_id not in fingerprints:
                    fingerprints[instance.doc_id] = doc_fingerprint(instance.doc)
            for plan in plan_task(task, coupling_docs):
                self.plans[(name, fingerprints[plan.doc_id])] = plan
                self.plans_by_key[plan.key].append(plan)
                if plan.kind == "generate_until":
                    self.generation_keys[plan.key[0]] = plan.key
        self._planned = True

    def generation_key(self, context: str) -> GeometryKey | None:
        """The planned key of a generation prompt, if any."""
        return self.generation_keys.get(context)

    def plugin_versions(self) -> dict[str, str]:
        """Metric plugins in use and their distributions, for the results file."""
        from lm_coupling.plugins.manager import get_registry

        owners = {spec.plugin for spec in self.selection.specs.values()}
        versions = get_registry().distributions()
        return {name: versions.get(name, "lm-coupling (built-in)") for name in sorted(owners)}

    def wanted(self, key: GeometryKey) -> bool:
        """Whether ``key`` is planned and not measured yet."""
        return key in self.plans_by_key and key not in self.measured

    def sampled(self, key: GeometryKey) -> bool:
        """Whether any document measured at ``key`` is in the coupling sample."""
        return any(plan.sampled for plan in self.plans_by_key.get(key, ()))

    # -- measuring --------------------------------------------------------
    def store(self, key: GeometryKey, geometry: DocumentGeometry) -> None:
        """Keep a measurement (and write it to the cache, if any)."""
        existing = self.measured.get(key)
        if existing is not None:
            existing.merge(geometry)
            geometry = existing
        self.measured[key] = geometry
        if self.cache is not None:
            self.cache.put(key, geometry)

    def lookup(self, key: GeometryKey) -> DocumentGeometry | None:
        """A measurement from this run or from the cache of an earlier one."""
        found = self.measured.get(key)
        if found is None and self.cache is not None:
            found = self.cache.get(key)
            if found is not None:
                self.measured[key] = found
        return found

    def fail(
        self,
        keys: list[GeometryKey],
        error: BaseException,
        metrics: tuple[str, ...] | None = None,
    ) -> None:
        """Record a failed measurement as NaN, with one warning per document."""
        metrics = metrics if metrics is not None else self.selection.metrics
        for key in keys:
            for plan in self.plans_by_key.get(key, ()):
                self.records[plan.task_name].failures.append(
                    {"doc_id": plan.doc_id, "error": repr(error)}
                )
                self.warn(plan, f"its geometry failed ({error!r}); values are NaN")
            failed = DocumentGeometry(values={name: math.nan for name in metrics})
            if key in self.measured:
                self.measured[key].merge(failed)
            else:
                self.measured[key] = failed

    def warn(self, plan: DocumentPlan, message: str) -> None:
        """One GeometryWarning per document, naming task and document."""
        ident = (plan.task_name, plan.doc_id)
        if ident in self._warned:
            return
        self._warned.add(ident)
        warnings.warn(
            f"lm-coupling: task {plan.task_name!r} document {plan.doc_id}: {message}",
            GeometryWarning,
            stacklevel=2,
        )

    # -- scoring ----------------------------------------------------------
    def plan_for(self, task_name: str, doc: Any) -> DocumentPlan | None:
        """The plan of a document, found from its content."""
        self.plan()
        return self.plans.get((task_name, doc_fingerprint(doc)))

    def document_values(
        self, plan: DocumentPlan, geometry: DocumentGeometry, record: bool
    ) -> dict[str, float]:
        """The per-document values lm-eval aggregates (undefined ones left out).

        A value is undefined (NaN) for degenerate documents, and the sampled
        metrics are undefined outside the coupling sample: lm-eval then
        averages each metric over the documents that define it.
        """
        values = {}
        undefined = []
        for name in self.selection.metrics:
            if self.selection.specs[name].sampled and not plan.sampled:
                continue
            value = geometry.values.get(name, math.nan)
            if math.isfinite(value):
                values[name] = value
            else:
                undefined.append(name)
        if undefined:
            self.warn(plan, f"undefined geometry (NaN) for {', '.join(undefined)}")
        if record and (plan.task_name, plan.doc_id) not in self._scored:
            self._scored.add((plan.task_name, plan.doc_id))
            task_records = self.records[plan.task_name]
            task_records.doc_ids.append(plan.doc_id)
            task_records.documents.append(geometry)
        return values

    def geometry_for(self, plan: DocumentPlan) -> DocumentGeometry:
        """This run's (or the cache's) measurement, else the prompt measured alone.

        Documents lm-eval answered from its own cache never reached the model,
        so they are measured here, alone.
        """
        found = self.lookup(plan.key)
        if found is not None:
            return found
        try:
            geometry = self.model.measure_alone(plan)
        except Exception as exc:  # a broken document must not stop the scoring
            self.fail([plan.key], exc)
            return self.measured[plan.key]
        self.store(plan.key, geometry)
        return geometry

    # -- gathering across ranks --------------------------------------------
    def export_records(self) -> dict[str, TaskRecords]:
        """This rank's records, for gathering across data-parallel ranks."""
        return dict(self.records)

    def merge_records(self, gathered: list[dict[str, TaskRecords]]) -> None:
        """Replace the records by those gathered from every rank."""
        merged: dict[str, TaskRecords] = defaultdict(TaskRecords)
        for rank_records in gathered:
            for task_name, task_records in rank_records.items():
                target = merged[task_name]
                target.doc_ids.extend(task_records.doc_ids)
                target.documents.extend(task_records.documents)
                target.failures.extend(task_records.failures)
        self.records = merged
