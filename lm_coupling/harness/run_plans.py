"""The run's plans: which documents are measured, in which sample, under which id."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from lm_coupling.errors import GeometryWarning
from lm_coupling.harness.lm_eval_adapter import reported_doc_id, templates_compiled_once
from lm_coupling.harness.plan import DocumentId, DocumentPlan, GeometryKey, plan_document
from lm_coupling.harness.sample import TaskSample, task_sample
from lm_coupling.selection import Selection
from lm_coupling.states import DocumentRef

__all__ = ["RunPlans"]

_NO_METRICS: frozenset[str] = frozenset()


def _requests_by_document(task: Any) -> dict[int, list[Any]]:
    """Every request of an lm-eval task (its ``instances``), by ``doc_id``."""
    index: dict[int, list[Any]] = defaultdict(list)
    for instance in getattr(task, "instances", None) or ():
        index[instance.doc_id].append(instance)
    return index


class RunPlans:
    """The documents one run measures, keyed the way lm-eval asks for them.

    Every warning of the run names a document by its reported id (`reported_id`),
    once per document.

    Args:
        selection: the run's metrics and options.
        lm_eval_options: the lm-eval options the run uses (``samples``,
            ``limit`` and the like: the document sample and the reported ids
            follow them).

    Attributes:
        tasks: the lm-eval tasks whose documents get geometry, by name.
        plans: each planned document's plan (None: no geometry, e.g. a
            rolling log-likelihood task).
        plans_by_key: the plans measured at each request (duplicate prompts
            share one key).
        generation_keys: the planned keys of each generation prompt (one per
            distinct gold answer).
        sample_sizes: each sampled metric's document sample size (None: all).
        samples: each task's document sample (`TaskSample`), drawn once.
    """

    def __init__(self, selection: Selection, lm_eval_options: dict[str, Any]):
        self.selection = selection
        self.lm_eval_options = lm_eval_options
        self.tasks: dict[str, Any] = {}
        self.plans: dict[DocumentId, DocumentPlan | None] = {}
        self.plans_by_key: dict[GeometryKey, list[DocumentPlan]] = defaultdict(list)
        self.generation_keys: dict[str, list[GeometryKey]] = defaultdict(list)
        self.sample_sizes: dict[str, int | None] = {
            name: selection.options.get(spec.sample_option)
            for name, spec in selection.specs.items()
            if spec.sampled
        }
        self.samples: dict[str, TaskSample] = {}
        self._task_instances: dict[str, dict[int, list[Any]]] = {}
        self._warned: set[Any] = set()

    def add_task(self, name: str, task: Any) -> None:
        """Register a task whose documents get geometry (its sample drawn now, before scoring)."""
        self.tasks[name] = task
        self.sample_of(name)

    def plan_requests(self, instances: Iterable[Any]) -> None:
        """Plan the documents of the requests lm-eval hands the model.

        Each document is planned from ALL of its task's requests, not only
        those that reach the model: with lm-eval's ``--use_cache``, a resumed
        run hands the model only the requests its cache cannot answer, so a
        document's answer choices may arrive split (the gold one answered from
        the cache); planning from those alone would pick the wrong gold answer.
        """
        handed: dict[tuple[str, int], list[Any]] = defaultdict(list)
        for instance in instances:
            if instance.task_name in self.tasks:
                handed[(instance.task_name, instance.doc_id)].append(instance)
        # The index of each task's requests is this call's own, not kept until scoring.
        indexes: dict[str, dict[int, list[Any]]] = {}
        with templates_compiled_once():
            for ident in sorted(handed.keys() - self.plans.keys()):
                task_name, doc_id = ident
                if task_name not in indexes:
                    indexes[task_name] = _requests_by_document(self.tasks[task_name])
                self._add_plan(ident, indexes[task_name].get(doc_id) or handed[ident])

    def instances_of(self, task_name: str) -> dict[int, list[Any]]:
        """Every request of a task, by document, for scoring (built once per task)."""
        index = self._task_instances.get(task_name)
        if index is None:
            index = self._task_instances[task_name] = _requests_by_document(self.tasks[task_name])
        return index

    def _add_plan(self, ident: DocumentId, instances: list[Any]) -> None:
        task_name, doc_id = ident
        sampled = self.sampled_metrics_of(task_name, doc_id)
        plan = plan_document(self.tasks[task_name], task_name, doc_id, instances, sampled)
        self.plans[ident] = plan
        if plan is not None and plan.problem is None:
            self.plans_by_key[plan.key].append(plan)
            keys = self.generation_keys[plan.key[0]] if plan.kind == "generate_until" else None
            if keys is not None and plan.key not in keys:
                keys.append(plan.key)

    def sample_of(self, task_name: str) -> TaskSample | None:
        """The task's document sample (drawn once, from the task alone), if a metric is sampled."""
        if not self.sample_sizes:
            return None
        if task_name not in self.samples:
            sizes = self.sample_sizes.values()
            largest = None if None in sizes else max(sizes)
            seed = self.selection.options.get("sample_seed", 0)
            self.samples[task_name] = task_sample(
                self.tasks[task_name], task_name, seed, self.lm_eval_options, largest
            )
        return self.samples[task_name]

    def sampled_metrics_of(self, task_name: str, doc_id: int) -> frozenset[str]:
        """The sampled metrics whose document sample holds the document."""
        sample = self.sample_of(task_name)
        if sample is None:
            return _NO_METRICS
        held = frozenset(
            name for name, size in self.sample_sizes.items() if sample.holds(doc_id, size)
        )
        return held or _NO_METRICS  # one shared empty set per run

    def sample_record(self, task_name: str) -> dict[str, Any] | None:
        """What the geometry file records of the task's sample (`TaskSample.record`)."""
        sample = self.samples.get(task_name)
        if sample is None:
            return None
        specs = self.selection.specs
        sizes = {specs[name].sample_option: size for name, size in self.sample_sizes.items()}
        return sample.record(sizes)

    def reported_id(self, task_name: str, doc_id: int) -> int:
        """The ``doc_id`` lm-eval's samples file gives the document of requests ``doc_id``.

        Everything the run writes or warns names documents by this one.
        """
        samples = self.lm_eval_options.get("samples")
        if not samples:  # the common case: no --samples, the ids are lm-eval's own
            return doc_id
        chosen = samples.get(task_name) if isinstance(samples, Mapping) else None
        return reported_doc_id(chosen, doc_id)

    def plan_for(self, task_name: str, doc_id: int) -> DocumentPlan | None:
        """The plan of a document (planned now if lm-eval's cache answered it).

        Returns:
            None, after one warning, for a document without geometry.
        """
        ident = (task_name, doc_id)
        if ident not in self.plans:
            index = self.instances_of(task_name)
            if not index.get(doc_id):
                reported = self.reported_id(*ident)
                self.warn_once(
                    ident, f"task {task_name!r} document {reported}: no request of this "
                    "document was found, so it has no geometry"
                )  # fmt: skip
                return None
            self._add_plan(ident, index[doc_id])
        plan = self.plans[ident]
        if plan is None:
            self.warn_once(
                task_name,
                f"task {task_name!r} asks for loglikelihood_rolling (perplexity): lm-coupling "
                "measures no geometry for rolling log-likelihood, so its documents have none",
            )
        return plan

    def documents_at(self, key: GeometryKey) -> tuple[DocumentRef, ...]:
        """The documents measured at ``key`` (their identity, for the plugins)."""
        return tuple(
            DocumentRef(p.task_name, self.reported_id(p.task_name, p.doc_id))
            for p in self.plans_by_key.get(key, ())
        )

    def sampled(self, key: GeometryKey) -> bool:
        """Whether any document measured at ``key`` is in a sampled metric's sample."""
        return any(plan.sampled for plan in self.plans_by_key.get(key, ()))

    # -- warnings, one per document, naming it by its reported id -------------------
    def warn_once(self, ident: Any, message: str) -> None:
        """One GeometryWarning per ``ident`` for the whole run."""
        if ident in self._warned:
            return
        self._warned.add(ident)
        warnings.warn(f"lm-coupling: {message}", GeometryWarning, stacklevel=3)

    def warn(self, plan: DocumentPlan, message: str) -> None:
        """One GeometryWarning per document, naming task and document."""
        ident = (plan.task_name, plan.doc_id)
        reported = self.reported_id(*ident)
        self.warn_once(ident, f"task {plan.task_name!r} document {reported}: {message}")

    def warn_key(self, key: GeometryKey, message: str) -> None:
        """One GeometryWarning per document planned at ``key``."""
        for plan in self.plans_by_key.get(key, ()):
            self.warn(plan, message)
