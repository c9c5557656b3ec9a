"""Wall-time and peak-memory overhead of ``--metrics`` over a plain ``--model hf`` run.

Runs lm-eval in-process (``lm_eval.simple_evaluate``) on the same tasks and the
same randomly initialised GPT-2-shaped model (default: GPT-2 small, d_model 768,
12 layers, 12 heads, an 8192-token BPE vocabulary) in several configurations:

* ``plain``: lm-eval's ``hf`` model, no geometry;
* ``traj_lens``: ``--metrics lss,expodistance,equidistance,logit_lens_entropy``;
* ``traj_lens_nowin``: the same with ``--metric_args windowed=false`` (the cost
  of the windowed-LSS ring buffer, by difference);
* ``all``: ``--metrics all`` (adds the sampled Jacobian coupling metrics).

Geometry is switched on exactly as ``lm_eval ... --metrics`` does it
(``lm_coupling.harness.cli.run_with_geometry``): a ``GeometrySession``, the
``hf-coupling`` model, ``register_with_lm_eval`` and ``geometry_run``. One
``TaskManager`` is built per process, so lm-eval's task indexing (~15 s) is
outside the measurement; model loading, request building, the forward passes
and scoring are inside it.

Wall time: every configuration is run ``--repeats`` times, interleaved, in one
process after an untimed warm-up; the table shows the median. Peak memory:
each configuration runs once in a fresh subprocess (``--worker``) that reports
``ru_maxrss`` (CPU) or ``torch.cuda.max_memory_allocated`` (``--device cuda``).

Usage::

    python bench/overhead.py                     # GPT-2 small shape on CPU
    python bench/overhead.py --device cuda --d-model 2048 --layers 24 --heads 16
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAJ_LENS = "lss,expodistance,equidistance,logit_lens_entropy"
CONFIGS = {
    "plain": (None, None),
    "traj_lens": (TRAJ_LENS, None),
    "traj_lens_nowin": (TRAJ_LENS, "windowed=false"),
    "all": ("all", None),
}
TARGET = 1.10
DEFAULT_TASKS = (
    "lmc_arc_easy_offline,lmc_arc_challenge_offline,lmc_hellaswag_offline,lmc_mmlu_sample,"
    "lmc_truthfulqa_mc2_offline,lmc_winogrande_offline"
)
"""The log-likelihood tasks of ``lmc_demo`` (all bundled documents). gsm8k is left out:
its time is spent in decoding steps, which capture never touches, so it would only
dilute the ratio."""


def _tokenizer_texts(seed: int = 0) -> list[str]:
    """The demo training corpus plus seeded pseudo-words: enough for an 8k BPE vocabulary."""
    from lm_coupling.demo.corpus import build_corpus, make_demo_data

    docs = build_corpus(make_demo_data(seed))
    rng = random.Random(seed)
    onsets = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl st tr".split()
    nuclei = "a e i o u ai ea ou io".split()
    syllables = [onset + nucleus for onset in onsets for nucleus in nuclei]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(6000)]
    docs += [" ".join(rng.choice(words) for _ in range(60)) for _ in range(2000)]
    return docs


def build_model(path: Path, args: argparse.Namespace) -> Path:
    """Save a random GPT-2-shaped model and its trained tokenizer to ``path``."""
    import torch
    import transformers

    from lm_coupling.demo.tiny import train_tokenizer

    tokenizer = train_tokenizer(_tokenizer_texts(), vocab_size=args.vocab)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=args.max_len,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _task_manager():
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.cli import TASKS_DIR

    return TaskManager(include_path=str(TASKS_DIR))


def run_config(name: str, args: argparse.Namespace, tm, limit=None) -> tuple[float, float]:
    """One ``simple_evaluate`` of configuration ``name``: ``(wall s, process CPU s)``."""
    import lm_eval

    metrics, metric_args = CONFIGS[name]
    model_args = f"pretrained={args.model_dir},dtype=float32"
    kwargs = dict(
        model_args=model_args,
        tasks=args.tasks.split(","),
        task_manager=tm,
        batch_size=args.batch_size,
        limit=limit if limit is not None else args.limit,
        device=args.device,
        bootstrap_iters=0,
        verbosity="ERROR",
    )
    if metrics is None:
        start, cpu = time.perf_counter(), time.process_time()
        lm_eval.simple_evaluate(model="hf", **kwargs)
        return time.perf_counter() - start, time.process_time() - cpu
    import lm_coupling.harness.model  # noqa: F401  (registers "hf-coupling")
    from lm_coupling.harness.cli import geometry_run
    from lm_coupling.harness.registry import register_with_lm_eval
    from lm_coupling.harness.session import GeometrySession
    from lm_coupling.selection import make_selection

    session = GeometrySession(make_selection(metrics, metric_args))
    register_with_lm_eval(session.selection.specs)
    start, cpu = time.perf_counter(), time.process_time()
    with geometry_run(session):
        lm_eval.simple_evaluate(model="hf-coupling", **kwargs)
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    if not session.measured:
        raise RuntimeError(f"configuration {name} measured no document: the bench is broken")
    return elapsed


def worker(args: argparse.Namespace) -> None:
    """Subprocess entry: run one configuration once and print its peak memory as JSON."""
    import torch

    tm = _task_manager()
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    elapsed = run_config(args.worker, args, tm)
    out = {"config": args.worker, "wall_s": elapsed[0]}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device.startswith("cuda"):
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(out), flush=True)


def _worker_argv(args: argparse.Namespace, name: str) -> list[str]:
    argv = [sys.executable, __file__, "--worker", name, "--model-dir", str(args.model_dir)]
    for flag in ("tasks", "batch_size", "device"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.limit is not None:
        argv += ["--limit", str(args.limit)]
    return argv


def measure_memory(args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """Peak memory of each configuration, each in a fresh subprocess."""
    results = {}
    for name in names:
        proc = subprocess.run(_worker_argv(args, name), capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"worker {name} failed:\n{proc.stderr[-4000:]}")
        results[name] = json.loads(lines[-1][len("RESULT ") :])
        print(f"  memory {name}: {results[name]}", flush=True)
    return results


def measure_time(args: argparse.Namespace, names: list[str]) -> dict[str, list[tuple]]:
    """``(wall, CPU)`` seconds of each configuration, ``repeats`` interleaved rounds."""
    tm = _task_manager()
    for name in names:
        run_config(name, args, tm, limit=2)
    times: dict[str, list[tuple]] = {name: [] for name in names}
    for round_ in range(args.repeats):
        for name in names:
            times[name].append(run_config(name, args, tm))
            wall, cpu = times[name][-1]
            print(f"  round {round_ + 1} {name}: wall {wall:.2f} s, cpu {cpu:.2f} s", flush=True)
    return times


def print_table(args, times: dict[str, list[tuple]], memory: dict[str, dict]) -> None:
    """The result table: medians, ratios to ``plain`` and the 1.10x target."""
    key = "cuda_peak_mb" if args.device.startswith("cuda") else "peak_rss_mb"
    wall = {name: statistics.median(t for t, _ in runs) for name, runs in times.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in times.items()}
    base_m = memory["plain"][key]
    shape = args.shape
    print()
    print(
        f"model: GPT-2 shape d_model={shape['n_embd']} layers={shape['n_layer']} "
        f"heads={shape['n_head']} vocab={shape['vocab']}; device={args.device}; "
        f"tasks={args.tasks}; limit={args.limit}; batch_size={args.batch_size}; "
        f"median of {args.repeats} interleaved runs"
    )
    header = (
        f"{'config':<16} {'wall s':>8} {'wall ratio':>11} {'cpu s':>8} {'cpu ratio':>10} "
        f"{key:>12} {'mem ratio':>10}"
    )
    print(header)
    print("-" * len(header))
    for name in times:
        m = memory[name][key]
        print(
            f"{name:<16} {wall[name]:>8.2f} {wall[name] / wall['plain']:>10.3f}x "
            f"{cpu[name]:>8.2f} {cpu[name] / cpu['plain']:>9.3f}x {m:>12.1f} {m / base_m:>9.3f}x"
        )
    t = wall["traj_lens"] / wall["plain"]
    m = memory["traj_lens"][key] / base_m
    verdict = "meets" if t <= TARGET and m <= TARGET else "MISSES"
    print(f"traj_lens ({TRAJ_LENS}) {verdict} the {TARGET:.2f}x wall-time and memory target")


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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved model")
    parser.add_argument("--worker", choices=tuple(CONFIGS), default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """Build the model, measure memory and time, print the table."""
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    names = args.configs.split(",")
    if "plain" not in names or "traj_lens" not in names:
        raise SystemExit("--configs must include plain and traj_lens (the ratio's terms)")
    with tempfile.TemporaryDirectory(prefix="lmc-bench-") as tmp:
        if args.model_dir is None:
            args.model_dir = build_model(Path(tmp) / "model", args)
        import transformers

        config = transformers.AutoConfig.from_pretrained(args.model_dir)
        args.shape = {key: getattr(config, key) for key in ("n_embd", "n_layer", "n_head")}
        args.shape["vocab"] = len(transformers.AutoTokenizer.from_pretrained(args.model_dir))
        print(f"model in {args.model_dir}: {args.shape}", flush=True)
        memory = measure_memory(args, names)
        times = measure_time(args, names)
        print_table(args, times, memory)


if __name__ == "__main__":
    main()
