"""Per-task records of one run: each document's geometry summarised as lm-eval scores it."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lm_coupling.harness.plan import DocumentId, DocumentPlan
from lm_coupling.harness.run_plans import RunPlans
from lm_coupling.harness.streaming import ProfileByShape, RunningTimings
from lm_coupling.states import DocumentGeometry

__all__ = ["CAPTURE_SOURCES", "RunRecords", "TaskRecords"]

CAPTURE_SOURCES = ("in_batch", "alone", "cached", "failed")
"""Where a document's trajectory/lens geometry came from: captured inside lm-eval's own batch,
measured alone afterwards, read from the geometry cache, or failed (NaN, with a warning)."""


@dataclass
class TaskRecords:
    """Per-document geometry of one task, as lm-eval scored it, summarised as it arrives.

    Memory stays flat in the number of documents: profiles (folded in as
    soon as a document is measured, `add_profiles`), finite-value counts and
    timings are running summaries (`lm_coupling.harness.streaming`); only the
    documents that carry a sampled metric's values (at most ``coupling_docs``
    per task) are kept whole, for the plugins' ``lmc_aggregate_task``, and of
    the others only a plugin's per-document ``summaries``, if any.

    Attributes:
        profiled_ids: documents whose profiles were folded in, in that order
            (the positions of `ProfileByShape`).
        documents: the kept documents: whole, those with a sampled metric's
            values; every other document with plugin ``summaries`` (a task-level
            measure's input), as its summaries alone.
        kept_ids: lm-eval's ``doc_id`` of each of ``documents``.
        failures: ``{"doc_id", "error"}`` of documents whose geometry failed.
        capture: documents per source (`CAPTURE_SOURCES`).
        n_documents: documents scored.
        finite: per metric, the documents with a finite value.
        profiles: running summary of each profile, per shape (`ProfileByShape`).
        timings: running sums of the documents' timings.
    """

    profiled_ids: list[int] = field(default_factory=list)
    documents: list[DocumentGeometry] = field(default_factory=list)
    kept_ids: list[int] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    capture: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAPTURE_SOURCES, 0))
    n_documents: int = 0
    finite: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    profiles: dict[str, ProfileByShape] = field(default_factory=lambda: defaultdict(ProfileByShape))
    timings: RunningTimings = field(default_factory=RunningTimings)

    def add(self, doc_id: int, geometry: DocumentGeometry, keep: bool = False) -> None:
        """Fold one scored document in; keep it whole when ``keep`` (a sampled document)."""
        self.n_documents += 1
        for name, value in geometry.values.items():
            if math.isfinite(value):
                self.finite[name] += 1
        if geometry.profiles:  # those not folded in when measured (a sampled document's)
            self.add_profiles(doc_id, geometry.profiles)
        self.timings.add(geometry.timings)
        if keep:
            self.documents.append(geometry)
            self.kept_ids.append(doc_id)
        elif geometry.summaries:  # a task-level measure's input (the class docstring)
            self.documents.append(
                DocumentGeometry(summaries=geometry.summaries, failures=geometry.failures)
            )
            self.kept_ids.append(doc_id)

    def add_profiles(self, doc_id: int, profiles: dict[str, Any]) -> None:
        """Fold one document's profiles into the running summaries."""
        position = len(self.profiled_ids)
        self.profiled_ids.append(doc_id)
        for name, array in profiles.items():
            self.profiles[name].add(position, array)

    def n_measured(self, metrics: Iterable[str]) -> dict[str, int]:
        """Documents with a finite value of each metric."""
        return {name: self.finite.get(name, 0) for name in metrics}

    def extend(self, other: TaskRecords) -> None:
        """Add another rank's records of the same task."""
        offset = len(self.profiled_ids)
        self.profiled_ids.extend(other.profiled_ids)
        self.documents.extend(other.documents)
        self.kept_ids.extend(other.kept_ids)
        self.failures.extend(other.failures)
        self.n_documents += other.n_documents
        for name, count in other.finite.items():
            self.finite[name] += count
        for name, profile in other.profiles.items():
            self.profiles[name].merge(profile, offset)
        self.timings.merge(other.timings)
        for source, count in other.capture.items():
            self.capture[source] = self.capture.get(source, 0) + count


class RunRecords:
    """The scored documents of one run, per task.

    Args:
        plans: the run's plans (their selection, reported ids and warnings).
        cached: the run has a geometry cache (``--use_cache``: documents
            measured alone are then expected).

    Attributes:
        tasks: each task's records.
        scored_ids: the documents already given to lm-eval (once, though
            lm-eval scores a document once per filter).
    """

    def __init__(self, plans: RunPlans, cached: bool = False):
        self.plans = plans
        self.cached = cached
        self.tasks: dict[str, TaskRecords] = defaultdict(TaskRecords)
        self.scored_ids: set[DocumentId] = set()

    def document_values(
        self, plan: DocumentPlan, geometry: DocumentGeometry, source: tuple[str, str | None]
    ) -> dict[str, float]:
        """The per-document values lm-eval aggregates (undefined ones left out); records it once.

        lm-eval then averages each metric over the documents that define it.

        Args:
            plan: the scored document's plan.
            geometry: the measurement at its key.
            source: ``(source, error)`` of the measurement (`MeasurementStore.source_of`).
        """
        own = self._own_geometry(plan, geometry)
        values = {k: v for k, v in own.values.items() if math.isfinite(v)}
        failed = {name for failure in own.failures for name in failure.get("metrics", ())}
        specs = self.plans.selection.specs
        undefined = [n for n in own.values if n not in values and n not in failed]
        undefined = [n for n in undefined if not specs[n].nan_expected]
        targeted = [n for n in undefined if specs[n].reads_target]
        if targeted and plan.target_problem is not None:
            undefined = [name for name in undefined if name not in targeted]
            reported = self.plans.reported_id(plan.task_name, plan.doc_id)
            self.plans.warn_once(
                ("target", plan.task_name, plan.doc_id),
                f"task {plan.task_name!r} document {reported}: {', '.join(targeted)} "
                f"{'is' if len(targeted) == 1 else 'are'} undefined (NaN): {plan.target_problem}",
            )
        if undefined and source[0] != "failed":
            self.plans.warn(plan, f"undefined geometry (NaN) for {', '.join(undefined)}")
        self._record(plan.task_name, plan.doc_id, own, source)
        return values

    def _own_geometry(self, plan: DocumentPlan, geometry: DocumentGeometry) -> DocumentGeometry:
        """The part of a measurement that belongs to ``plan``'s document.

        A sampled metric outside the document's sample is not its own, nor is
        a task-level metric (its task's value is added at the end).
        """
        specs = self.plans.selection.specs
        metrics = [
            n
            for n in self.plans.selection.metrics
            if (not specs[n].sampled or n in plan.sampled_metrics) and not specs[n].task_level
        ]
        profiles = {p for n in metrics for p in specs[n].profiles}
        sampled = any(specs[n].sampled for n in metrics)
        return DocumentGeometry(
            values={name: geometry.values.get(name, math.nan) for name in metrics},
            profiles={k: v for k, v in geometry.profiles.items() if k in profiles},
            jacobian_methods=geometry.jacobian_methods if sampled else None,
            timings=dict(geometry.timings),
            summaries=dict(geometry.summaries),
            failures=[f for f in geometry.failures if set(f.get("metrics", ())) & set(metrics)],
        )

    def scored(self, task_name: str, doc_id: int | None) -> bool:
        """Whether the document's geometry was already given to lm-eval (an earlier filter)."""
        return (task_name, doc_id) in self.scored_ids

    def internal_failure(self, task_name: str, doc_id: int | None, error: str) -> None:
        """Record a document whose geometry an lm-coupling error lost (its scores are kept).

        It counts as ``failed`` with the error in the geometry file, and one
        warning names it: a bug here never passes as a quiet NaN.
        """
        if self.scored(task_name, doc_id):
            return
        outcome = ("failed", f"internal error: {error}")
        reported = self._record(task_name, doc_id, DocumentGeometry(), outcome)
        self.plans.warn_once(
            (task_name, doc_id),
            f"task {task_name!r} document {reported}: geometry not attached because of an "
            f"lm-coupling error ({error}); the benchmark's own scores are kept. Please report it",
        )

    def _record(
        self,
        task_name: str,
        doc_id: int | None,
        geometry: DocumentGeometry,
        outcome: tuple[str, str | None],
    ) -> int | None:
        """Record a scored document once (lm-eval scores it once per filter); its reported id."""
        reported = None if doc_id is None else self.plans.reported_id(task_name, doc_id)
        if self.scored(task_name, doc_id):
            return reported
        self.scored_ids.add((task_name, doc_id))
        records = self.tasks[task_name]
        specs = self.plans.selection.specs
        keep = any(specs[name].sampled for name in geometry.values)
        records.add(-1 if reported is None else reported, geometry, keep)
        source, error = outcome
        records.capture[source] += 1
        if error is not None:
            records.failures.append({"doc_id": reported, "error": error})
        for failure in geometry.failures:  # a plugin's answer failed (its metrics NaN)
            records.failures.append({"doc_id": reported, **failure})
        return reported

    def capture_report(self) -> dict[str, dict[str, Any]]:
        """Per task: ``capture`` counts and ``n_measured`` per metric.

        Warns once per task whose documents were measured alone without
        ``--use_cache`` (a second forward pass).
        """
        report = {}
        for task_name, records in sorted(self.tasks.items()):
            alone = records.capture.get("alone", 0)
            if alone and not self.cached:
                self.plans.warn_once(
                    ("alone", task_name),
                    f"task {task_name!r}: {alone} of {records.n_documents} documents were "
                    "not found in lm-eval's batches and were measured alone afterwards (a "
                    "second forward pass). Likely cause: the model input lm-eval built (its "
                    "tokenization, truncation or padding) differs from the one planned, e.g. "
                    "a custom model subclass or chat template; the values are those of the "
                    "prompt alone.",
                )  # fmt: skip
            report[task_name] = {
                "capture": dict(records.capture),
                "n_measured": records.n_measured(self.plans.selection.metrics),
            }
        return report

    def merge(self, gathered: list[dict[str, TaskRecords]]) -> None:
        """Replace the records by those gathered from every rank."""
        merged: dict[str, TaskRecords] = defaultdict(TaskRecords)
        for rank_records in gathered:
            for task_name, task_records in rank_records.items():
                merged[task_name].extend(task_records)
        self.tasks = merged
