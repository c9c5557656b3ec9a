"""Wall-time and peak-memory overhead of ``--metrics`` over a plain ``--model hf`` run.

Runs lm-eval in-process (``lm_eval.simple_evaluate``, see ``lmeval_runs``) on
the same tasks and the same randomly initialised GPT-2-shaped model (default:
GPT-2 small, d_model 768, 12 layers, 12 heads, an 8192-token BPE vocabulary)
in several configurations:

* ``plain``: lm-eval's ``hf`` model, no geometry;
* ``traj_lens``: ``--metrics lss,expodistance,equidistance,logit_lens_entropy``;
* ``traj_lens_nowin``: the same with ``--metric_args windowed=false`` (the cost
  of the windowed-LSS ring buffer, by difference);
* ``all``: ``--metrics all`` (adds the sampled Jacobian coupling metrics).

Wall time: every configuration is run ``--repeats`` times, interleaved, in one
process after an untimed warm-up (one ``TaskManager``, so lm-eval's task
indexing is outside the measurement); the table shows the median. Peak memory:
each configuration runs ``--repeats`` times in a fresh subprocess that reports
``ru_maxrss`` (CPU) or ``torch.cuda.max_memory_allocated`` (``--device cuda``),
the rounds alternating which runs first; the table shows the median. The
wall-time and peak-memory verdicts come from the rounds' ratios (`verdict_line`).

``--marginal N1,N2`` measures instead the cost per 1000 synthetic ARC-format
documents and the memory growth with N (`marginal`), on the bundled model
unless ``--model-dir`` names another. Its rounds run the configurations one
after another, in alternating order; with ``--paired`` they run at the same
time, one process each, so that a change of the machine's speed during a
round (this shared CPU's runs of one configuration vary by 10% within
minutes) falls on both: the rounds' ratios then spread far less. Give each
configuration its own core (two on a 2-core machine); sharing memory
bandwidth and caches with the other run may shift the ratio, so the two
modes are reported side by side (docs/benchmarks.md). With ``--in-process``
every run is made in this one process instead, the configurations
alternating within each round: no process start and no second process
sharing the machine, and no per-run peak memory (its columns are NaN).

Usage::

    python bench/overhead.py                     # GPT-2 small shape on CPU
    python bench/overhead.py --marginal 1000,10000 --configs plain,traj_lens --threads 1
    python bench/overhead.py --marginal 1000,10000 --configs plain,traj_lens --in-process
    python bench/overhead.py --device cuda --d-model 2048 --layers 24 --heads 16

``bench/gpu.py`` measures the same on a Pythia-1B-shaped model, each run in a
fresh process, at a fixed and at ``auto`` batch size.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from pathlib import Path

from lmeval_runs import (
    DEFAULT_TASKS,
    TRAJ_LENS,
    RunSpec,
    run_fresh,
    run_in_process,
    save_random_model,
    task_manager,
)
from timing import machine_line, median, memory_label, print_table

CONFIGS = {
    "plain": (None, None),
    "traj_lens": (TRAJ_LENS, None),
    "traj_lens_nowin": (TRAJ_LENS, "windowed=false"),
    "all": ("all", None),
}
TARGET = 1.05


def spec_for(name: str, args: argparse.Namespace) -> RunSpec:
    """The run of configuration ``name``."""
    metrics, metric_args = CONFIGS[name]
    return RunSpec(
        model_dir=str(args.model_dir),
        tasks=args.tasks,
        limit=args.limit,
        batch_size=str(args.batch_size),
        device=args.device,
        metrics=metrics,
        metric_args=metric_args,
    )


def measure_memory(args: argparse.Namespace, names: list[str]) -> dict[str, list[float]]:
    """Peak memory (MiB) of each configuration in ``--repeats`` rounds of fresh subprocesses.

    One fresh process's peak moves by tens of MiB from run to run of the same
    code (docs/benchmarks.md), so one run per configuration cannot settle a
    ratio of 1.05. The rounds alternate which configuration runs first.
    """
    results: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            results[name].append(run_fresh(spec_for(name, args))["peak_mb"])
            print(f"  round {round_ + 1} memory {name}: {results[name][-1]:.1f} MiB", flush=True)
    return results


def measure_time(args: argparse.Namespace, names: list[str]) -> dict[str, list[tuple]]:
    """``(wall, CPU)`` seconds of each configuration, ``repeats`` interleaved rounds."""
    tm = task_manager(args.tasks)
    for name in names:
        run_in_process(spec_for(name, args), tm, limit=2)
    times: dict[str, list[tuple]] = {name: [] for name in names}
    for round_ in range(args.repeats):
        for name in names:
            out = run_in_process(spec_for(name, args), tm)
            times[name].append((out["wall_s"], out["cpu_s"]))
            print(
                f"  round {round_ + 1} {name}: wall {out['wall_s']:.2f} s, "
                f"cpu {out['cpu_s']:.2f} s",
                flush=True,
            )
    return times


def report(args, times: dict[str, list[tuple]], memory: dict[str, list[float]]) -> None:
    """The result table (medians, ratios to ``plain``) and the verdicts against ``TARGET``.

    The wall-time and peak-memory verdicts come from the per-round ratios of
    ``traj_lens`` to ``plain`` (`verdict_line`): a round's runs are
    interleaved, so a change of the machine's speed falls on both.
    """
    wall = {name: median([t for t, _ in runs]) for name, runs in times.items()}
    cpu = {name: median([c for _, c in runs]) for name, runs in times.items()}
    peak = {name: median(runs) for name, runs in memory.items()}
    print(
        f"\nmodel: GPT-2 shape {args.shape}; device={args.device}; tasks={args.tasks}; "
        f"limit={args.limit}; batch_size={args.batch_size}; "
        f"median of {args.repeats} interleaved runs (peak memory: one fresh process per run)"
    )
    print(machine_line(args.device))
    rows = [
        (
            name,
            wall[name],
            wall[name] / wall["plain"],
            cpu[name],
            cpu[name] / cpu["plain"],
            peak[name],
            peak[name] / peak["plain"],
        )
        for name in times
    ]
    header = ("config", "wall s", "wall ratio", "cpu s", "cpu ratio", memory_label(args.device))
    print_table("overhead inside lm-eval", (*header, "mem ratio"), rows)
    wall_rounds = [t / p for (t, _), (p, _) in zip(times["traj_lens"], times["plain"], strict=True)]
    peak_rounds = [t / p for t, p in zip(memory["traj_lens"], memory["plain"], strict=True)]
    for label, rounds in (("wall", wall_rounds), ("peak memory", peak_rounds)):
        print(f"traj_lens {label} ratio of each round: {', '.join(f'{r:.3f}' for r in rounds)}")
    print(f"traj_lens: --metrics {TRAJ_LENS}")
    print(verdict_line(wall["traj_lens"] / wall["plain"], wall_rounds, target="wall-time"))
    print(verdict_line(peak["traj_lens"] / peak["plain"], peak_rounds, target="peak-memory"))


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--tasks", default=DEFAULT_TASKS)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds (--marginal: two or more give the verdict from their 95%% interval)",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved model")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads, here and in every fresh worker (default: torch's own)",
    )
    parser.add_argument(
        "--marginal",
        default=None,
        help="N1,N2: CPU per 1000 synthetic ARC documents and memory growth (bench/marginal.py)",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="--marginal: run the configurations of a round at the same time, one process "
        "each, so that both see the same machine (give each a core of its own)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="--marginal: make every run in this process, the configurations alternating "
        "(no second process; no per-run peak memory)",
    )
    args = parser.parse_args(argv)
    if args.paired and not args.marginal:
        parser.error("--paired pairs the rounds of --marginal; add --marginal N1,N2")
    if args.in_process and not args.marginal:
        parser.error("--in-process runs the rounds of --marginal; add --marginal N1,N2")
    if args.in_process and args.paired:
        parser.error("--paired runs fresh processes at once; --in-process runs one at a time")
    return args


def main_marginal(args: argparse.Namespace, names: list[str]) -> None:
    """The ``--marginal`` mode: per-1000-document CPU and memory growth, and their ratios."""
    from marginal import marginal, per_round, per_thousand

    from lm_coupling.demo.assets import bundled_model_path

    sizes = tuple(int(n) for n in args.marginal.split(","))
    model_dir = str(args.model_dir or bundled_model_path())
    configs = {name: CONFIGS[name] for name in names}
    with tempfile.TemporaryDirectory(prefix="lmc-marginal-") as tmp:
        out = marginal(model_dir, sizes, configs, str(args.batch_size), args.device,
                       Path(tmp) / "data", args.repeats, args.paired,
                       args.in_process)  # fmt: skip
    print(f"\nmodel: {model_dir}; device={args.device}; batch_size={args.batch_size}; "
          f"threads={args.threads or 'torch default'}; "
          f"N = {sizes[0]} -> {sizes[1]} synthetic ARC-format documents; "
          f"median of {args.repeats} round(s), "
          + ("every run in this process (--in-process; no per-run peak memory)"
             if args.in_process else "fresh process per run")
          + ("; the configurations of a round run at the same time (--paired)"
             if args.paired else "; counterbalanced order"))  # fmt: skip
    print(machine_line(args.device))
    cpu = {name: per_thousand(out[name], sizes, "cpu_s") for name in names}
    wall = {name: per_thousand(out[name], sizes, "wall_s") for name in names}
    mem = {name: per_thousand(out[name], sizes, "peak_mb") for name in names}
    rows = [
        (name, cpu[name], cpu[name] / cpu["plain"], wall[name], wall[name] / wall["plain"],
         mem[name], mem[name] - mem["plain"])
        for name in names
    ]  # fmt: skip
    header = ("config", "cpu s/1000", "cpu ratio", "wall s/1000", "wall ratio",
              "MiB/1000", "MiB/1000 over plain")  # fmt: skip
    print_table("marginal cost per 1000 documents", header, rows)
    plain_rounds = per_round(out["plain"], sizes, "cpu_s")
    round_ratios = {}
    for name in (n for n in names if n != "plain"):
        rounds = zip(per_round(out[name], sizes, "cpu_s"), plain_rounds, strict=True)
        round_ratios[name] = ratios = [t / p for t, p in rounds]
        print(f"{name} cpu ratio of each round: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(collector_lines(out, sizes, names))
    ratio = cpu["traj_lens"] / cpu["plain"]
    print(verdict_line(ratio, round_ratios["traj_lens"]))


def collector_lines(out: dict, sizes: tuple[int, int], names: list[str]) -> str:
    """Python's garbage collector in the marginal runs: its seconds and full collections.

    A diagnostic beside the verdict, not part of it: a full collection walks
    every object lm-eval keeps, so one more of them at N2 than plain makes
    moves the per-document ratio by a whole walk (`lmeval_runs.CollectorTime`).
    """
    from marginal import per_thousand

    n1, n2 = sizes
    lines = ["garbage collector (seconds per 1000 documents; full collections at N1 -> N2 "
             "of each round):"]  # fmt: skip
    without = {}
    for name in names:
        rounds = list(zip(out[name][n1], out[name][n2], strict=True))
        counts = ", ".join(f"{a['gc_full']} -> {b['gc_full']}" for a, b in rounds)
        collector = per_thousand(out[name], sizes, "gc_s")
        lines.append(f"  {name}: {collector:.3f} s/1000; full collections {counts}")
        without[name] = per_thousand(out[name], sizes, lambda run: run["cpu_s"] - run["gc_s"])
    lines.append("  cpu ratio without the collector's time: " + ", ".join(
        f"{name} {without[name] / without['plain']:.3f}" for name in names if name != "plain"
    ))  # fmt: skip
    return "\n".join(lines)


def round_interval(rounds: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean of the per-round ratios and its two-sided Student-t interval ``(mean, low, high)``.

    Each round is four fresh runs (plain and traj_lens at N1 and N2), so its
    ratio is one independent draw of the machine's noise; the interval is
    ``mean +- t_{level, n-1} s / sqrt(n)`` with ``s`` the rounds' sample
    standard deviation. Needs at least two rounds.
    """
    from scipy import stats

    n = len(rounds)
    if n < 2:
        raise ValueError(f"an interval needs at least two rounds, got {n}")
    mean = statistics.fmean(rounds)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * statistics.stdev(rounds) / math.sqrt(n)
    return mean, mean - half, mean + half


def rounds_to_settle(rounds: list[float], level: float = 0.95) -> int | None:
    """About how many rounds would put the interval wholly on one side of `TARGET`.

    The rounds' mean and spread taken as they are: the fewest ``n`` rounds
    (more than were run) whose Student-t interval ``t_{level, n-1} s / sqrt(n)``
    (`round_interval`) is narrower than the mean's distance to the target.
    The search starts at the normal quantile's answer, which the t quantile
    (larger at every ``n``) can only raise. None when the mean is on the target.
    """
    from scipy import stats

    mean, spread = statistics.fmean(rounds), statistics.stdev(rounds)
    gap = abs(mean - TARGET)
    if gap == 0:
        return None
    quantile = 0.5 + level / 2
    n = max(len(rounds) + 1, math.ceil((stats.norm.ppf(quantile) * spread / gap) ** 2))
    while stats.t.ppf(quantile, n - 1) * spread / math.sqrt(n) > gap:
        n += 1
    return n


def verdict_line(
    ratio: float, rounds: list[float], level: float = 0.95, target: str = "per-document CPU"
) -> str:
    """The verdict on a ratio: from the rounds' confidence interval when there are two or more.

    On a shared machine one round's ratio moves by several percent (each
    round is four fresh runs, minutes apart). With two or more rounds the
    verdict is read from the ``level`` interval of their mean
    (`round_interval`): ``meets`` when it lies at or below `TARGET`,
    ``MISSES`` when it lies above, and undecided when it contains the
    target, with about how many rounds would settle it (`rounds_to_settle`).
    One round gives the median's verdict alone. ``ratio`` (the table's, the
    ratio of the medians) is quoted either way; ``target`` names the target.
    """
    if len(rounds) < 2:
        verdict, detail = ("meets" if ratio <= TARGET else "MISSES"), ""
    else:
        mean, low, high = round_interval(rounds, level)
        detail = (
            f"; rounds' mean {mean:.3f}, {level:.0%} interval {low:.3f}-{high:.3f} "
            f"over {len(rounds)} rounds"
        )
        if high <= TARGET:
            verdict = "meets"
        elif low > TARGET:
            verdict = "MISSES"
        else:
            verdict = "is undecided against"
            needed = rounds_to_settle(rounds, level)
            detail += ", which contains the target"
            if needed is not None:
                detail += f"; about {needed} rounds would settle it"
    return f"traj_lens {verdict} the {TARGET:.2f}x {target} target ({ratio:.3f}x{detail})"


def main(argv=None) -> None:
    """Build the model, measure memory and time, print the table."""
    args = parse_args(argv)
    if args.threads is not None:  # fresh workers read it when torch starts
        import torch

        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    names = args.configs.split(",")
    if "plain" not in names or "traj_lens" not in names:
        raise SystemExit("--configs must include plain and traj_lens (the ratio's terms)")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")
    if args.marginal:
        main_marginal(args, names)
        return
    args.shape = dict(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    with tempfile.TemporaryDirectory(prefix="lmc-bench-") as tmp:
        if args.model_dir is None:
            args.model_dir = save_random_model(
                Path(tmp) / "model",
                "gpt2",
                tokenizer_vocab=args.vocab,
                max_len=args.max_len,
                **args.shape,
            )
        print(f"model in {args.model_dir}: {args.shape}", flush=True)
        memory = measure_memory(args, names)
        times = measure_time(args, names)
        report(args, times, memory)


if __name__ == "__main__":
    main()
