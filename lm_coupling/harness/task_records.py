"""Per-task records of one run: each document's geometry summarised as lm-eval scores it.

Every document's trajectory/lens geometry has one source, counted per task
(`CAPTURE_SOURCES`): captured inside lm-eval's own batch (``in_batch``),
measured alone afterwards (``alone``), read from the geometry cache
(``cached``), or ``failed`` (NaN, with a warning naming the document).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lm_coupling.harness.streaming import ProfileByShape, RunningTimings
from lm_coupling.states import DocumentGeometry

__all__ = ["CAPTURE_SOURCES", "TaskRecords"]

CAPTURE_SOURCES = ("in_batch", "alone", "cached", "failed")


@dataclass
class TaskRecords:
    """Per-document geometry of one task, as lm-eval scored it, summarised as it arrives.

    Memory stays flat in the number of documents: each document's profiles,
    finite-value counts and timings are folded into running summaries
    (`lm_coupling.harness.streaming`); only documents that carry a sampled
    metric's values (at most the sample, ``coupling_docs`` per task) are kept
    whole, for the plugins' task aggregation (``lmc_aggregate_task``); of the
    other documents only a plugin's per-document ``summaries`` are kept (none
    unless a task-level measure such as ``dataset_entropy`` is selected, whose
    summaries grow with N: ``(L+1) d`` numbers per document).

    Profiles are folded in as soon as a document is measured (`add_profiles`,
    from `GeometrySession.store`), not when lm-eval scores it: lm-eval scores
    only after every request has run, so a measurement waiting for its score
    keeps a few numbers per metric, not its ``(L+1)``-long profiles. Documents
    in a sampled metric's sample keep theirs until scoring (at most the sample).

    Attributes:
        doc_ids: scored documents, in scoring order.
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

    doc_ids: list[int] = field(default_factory=list)
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
        self.doc_ids.append(doc_id)
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
        elif geometry.summaries:
            # A plugin's per-document summaries (a task-level measure such as
            # dataset_entropy) reach lmc_aggregate_task for every document: the
            # summaries alone are kept, not the values, profiles or timings.
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

    def add_profiles_of(self, documents: list[tuple[int, dict[str, Any]]]) -> None:
        """`add_profiles` of several documents ``(doc_id, profiles)``, in order.

        A profile every document has, in one shape, is folded in as one block.
        """
        start = len(self.profiled_ids)
        names = documents[0][1].keys() if documents else ()
        if any(profiles.keys() != names for _, profiles in documents):
            for doc_id, profiles in documents:  # documents without some profile: one at a time
                self.add_profiles(doc_id, profiles)
            return
        self.profiled_ids.extend(doc_id for doc_id, _ in documents)
        for name in names:
            arrays = [np.asarray(profiles[name], dtype=np.float64) for _, profiles in documents]
            if len({array.shape for array in arrays}) == 1:
                self.profiles[name].add_block(start, np.stack(arrays))
            else:
                for position, array in enumerate(arrays, start=start):
                    self.profiles[name].add(position, array)

    def n_measured(self, metrics: Iterable[str]) -> dict[str, int]:
        """Documents with a finite value of each metric."""
        return {name: self.finite.get(name, 0) for name in metrics}

    def extend(self, other: TaskRecords) -> None:
        """Add another rank's records of the same task."""
        offset = len(self.profiled_ids)
        self.doc_ids.extend(other.doc_ids)
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
