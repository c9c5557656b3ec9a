"""Marginal cost per 1000 documents and memory growth with N (``bench/overhead.py --marginal``).

Synthetic ARC-format documents (``write_arc_items``: four one-word choices,
random gold) are evaluated at two sizes N1 < N2 by ``lmc_arc_easy_offline``,
each run in a fresh process (`lmeval_runs.run_fresh`), for ``plain`` and
``traj_lens``. The fixed costs (imports, model loading, task building) cancel
in the differences:

* CPU per 1000 documents: ``(cpu(N2) - cpu(N1)) / (N2 - N1) * 1000``;
* memory growth per 1000 documents: the same with the peak resident memory.

The ratio traj_lens / plain of the first is the per-document overhead of
trajectory + lens where the forward pass is cheap; the difference of the
second is what geometry keeps per document beyond lm-eval's own growth.

With ``in_process`` every run is made in this process instead (one task
manager, each configuration warmed up first), the configurations
alternating within each round: no process start and no second process, but
no per-run peak memory either (``peak_mb`` is NaN).
"""

from __future__ import annotations

import json
import math
import operator
import os
import random
from collections.abc import Callable
from pathlib import Path

from lmeval_runs import (
    RunSpec,
    finish_fresh,
    run_fresh,
    run_in_process,
    start_fresh,
    task_manager,
)

TASK = "lmc_arc_easy_offline"

WORDS = (
    "red blue green stone river cloud apple bread tiger horse north south water fire wind "
    "light glass paper metal sugar salt winter summer moon star"
).split()


def write_arc_items(folder: Path, n: int, seed: int = 0) -> Path:
    """``n`` synthetic ARC-Easy-format test rows (and 3 train rows) under ``folder/arc_easy``."""
    rng = random.Random(seed)
    target = folder / "arc_easy"
    target.mkdir(parents=True, exist_ok=True)

    def row(i: int) -> dict:
        choices = rng.sample(WORDS, 4)
        question = f"Item {i}: which word follows {rng.choice(WORDS)} {rng.choice(WORDS)}?"
        return {
            "id": f"synthetic-{i}",
            "question": question,
            "choices": {"text": choices, "label": ["A", "B", "C", "D"]},
            "answerKey": "ABCD"[rng.randrange(4)],
        }

    for split, count in (("test", n), ("train", 3)):
        text = "".join(json.dumps(row(i)) + "\n" for i in range(count))
        (target / f"{split}.jsonl").write_text(text, encoding="utf-8")
    return folder


def marginal(model_dir: str, sizes: tuple[int, int], configs: dict, batch_size: str,
             device: str, data_dir: Path, repeats: int = 1,
             paired: bool = False, in_process: bool = False) -> dict:  # fmt: skip
    """``{config: {N: [result, ...]}}`` of runs at each size (interleaved rounds).

    Within a round the configurations run in turn at each size, in the given
    order in odd rounds and the reverse in even ones; an even number of
    rounds balances the order. Each run is a fresh process, unless
    ``in_process`` (see the module docstring). ``paired``: they run at the
    same time instead, one process each (give each its own core: two
    configurations on two), so that whatever the machine's speed does
    during a run, both see it.
    """
    if paired and in_process:
        raise ValueError("paired runs are fresh processes; in_process runs one at a time")
    write_arc_items(data_dir, max(sizes))
    os.environ["LM_COUPLING_DATA_DIR"] = str(data_dir)  # the workers inherit it
    out: dict = {name: {n: [] for n in sizes} for name in configs}
    names = list(configs)

    def spec(name: str, n: int) -> RunSpec:
        metrics, metric_args = configs[name]
        return RunSpec(model_dir=model_dir, tasks=TASK, limit=n, batch_size=batch_size,
                       device=device, metrics=metrics, metric_args=metric_args)  # fmt: skip

    manager = task_manager(TASK) if in_process else None
    if in_process:  # untimed: imports, first calls, dataset caches of every configuration
        for name in names:
            run_in_process(spec(name, 2), manager)
    for round_ in range(repeats):
        for n in sizes:
            specs = {name: spec(name, n) for name in run_order(names, round_)}
            if in_process:
                results = {
                    name: {**run_in_process(run, manager), "peak_mb": math.nan}
                    for name, run in specs.items()
                }
            elif paired:
                started = {name: start_fresh(run) for name, run in specs.items()}
                results = {name: finish_fresh(started[name], run) for name, run in specs.items()}
            else:
                results = {name: run_fresh(run) for name, run in specs.items()}
            for name, result in results.items():
                out[name][n].append(result)
                print(f"  round {round_ + 1} {name} N={n}: cpu {result['cpu_s']:.1f} s, "
                      f"wall {result['wall_s']:.1f} s, peak {result['peak_mb']:.0f} MiB",
                      flush=True)  # fmt: skip
    return out


def run_order(names: list[str], round_: int) -> list[str]:
    """The configurations in the order round ``round_`` (0-based) runs them at each size.

    Counterbalanced: as given in even rounds, reversed in odd ones, so that no
    configuration always runs first (a run that always came second would
    carry alone whatever drift the machine has within a round).
    """
    return list(names) if round_ % 2 == 0 else list(names)[::-1]


def per_round(
    results: dict, sizes: tuple[int, int], field: str | Callable[[dict], float]
) -> list[float]:
    """``(field(N2) - field(N1)) / (N2 - N1) * 1000`` of each round.

    ``field``: a result's key, or a function of a result (a derived figure).
    """
    n1, n2 = sizes
    value = field if callable(field) else operator.itemgetter(field)
    rounds = zip(results[n1], results[n2], strict=True)
    return [(value(b) - value(a)) / (n2 - n1) * 1000 for a, b in rounds]


def per_thousand(
    results: dict, sizes: tuple[int, int], field: str | Callable[[dict], float]
) -> float:
    """Median over rounds of ``(field(N2) - field(N1)) / (N2 - N1) * 1000`` (`per_round`)."""
    from timing import median

    return median(per_round(results, sizes, field))
