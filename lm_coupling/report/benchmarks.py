"""Benchmark names, metric choices and naming rules shared by the report modules.

Scores are fractions in [0, 1] (lm-eval's scale). GSM8K uses the
``strict-match`` filter (as the Open LLM Leaderboard v1 scored it), else
``flexible-extract``. The CSV schema versions are listed in docs/report.md.
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
    """One leaderboard column: the lm-eval task, its metric, its Open LLM v1 shots.

    Only runs with ``shots`` few-shot examples fill it; other runs of the task
    get a ``score:<task>:<metric>`` column.
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
        name = name.removeprefix(prefix)
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def benchmark_of(task: str) -> Benchmark | None:
    """The leaderboard benchmark a task reports, or None for other tasks."""
    name = canonical_task(task)
    for bench in BENCHMARKS:
        if name == bench.task:
            return bench
    return None


def is_geometry_metric(name: str, declared: set[str], catalogue: Catalogue) -> bool:
    """Whether a results metric is geometry: ``declared`` by its run, or in its ``catalogue``."""
    return name in declared or catalogue.is_metric(name)


def parse_step(revision: str) -> int | None:
    """Training step of a revision such as ``step1000``, ``checkpoint-1000`` or ``step_1000``.

    Returns:
        The step number, or None when the revision names no step (``main``).
    """
    match = _STEP_PATTERN.search(str(revision))
    return int(match.group(1)) if match else None
