"""What the geometry costs on a real model: SmolLM2-135M-Instruct on CPU, per document and metric.

Fetches SmolLM2-135M-Instruct (GGUF Q4_1, ``lm-coupling models fetch smollm2``),
loads it once (float32, dequantized by transformers) and evaluates real
ARC-Easy items (``../shared/benchmarks``, converted to the offline layout)
in this process, the model in memory, one lm-eval task index for every run.
Everything is measured in one run, so that the figures share the machine's
load (printed with each round and in the table's title).

* **Per document, fixed costs cancelled.** Each configuration runs at two
  sizes, ``N1`` and ``N2`` documents; its cost per document is the marginal
  ``(t(N2) - t(N1)) / (N2 - N1)`` (the model probes, the session, the
  geometry file and the leaderboard are paid once per run and cancel), and
  ``t(N1) - N1 * marginal`` is its fixed cost per run. Configurations:
  ``plain`` (lm-eval's own ``HFLM``, ``lm_eval.simple_evaluate``, no
  lm-coupling), ``forward`` (every forward-pass metric: ``lss``,
  ``expodistance``, ``equidistance``, ``logit_lens_entropy``, ``tv_to_target``,
  ``fixation_depth``, ``prompt_entropy``, ``curvature``, ``effective_rank``),
  and each of those metrics alone (``--per metric``; ``--per group``: the
  trajectory, lens and Layer by Layer groups). The rounds interleave every
  configuration at both sizes, alternating the order (``bench/marginal.py``'s
  ``run_order``); a round's ratio is its marginal over plain's marginal in the
  same round, and the verdict against the 1.05x target comes from the rounds'
  95% Student-t interval (``bench/overhead.py``'s ``round_interval``). Wall
  and process CPU time (every thread of this process) are both recorded.
* **Coupling per sampled document**, cancelling the run's other costs: the
  same run (``--metrics coupling``, ``N1`` documents) with ``coupling_docs=C1``
  and ``C2``; ``(t(C2) - t(C1)) / (C2 - C1)``, set against the FLOOR of the
  exact route at this shape, measured here as ``bench/jacobian.py`` defines it
  (per layer: the d products' GEMMs through one of SmolLM2's blocks plus the
  cheapest exact top-(K+1) factorisation of that block's 576 x 576 Jacobian at
  a real prompt; times 30 blocks).
* **``sweep --plan``'s estimate** of the same run (``--limit N2``, the forward
  metrics and coupling on ``C2`` documents), from a study file naming the GGUF
  (its shape recorded there: a GGUF folder has no ``config.json``) and the
  prompt's measured tokens per request, against the run itself timed in a
  fresh process (``lm-coupling run``): whole, and without the model's loading
  (which the plan leaves out, as it says), and component by component against
  the in-process figures. The plan states it was checked within 3x
  (docs/sweep.md).

On a CPU shared with other work give torch one thread (``--threads 1``):
at load 7-9 on two cores, two threads made coupling ten times slower
(docs/benchmarks.md).

Usage::

    python bench/smollm2_cost.py                      # N 10,40; 3 rounds; coupling 1,3 docs
    python bench/smollm2_cost.py --threads 1 --sizes 8,24 --repeats 3 --per group \
        --coupling-docs 1,2                           # docs/benchmarks.md's table
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from marginal import run_order
from overhead import round_interval
from timing import median

REPO = Path(__file__).resolve().parents[1]
TASK = "lmc_arc_easy_offline"
FORWARD = (
    "lss", "expodistance", "equidistance", "logit_lens_entropy", "tv_to_target",
    "fixation_depth", "prompt_entropy", "curvature", "effective_rank",
)  # fmt: skip
GROUPS = {
    "trajectory": "lss,expodistance,equidistance",
    "lens": "logit_lens_entropy,tv_to_target,fixation_depth",
    "layer_by_layer": "prompt_entropy,curvature,effective_rank",
}
TARGET = 1.05
K = 10  # coupling's default K (lm_coupling.jacobian.config)
BATCH = 4


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def write_items(folder: Path, n: int) -> Path:
    """The real ARC-Easy (and WinoGrande) items, ``n`` evaluated, in the offline layout.

    From ``../shared/benchmarks`` beside the checkout, or
    ``$LM_COUPLING_SHARED_BENCHMARKS`` (``tests/fixtures/benchmarks.py``).
    """
    sys.path.insert(0, str(REPO / "tests"))
    from fixtures.benchmarks import write_offline_benchmarks

    write_offline_benchmarks(folder, n_items=n, n_fewshot=5)
    return folder


def load_model() -> tuple[Any, Any, Path, float]:
    """SmolLM2-135M-Instruct (cached fetch), float32, its tokenizer, the GGUF path, load seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_coupling.fetch import fetch

    path = fetch("smollm2")
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer, path, time.perf_counter() - started


class Runner:
    """One configuration's run at ``limit`` documents on the model in memory: (wall, CPU) s."""

    def __init__(self, model, tokenizer, name: str, data_dir: Path) -> None:
        from lm_eval.tasks import TaskManager

        from lm_coupling.harness.run import TASKS_DIR

        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.metadata = {"lmc_data_dir": str(data_dir)}
        self.index = TaskManager(include_path=[str(TASKS_DIR)], metadata=self.metadata)

    def __call__(self, metrics: str | None, limit: int, metric_args: str | None = None):
        """Seconds of one run: ``metrics`` None is lm-eval's plain run."""
        wall, cpu = time.perf_counter(), time.process_time()
        if metrics is None:
            from lm_eval import simple_evaluate
            from lm_eval.models.huggingface import HFLM

            lm = HFLM(pretrained=self.model, tokenizer=self.tokenizer, batch_size=BATCH)
            simple_evaluate(
                model=lm, tasks=[TASK], limit=limit, task_manager=self.index,
                metadata=self.metadata,
            )  # fmt: skip
        else:
            import lm_coupling

            lm_coupling.evaluate(
                model=self.model, tokenizer=self.tokenizer, model_name=self.name, tasks=[TASK],
                metrics=metrics, metric_args=metric_args, limit=limit, batch_size=BATCH,
                task_manager=self.index, metadata=self.metadata,
            )  # fmt: skip
        return time.perf_counter() - wall, time.process_time() - cpu


def configurations(per: str) -> dict[str, str | None]:
    """``{name: metrics}``: plain, all forward-pass metrics, then each metric or group."""
    configs: dict[str, str | None] = {"plain": None, "forward": ",".join(FORWARD)}
    if per == "metric":
        configs.update({name: name for name in FORWARD})
    elif per == "group":
        configs.update(GROUPS)
    return configs


def measure_forward(run: Runner, configs: dict, sizes: tuple[int, int], repeats: int) -> dict:
    """``{config: [(wall N1, cpu N1, wall N2, cpu N2), ...]}`` over interleaved rounds."""
    for metrics in configs.values():  # untimed warm-up of every code path
        run(metrics, 2)
    out: dict[str, list] = {name: [] for name in configs}
    for round_ in range(repeats):
        times: dict[str, list[float]] = {name: [] for name in configs}
        for n in sizes:
            for name in run_order(list(configs), round_):
                times[name] += run(configs[name], n)
        for name in configs:
            out[name].append(tuple(times[name]))
        print(f"  round {round_ + 1}/{repeats} done; load {load()}", flush=True)
    return out


def marginals(rounds: list[tuple], sizes: tuple[int, int], cpu: bool) -> list[float]:
    """Per round, seconds per document between the two sizes (wall, or CPU)."""
    n1, n2 = sizes
    i = 1 if cpu else 0
    return [(r[2 + i] - r[i]) / (n2 - n1) for r in rounds]


def measure_coupling(run: Runner, limit: int, docs: tuple[int, int], repeats: int) -> list:
    """Per round, seconds per sampled document: the ``coupling_docs`` difference (wall, CPU)."""
    run("coupling", 2, "coupling_docs=1")  # warm-up
    out = []
    for round_ in range(repeats):
        times = {}
        for c in docs if round_ % 2 == 0 else docs[::-1]:
            times[c] = run("coupling", limit, f"coupling_docs={c}")
        c1, c2 = docs
        out.append(tuple((times[c2][i] - times[c1][i]) / (c2 - c1) for i in (0, 1)))
        print(f"  coupling round {round_ + 1}/{repeats}: {out[-1][0]:.2f} s per document "
              f"(wall); load {load()}", flush=True)  # fmt: skip
    return out


def floor_per_document(model, tokenizer, prompt: str, repeats: int) -> tuple[float, dict]:
    """The exact route's floor at SmolLM2's shape (``bench/jacobian.py``), per document.

    Per layer: the d products' GEMMs through block 0 plus the cheapest exact
    top-(K+1) factorisation of block 0's Jacobian at ``prompt``'s last
    token; times the number of blocks. Also returns the per-layer parts.
    """
    import dataclasses

    import torch
    from jacobian import factorisation_seconds, gemm_seconds

    from lm_coupling.jacobian.engine import JacobianEngine
    from lm_coupling.model.architecture import locate_model_parts

    parts = locate_model_parts(model)
    ids = torch.as_tensor(tokenizer(prompt)["input_ids"])
    block0 = dataclasses.replace(parts, blocks=parts.blocks[:1])
    J0 = JacobianEngine(model, block0, k_max=K, method="dense").dense_jacobians(ids)[0]
    rounds = [(gemm_seconds(parts, "cpu"), factorisation_seconds(J0, K, "cpu"))]
    rounds += [(gemm_seconds(parts, "cpu"), factorisation_seconds(J0, K, "cpu"))
               for _ in range(repeats)]  # fmt: skip
    rounds = rounds[1:]  # the first, untimed
    gemm = median([g for g, _ in rounds])
    fact = {key: median([f[key] for _, f in rounds]) for key in rounds[0][1]}
    per_layer = gemm + min(fact.values())
    return per_layer * parts.n_layers, {"GEMMs": gemm, **fact, "layers": parts.n_layers}


def tokens_per_request(tokenizer, data_dir: Path, n: int) -> tuple[float, float]:
    """(requests per document, mean tokens per request) of ARC-Easy's first ``n`` items."""
    rows = [json.loads(line) for line in (data_dir / "arc_easy" / "test.jsonl").open()][:n]
    requests = tokens = 0
    for row in rows:
        context = f"Question: {row['question']}\nAnswer:"
        for choice in row["choices"]["text"]:
            tokens += len(tokenizer(context + " " + choice)["input_ids"])
            requests += 1
    return requests / len(rows), tokens / requests


def plan_and_run(gguf: Path, data_dir: Path, tokenizer, metrics: str, limit: int,
                 coupled: int, out: Path) -> dict:  # fmt: skip
    """``sweep --plan``'s estimate of the run, and the run itself in a fresh process."""
    requests, tokens = tokens_per_request(tokenizer, data_dir, limit)
    study = {
        "name": "smollm2_cost",
        "tasks": TASK,
        "metrics": metrics,
        "model_args": f"gguf_file={gguf.name}",
        "task_costs": {TASK: {"documents": limit, "requests": requests, "tokens": tokens}},
        "models": [{"model": str(gguf.parent), "shape": {
            "model_type": "llama", "n_layers": 30, "d_model": 576, "n_heads": 9,
            "vocab": 49152, "d_ff": 1536, "params": 134.5e6}}],
    }  # fmt: skip
    path = out / "study.json"
    path.write_text(json.dumps(study))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "LM_COUPLING_DATA_DIR": str(data_dir)}  # fmt: skip
    common = ["--device", "cpu", "--batch_size", str(BATCH), "--limit", str(limit),
              "--metric_args", f"coupling_docs={coupled}"]  # fmt: skip
    command = [sys.executable, "-m", "lm_coupling", "sweep", "--study", str(path), "--plan",
               "--output_path", str(out / "plan"), *common]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, env=env, text=True, capture_output=True)
    plan_seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed:\n{done.stderr[-3000:]}")
    print(done.stdout, flush=True)
    plan = json.loads((out / "plan" / "sweep_plan.json").read_text())
    run = [sys.executable, "-m", "lm_coupling", "run", "--model", "hf", "--model_args",
           f"pretrained={gguf.parent},gguf_file={gguf.name}", "--tasks", TASK, "--metrics",
           metrics, "--output_path", str(out / "run"), *common]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(run, env=env, text=True, capture_output=True)
    measured = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(run)} failed:\n{done.stderr[-3000:]}")
    return {"plan": plan["models"][0], "startup_s": plan["startup_s"], "measured_s": measured,
            "plan_command_s": plan_seconds, "requests": requests, "tokens": tokens}  # fmt: skip


def ratio_cell(rounds: list[float]) -> str:
    """``median (mean, 95% interval)`` of per-round ratios."""
    if len(rounds) < 2:
        return f"{median(rounds):.3f}x"
    mean, low, high = round_interval(rounds)
    return f"{median(rounds):.3f}x ({low:.3f}-{high:.3f})"


def verdict(rounds: list[float]) -> str:
    """meets / MISSES / undecided against `TARGET`, from the rounds' 95% interval."""
    if len(rounds) < 2:
        return "meets" if median(rounds) <= TARGET else "MISSES"
    _, low, high = round_interval(rounds)
    return "meets" if high <= TARGET else "MISSES" if low > TARGET else "undecided"


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,40", help="N1,N2 documents (ARC-Easy has 55)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--per", choices=("metric", "group", "none"), default="metric")
    parser.add_argument("--coupling-docs", default="1,3", help="C1,C2 sampled documents")
    parser.add_argument("--no-plan", action="store_true", help="skip sweep --plan and its run")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default)")
    args = parser.parse_args(argv)
    args.sizes = tuple(int(x) for x in args.sizes.split(","))
    args.coupling_docs = tuple(int(x) for x in args.coupling_docs.split(","))
    return args


def main(argv=None) -> None:
    """Measure and print the tables (module docstring)."""
    import torch

    args = parse_args(argv)
    if args.threads:  # this process and the fresh run's (OMP_NUM_THREADS is inherited)
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    loads = [load()]
    tmp = Path(tempfile.mkdtemp(prefix="lmc_smollm2_cost_"))
    data_dir = write_items(tmp / "data", max(args.sizes))
    model, tokenizer, gguf, load_s = load_model()
    print(f"SmolLM2 loaded in {load_s:.1f} s; load {load()}", flush=True)
    run = Runner(model, tokenizer, str(gguf), data_dir)
    configs = configurations(args.per)
    forward = measure_forward(run, configs, args.sizes, args.repeats)
    loads.append(load())
    coupling = measure_coupling(run, args.sizes[0], args.coupling_docs, args.repeats)
    loads.append(load())
    first = json.loads((data_dir / "arc_easy" / "test.jsonl").open().readline())
    prompt = f"Question: {first['question']}\nAnswer: {first['choices']['text'][0]}"
    floor, floor_parts = floor_per_document(model, tokenizer, prompt, args.repeats)
    loads.append(load())
    plan = None
    if not args.no_plan:
        del model
        metrics = ",".join(FORWARD) + ",coupling"
        plan = plan_and_run(gguf, data_dir, tokenizer, metrics, args.sizes[1],
                            args.coupling_docs[1], tmp)  # fmt: skip
        loads.append(load())

    n1, n2 = args.sizes
    plain_wall = marginals(forward["plain"], args.sizes, cpu=False)
    plain_cpu = marginals(forward["plain"], args.sizes, cpu=True)
    title = (
        f"SmolLM2-135M-Instruct (GGUF Q4_1 -> float32; 30 blocks, d 576), {TASK} (real items), "
        f"batch {BATCH}, CPU {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; N {n1} and {n2} documents, {args.repeats} "
        f"interleaved rounds; load average (1, 5, 15 min) at the steps: {' | '.join(loads)}"
    )
    print(f"\n{title}\n")
    print(
        "| configuration | per document, wall | per document, CPU | ratio to plain, wall "
        "(95% interval) | ratio to plain, CPU (95% interval) | fixed per run, wall |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    verdicts = {}
    for name, metrics in configs.items():
        wall = marginals(forward[name], args.sizes, cpu=False)
        cpu = marginals(forward[name], args.sizes, cpu=True)
        ratio_w = [w / p for w, p in zip(wall, plain_wall, strict=True)]
        ratio_c = [c / p for c, p in zip(cpu, plain_cpu, strict=True)]
        fixed = median([r[0] - n1 * m for r, m in zip(forward[name], wall, strict=True)])
        label = "plain lm-eval `hf`" if metrics is None else f"`{metrics}`"
        if name == "forward":
            label = f"forward-pass metrics ({len(FORWARD)})"
            verdicts = {"wall": (ratio_w, verdict(ratio_w)), "CPU": (ratio_c, verdict(ratio_c))}
        elif name in GROUPS:
            label = f"{name} (`{metrics}`)"
        print(f"| {label} | {1000 * median(wall):.0f} ms | {1000 * median(cpu):.0f} ms | "
              f"{ratio_cell(ratio_w)} | {ratio_cell(ratio_c)} | {fixed:.2f} s |")  # fmt: skip
    per_doc = median([w for w, _ in coupling])
    per_doc_cpu = median([c for _, c in coupling])
    print(
        f"| `coupling`, per sampled document | {per_doc:.2f} s | {per_doc_cpu:.2f} s | "
        f"{per_doc / median(plain_wall):.0f}x | {per_doc_cpu / median(plain_cpu):.0f}x | - |"
    )
    for unit, (rounds, word) in verdicts.items():
        print(f"\nforward-pass metrics' overhead per document ({unit}): {ratio_cell(rounds)} "
              f"of plain, {word} against the {TARGET}x target")  # fmt: skip
    layers = floor_parts.pop("layers")
    parts = ", ".join(f"{k} {v:.3f} s" for k, v in floor_parts.items())
    print(f"coupling per sampled document {per_doc:.2f} s (wall) against the exact route's floor "
          f"at this shape {floor:.2f} s ({layers} x [{parts}] per layer): "
          f"{per_doc / floor:.2f}x the floor")  # fmt: skip
    if plan is not None:
        p, whole = plan["plan"], plan["measured_s"]
        est, unloaded = p["estimated_s"], whole - load_s
        forward_measured = n2 * median(marginals(forward["forward"], args.sizes, cpu=False))
        jacobian_measured = p["coupled"] * per_doc
        print(
            f"sweep --plan (limit {n2}, {p['coupled']} coupled, {plan['requests']:.1f} requests "
            f"of {plan['tokens']:.1f} tokens per document): estimate {est:.1f} s (startup "
            f"{plan['startup_s']:.1f}, forward {p['forward_s']:.1f}, Jacobians "
            f"{p['jacobian_s']:.1f}); the run in a fresh process {whole:.1f} s, {unloaded:.1f} s "
            f"without loading the model ({load_s:.1f} s, which the plan leaves out): estimate / "
            f"measured {est / whole:.2f} (whole), {est / unloaded:.2f} (without loading); "
            f"forward {p['forward_s']:.1f} s against {forward_measured:.1f} s measured in "
            f"process ({p['forward_s'] / forward_measured:.2f}), Jacobians "
            f"{p['jacobian_s']:.1f} s against {jacobian_measured:.1f} s "
            f"({p['jacobian_s'] / jacobian_measured:.2f})"
        )
    print(f"(scratch files in {tmp})")


if __name__ == "__main__":
    main()
