"""The run's measurement store: each planned request's geometry, from measured to scored."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

from lm_coupling.harness.plan import DocumentPlan, GeometryKey
from lm_coupling.harness.run_plans import RunPlans
from lm_coupling.harness.task_records import RunRecords
from lm_coupling.states import DocumentGeometry

__all__ = ["MeasurementStore"]


class MeasurementStore:
    """The measurements of one run, by request (`GeometryKey`: duplicate prompts share one).

    A measurement is written to the geometry cache, looked up when lm-eval
    scores its documents (or measured alone then), and released once every
    document measured at it is scored.

    Args:
        plans: the run's plans (who is measured at each key, and warnings).
        records: the run's task records, where measured profiles are folded.
        streamed_metrics: the metrics every document needs.
        cache: the geometry cache (a ``GeometryCache``), else None.

    Attributes:
        measured: the measurements waiting for lm-eval's scoring.
        sources: each key's source (`task_records.CAPTURE_SOURCES`).
        failed_keys: the keys whose measurement failed (NaN).
    """

    def __init__(
        self,
        plans: RunPlans,
        records: RunRecords,
        streamed_metrics: Collection[str],
        cache: Any = None,
    ):
        self.plans = plans
        self.records = records
        self.streamed_metrics = streamed_metrics
        self.cache = cache
        self.measured: dict[GeometryKey, DocumentGeometry] = {}
        self.sources: dict[GeometryKey, str] = {}
        self.failed_keys: set[GeometryKey] = set()

    def wanted(self, key: GeometryKey) -> bool:
        """Whether ``key`` is planned and not measured yet."""
        return key in self.plans.plans_by_key and key not in self.measured

    def needed_metrics(self, key: GeometryKey) -> set[str]:
        """The metrics the documents measured at ``key`` need."""
        needed = set(self.streamed_metrics)
        for plan in self.plans.plans_by_key.get(key, ()):
            needed |= plan.sampled_metrics
        return needed

    def store(
        self, key: GeometryKey, geometry: DocumentGeometry, source: str | None = None
    ) -> None:
        """Keep a measurement (and write it to the cache, if any).

        Args:
            key: the measured request.
            geometry: its values (merged into an earlier part, if any).
            source: ``in_batch``, ``alone`` or ``cached`` for the trajectory/lens
                part; None for a later part (the Jacobian metrics).
        """
        existing = self.measured.get(key)
        if existing is not None:
            existing.merge(geometry)
            geometry = existing
        self.measured[key] = geometry
        if source is not None:
            self.sources[key] = source
        if self.cache is not None and key not in self.failed_keys and source != "cached":
            try:
                self.cache.put(key, geometry)
            except Exception as exc:  # the measurement stands; only its caching failed
                self.plans.warn_once(
                    "cache", f"the geometry cache {self.cache.path} could not be written "
                    f"({exc!r}); values are kept but not cached",
                )  # fmt: skip
        if source is not None and not self.plans.sampled(key):
            self._fold_profiles(key, geometry)

    def _fold_profiles(self, key: GeometryKey, geometry: DocumentGeometry) -> None:
        """Fold a complete measurement's profiles into its tasks' summaries, then drop them."""
        if not geometry.profiles:
            return
        for plan in self.plans.plans_by_key.get(key, ()):
            self.records.tasks[plan.task_name].add_profiles(plan.doc_id, geometry.profiles)
        # A copy without them: the caller's object (a duplicate prompt's source) is unchanged.
        self.measured[key] = geometry.without_profiles()

    def lookup(self, key: GeometryKey) -> DocumentGeometry | None:
        """A measurement from this run, or a complete one from an earlier run's cache."""
        found = self.measured.get(key)
        if found is None and self.cache is not None:
            cached = self.cache.get(key)
            if cached is not None and self.needed_metrics(key) <= set(cached.values):
                self.store(key, cached, "cached")
                found = self.measured[key]
        return found

    def fail(
        self, keys: Iterable[GeometryKey], error: str, metrics: tuple[str, ...] | None = None
    ) -> None:
        """Record a failed measurement as NaN, with one warning per document.

        Args:
            keys: the requests whose measurement failed.
            error: the error's text (the exception's traceback would keep tensors alive).
            metrics: the metrics that failed (default: all the selected ones).
        """
        metrics = metrics if metrics is not None else self.plans.selection.metrics
        for key in keys:
            self.failed_keys.add(key)
            self.plans.warn_key(key, f"its geometry failed ({error}); values are NaN")
            failed = DocumentGeometry(values={name: math.nan for name in metrics})
            self.measured.setdefault(key, DocumentGeometry()).merge(failed)
            self.sources.setdefault(key, "failed")

    def geometry_for(
        self, plan: DocumentPlan, measure_alone: Callable[[DocumentPlan], DocumentGeometry]
    ) -> DocumentGeometry:
        """This run's (or the cache's) measurement, else the prompt measured alone.

        Documents lm-eval answered from its own cache never reached the model:
        ``measure_alone`` (`CouplingHFLM.measure_alone`) measures them now.
        """
        if plan.problem is not None:
            self.plans.warn(plan, f"{plan.problem}; its geometry is NaN")
            return DocumentGeometry(values=dict.fromkeys(self.plans.selection.metrics, math.nan))
        found = self.lookup(plan.key)
        if found is not None:
            return found
        try:
            self.store(plan.key, measure_alone(plan), "alone")
        except Exception as exc:  # a broken document must not stop the scoring
            self.fail([plan.key], repr(exc))
        return self.measured[plan.key]

    def source_of(self, plan: DocumentPlan) -> tuple[str, str | None]:
        """``(source, error)`` of a document's measurement (`CAPTURE_SOURCES`)."""
        if plan.problem is not None:
            return "failed", plan.problem
        if plan.key in self.failed_keys:
            return "failed", "its geometry failed (see the warning)"
        return self.sources.get(plan.key, "alone"), None

    def release(self, key: GeometryKey) -> None:
        """Drop a measurement once every document planned at ``key`` is scored."""
        plans = self.plans.plans_by_key.get(key, ())
        if all(self.records.scored(plan.task_name, plan.doc_id) for plan in plans):
            self.measured.pop(key, None)
