"""Benchmark names, metric choices and naming rules shared by the report modules.

Scores are fractions in [0, 1] (lm-eval's own scale), not the leaderboard's
percentages. GSM8K uses the ``strict-match`` filter (the answer after
``####``, as the Open LLM Leaderboard v1 scored it); ``flexible-extract`` is
taken only when a results file has no ``strict-match`` value, and the
provenance table records which filter was used.

CSV schema versions (``schema_version`` in every statistics table; columns
are never renamed without a new version listed here):

- ``lm_coupling.report/1``: first release.
- ``lm_coupling.report/2``: ``average`` only when all six benchmarks are
  present (was: the mean of those present); ``score:<task>:<metric>``
  columns for every other task; a metric with a K option is named after the
  setting (``coupling`` -> ``coupling_k10``), with companions
  ``<metric>__tasks``, ``<metric>__n``, ``<metric>__k_used``; local model
  paths shortened (``provenance.csv`` gains ``model_path``);
  ``correlations.csv`` gains ``task_set``, ``cooks_d_max``,
  ``cooks_d_model``, ``influential``, ``r2_without``, ``x_log_scale`` (also
  in ``controls.csv``) and reports no fit below 5 models (was 3);
  ``within_model.csv`` gains ``score_type``, ``p_holm``, ``correction``;
  ``geometry_long.csv``: ``n`` of a sampled metric is the documents measured,
  ``windowed_lss`` layers are numbered 1..L.
- ``lm_coupling.report/3``: the six benchmark columns and ``average`` are
  filled only from runs in the Open LLM v1 setting (shots per task:
  `Benchmark.shots`); a benchmark task run with other shots gets a
  ``score:<task>:<metric>`` column. A K column is named after the K asked
  for (``options_requested``), ``<metric>__k_used`` gives the K used (also
  for ``alignment_ratio``). ``leaderboard.csv`` gains ``settings``,
  ``limited``, ``metric_options``, ``mixed_settings``; its counts
  (``n_params``, ``n_layers``, ``d_model``, ``n_benchmarks``,
  ``<metric>__n``) are integers; ``provenance.csv`` gains ``setting`` and
  the status "other setting"; ``score_sources.csv`` gains ``setting``;
  ``geometry_long.csv``'s ``n`` is an integer; new ``timings.csv``.
- ``lm_coupling.report/4``: the across-model statistics (``correlations.csv``,
  ``controls.csv``) count one row per independent model: a checkpoint
  series (rows of one ``model`` at several revisions or dtypes) contributes
  one row, its last checkpoint by default (``--checkpoint``), so ``n`` counts
  models, not rows; new ``checkpoints.csv`` (every checkpoint of every
  series, with ``across_models`` marking the row the statistics took;
  `lm_coupling.report.checkpoints`). ``leaderboard.csv`` is unchanged.
  Since issue 46 no ``within_model.csv`` is written; every other table is
  as in version 4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_coupling.catalogue import Catalogue

SCHEMA_VERSION = "lm_coupling.report/4"


@dataclass(frozen=True)
class Benchmark:
    """One leaderboard column: the lm-eval task, the metric it reports, its Open LLM v1 shots.

    A run fills the column only in the Open LLM Leaderboard v1 setting, that is
    with ``shots`` few-shot examples (lm-eval's ``n-shot`` for the task); a
    run of the task with other shots is reported in a ``score:<task>:<metric>``
    column of its own.
    """

    column: str
    task: str
    metric: str
    shots: int
    filters: tuple[str, ...] = ("none",)


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("arc", "arc_challenge", "acc_norm", 25),
    Benchmark("hellaswag", "hellaswag", "acc_norm", 10),
    Benchmark("mmlu", "mmlu", "acc", 5),
    Benchmark("truthfulqa", "truthfulqa_mc2", "acc", 0),
    Benchmark("winogrande", "winogrande", "acc", 5),
    Benchmark("gsm8k", "gsm8k", "exact_match", 5, ("strict-match", "flexible-extract")),
)
BENCHMARK_COLUMNS = tuple(b.column for b in BENCHMARKS)
AVERAGE = "average"

BOUNDARY_COLUMN = "thought_fixation_boundary"
_PREFIXES = ("lmc_", "leaderboard_")
_SUFFIXES = ("_offline", "_sample")
_STEP_PATTERN = re.compile(r"(?:^|[^a-z])(?:step|checkpoint|ckpt|iter)[-_]?(\d+)", re.IGNORECASE)


def canonical_task(task: str) -> str:
    """Strip lm-coupling's offline naming (``lmc_..._offline``) from a task name."""
    name = task
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def benchmark_of(task: str) -> Benchmark | None:
    """The leaderboard benchmark a task reports, or None for other tasks."""
    name = canonical_task(task)
    for bench in BENCHMARKS:
        if name == bench.task:
            return bench
    return None


def is_geometry_metric(
    name: str, declared: set[str] | frozenset[str] = frozenset(), catalogue: Catalogue | None = None
) -> bool:
    """Whether a results metric is geometry: one of the run's metrics, or a K-named column of one.

    ``declared`` is a run's metrics (`lm_coupling.report.loading.RunFile.declared`)
    and ``catalogue`` its catalogue (for a file without one, the installed
    plugins'), which also knows the K-named columns (``coupling_k10``).
    """
    return name in declared or (catalogue is not None and catalogue.is_metric(name))


def parse_step(revision: str) -> int | None:
    """Training step of a revision such as ``step1000``, ``checkpoint-1000`` or ``step_1000``.

    Returns:
        The step number, or None when the revision names no step (``main``).
    """
    match = _STEP_PATTERN.search(str(revision))
    return int(match.group(1)) if match else None
