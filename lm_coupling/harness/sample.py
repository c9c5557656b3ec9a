"""The document sample of the sampled (Jacobian) metrics: seeded, random, stratified.

A sampled metric is computed on ``coupling_docs`` documents per task (its
`MetricSpec.sample_option`), drawn here once, before any forward pass, from the
task alone (docs/metrics.md, "The coupling sample"): the population is the
documents lm-eval evaluates (``--limit``, ``--samples``); each stratum is a gold
answer of a multiple-choice task (one stratum otherwise); within each stratum
the documents are shuffled by a generator seeded with ``(sample_seed, task
name)``, and the strata are interleaved so that every prefix of the order holds
each stratum in proportion to its size (the largest shortfall from
``k * N_s / N`` goes next, ties to the first stratum in sorted order). A sample
of n documents is the first n of that order.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lm_coupling.harness.lm_eval_adapter import evaluated_documents
from lm_coupling.harness.plan import PlanError, gold_index


@dataclass(frozen=True)
class TaskSample:
    """The drawing order of one task's documents.

    Attributes:
        seed: the ``sample_seed`` it was drawn with.
        stratified_by: ``"gold answer"`` or None (one stratum).
        order: every document of the population, in drawing order, by the
            ``doc_id`` lm-eval reports (its samples file's).
        request_ids: the same documents by the ``doc_id`` of their requests
            (what the model sees; they differ under ``--samples``,
            `lm_eval_adapter.evaluated_documents`).
    """

    seed: int
    stratified_by: str | None
    order: tuple[int, ...]
    request_ids: tuple[int, ...]
    _position: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        position = {doc_id: i for i, doc_id in enumerate(self.request_ids)}
        object.__setattr__(self, "_position", position)

    def holds(self, doc_id: int, size: int | None) -> bool:
        """Whether the sample of ``size`` documents (None: all) holds requests ``doc_id``."""
        position = self._position.get(doc_id)
        return position is not None and (size is None or position < size)

    def record(self, sizes: Mapping[str, int | None]) -> dict[str, Any]:
        """What the geometry file records: seed, stratification, population, doc ids."""
        return {
            "method": "seeded random"
            + (f", stratified by {self.stratified_by}" if self.stratified_by else ""),
            "seed": self.seed,
            "population": len(self.order),
            "doc_ids": {
                option: sorted(self.order[:size] if size is not None else self.order)
                for option, size in sorted(sizes.items())
            },
        }


def drawing_order(
    doc_ids: Sequence[int], strata: Sequence[Hashable] | None, seed: int, task_name: str
) -> tuple[int, ...]:
    """Seeded, stratified drawing order of ``doc_ids`` (see the module docstring).

    Args:
        doc_ids: the population.
        strata: each document's stratum (None: one stratum).
        seed: the run's ``sample_seed``.
        task_name: mixed into the seed, so that tasks get independent orders.

    Returns:
        ``doc_ids`` reordered: the first n form the sample of n documents.
    """
    rng = random.Random(f"lm-coupling sample/{seed}/{task_name}")
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, doc_id in enumerate(doc_ids):
        groups[strata[i] if strata is not None else None].append(doc_id)
    keys = sorted(groups, key=repr)
    for key in keys:
        members = sorted(groups[key])
        rng.shuffle(members)
        groups[key] = members
    total = len(doc_ids)
    taken = dict.fromkeys(keys, 0)
    order: list[int] = []
    for k in range(1, total + 1):
        key = max(
            (s for s in keys if taken[s] < len(groups[s])),
            key=lambda s: k * len(groups[s]) / total - taken[s],
        )
        order.append(groups[key][taken[key]])
        taken[key] += 1
    return tuple(order)


def gold_strata(task: Any, docs: Iterable[Any]) -> list[Hashable] | None:
    """Each document's gold answer index (multiple choice), or None for other tasks.

    A document whose gold answer cannot be read gets the stratum ``"unreadable"``
    (its geometry is then NaN anyway, with a warning, `lm_coupling.harness.plan`).
    """
    if getattr(getattr(task, "config", None), "output_type", None) != "multiple_choice":
        return None
    strata: list[Hashable] = []
    for doc in docs:
        try:  # no bound on the index: an out-of-range gold is the plan's to report
            strata.append(gold_index(task, doc, sys.maxsize))
        except (PlanError, Exception):  # noqa: B014 (any task code): one stratum for those
            strata.append("unreadable")
    return strata


def task_sample(
    task: Any,
    task_name: str,
    seed: int,
    lm_eval_options: Mapping[str, Any],
    largest: int | None,
) -> TaskSample:
    """The drawing order of one task (labels read only when a sample is smaller than it).

    Args:
        task: the lm-eval Task.
        task_name: its name.
        seed: ``sample_seed``.
        lm_eval_options: the run's recorded lm-eval options (``limit``, ``samples``).
        largest: the largest sample size asked for (None: all documents).
    """
    samples = lm_eval_options.get("samples")
    chosen = samples.get(task_name) if isinstance(samples, Mapping) else None
    # (request id, reported id, document): under --samples lm-eval numbers the requests
    # 0, 1, ... and reports the listed index.
    documents = evaluated_documents(task, lm_eval_options.get("limit"), chosen)
    request_of = {reported: request for request, reported, _ in documents}
    reported_ids = list(request_of)
    if largest is None or largest >= len(reported_ids):
        order, strata = tuple(reported_ids), None
    else:
        strata = gold_strata(task, (doc for _, _, doc in documents))
        order = drawing_order(reported_ids, strata, seed, task_name)
    return TaskSample(
        seed,
        "gold answer" if strata else None,
        order,
        tuple(request_of[doc_id] for doc_id in order),
    )
