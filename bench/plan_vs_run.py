"""``sweep --plan``'s Jacobian estimate against a real run's Jacobian seconds, on SmolLM2-135M.

Converts real ARC-Easy items (``../shared/benchmarks``, the offline layout,
``bench/smollm2_cost.py``'s ``write_items``), then, per round, interleaved:

* ``lm-coupling sweep --plan`` of a study naming the GGUF (its shape recorded:
  a GGUF folder has no ``config.json``) with the prompts' measured tokens per
  request, from this checkout and, with ``--baseline DIR``, from another
  checkout (``PYTHONPATH=DIR``; e.g. a worktree of the commit before a change);
* ``lm_eval --model hf ... --metrics coupling --metric_args coupling_docs=C``
  in a fresh process; its Jacobian seconds are the geometry file's
  ``timings.seconds_per_document["jacobian"]`` times the coupled documents
  (the engine's whole call: forward, products, factorisation, reduction).

Prints per round and as medians: the plan's Jacobian seconds, the measured
ones and their ratio, with the load average beside each round. Give torch one
thread on a shared CPU (``--threads 1``, inherited by every process).

Usage::

    python bench/plan_vs_run.py --threads 1 --limit 24 --coupled 2 --rounds 3 \
        --baseline ../lm-coupling-before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from smollm2_cost import REPO, TASK, load, tokens_per_request, write_items
from timing import median

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPE = {
    "model_type": "llama", "n_layers": 30, "d_model": 576, "n_heads": 9,
    "vocab": 49152, "d_ff": 1536, "params": 134.5e6,
}  # fmt: skip


def environment(checkout: Path, data_dir: Path) -> dict[str, str]:
    """Offline, the items' folder, ``checkout`` first on the path."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "LM_COUPLING_DATA_DIR": str(data_dir), "PYTHONPATH": str(checkout)}  # fmt: skip


def plan_jacobian(checkout: Path, study: Path, data_dir: Path, limit: int, coupled: int,
                  out: Path) -> tuple[float, float]:  # fmt: skip
    """(the plan's Jacobian seconds, its seconds per layer) from ``checkout``'s ``sweep --plan``."""
    command = [sys.executable, "-m", "lm_coupling", "sweep", "--study", str(study), "--plan",
               "--output_path", str(out), "--device", "cpu", "--batch_size", "4",
               "--limit", str(limit), "--metric_args", f"coupling_docs={coupled}"]  # fmt: skip
    done = subprocess.run(
        command, env=environment(checkout, data_dir), text=True, capture_output=True, cwd=checkout
    )  # fmt: skip (-m: cwd comes first)
    if done.returncode != 0:
        raise SystemExit(f"sweep --plan failed:\n{done.stderr[-3000:]}")
    plan = json.loads((out / "sweep_plan.json").read_text())
    model = plan["models"][0]
    per_layer = model["jacobian_s"] / max(1, model["coupled"]) / SHAPE["n_layers"]
    return model["jacobian_s"], per_layer


def run_jacobian(gguf: Path, data_dir: Path, limit: int, coupled: int, out: Path) -> float:
    """Jacobian seconds of a real ``lm_eval`` run (geometry file's timings times coupled docs)."""
    lm_eval = str(Path(sys.executable).parent / "lm_eval")  # the console script
    command = [lm_eval, "--model", "hf", "--model_args",
               f"pretrained={gguf.parent},gguf_file={gguf.name}", "--tasks", TASK,
               "--metrics", "coupling", "--metric_args", f"coupling_docs={coupled}",
               "--limit", str(limit), "--device", "cpu", "--batch_size", "4",
               "--output_path", str(out)]  # fmt: skip
    done = subprocess.run(command, env=environment(REPO, data_dir), text=True,
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed:\n{done.stderr[-3000:]}")
    (path,) = sorted(out.rglob("geometry_*.json"))
    timings = json.loads(path.read_text())["timings"]
    per_doc = timings["seconds_per_document"]["jacobian"]
    n = (timings.get("n_documents_per_part") or {}).get("jacobian", coupled)
    return per_doc * n


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--coupled", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout's plan")
    parser.add_argument("--gguf", type=Path, default=None, help="default: models fetch smollm2")
    args = parser.parse_args(argv)
    if args.gguf is None:
        from lm_coupling.fetch import fetch

        args.gguf = fetch("smollm2")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from transformers import AutoTokenizer

    checkouts = {"plan": REPO, **({"baseline plan": args.baseline} if args.baseline else {})}
    with tempfile.TemporaryDirectory(prefix="lmc_plan_vs_run_") as tmp:
        root = Path(tmp)
        data_dir = write_items(root / "data", args.limit)
        tokenizer = AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
        requests, tokens = tokens_per_request(tokenizer, data_dir, args.limit)
        study = root / "study.json"
        study.write_text(json.dumps({
            "name": "plan_vs_run", "tasks": TASK, "metrics": "coupling",
            "model_args": f"gguf_file={args.gguf.name}",
            "task_costs": {TASK: {"documents": args.limit, "requests": requests,
                                  "tokens": tokens}},
            "models": [{"model": str(args.gguf.parent), "shape": SHAPE}],
        }))  # fmt: skip
        threads = os.environ.get("OMP_NUM_THREADS", "-")
        print(f"{args.limit} documents, {args.coupled} coupled, {requests:.1f} requests of "
              f"{tokens:.1f} tokens, OMP_NUM_THREADS={threads}")  # fmt: skip
        figures: dict[str, list[float]] = {name: [] for name in [*checkouts, "measured"]}
        for r in range(args.rounds):
            order = [*checkouts, "measured"]
            if r % 2:
                order.reverse()
            for name in order:
                out = root / f"{name.replace(' ', '_')}_{r}"
                if name == "measured":
                    seconds = run_jacobian(args.gguf, data_dir, args.limit, args.coupled, out)
                    figures[name].append(seconds)
                    print(f"round {r} load {load()}: measured Jacobians {seconds:.2f} s",
                          flush=True)  # fmt: skip
                else:
                    seconds, per_layer = plan_jacobian(checkouts[name], study, data_dir,
                                                       args.limit, args.coupled, out)  # fmt: skip
                    figures[name].append(seconds)
                    print(f"round {r} load {load()}: {name} Jacobians {seconds:.2f} s "
                          f"({per_layer:.4f} s per layer)", flush=True)  # fmt: skip
        measured = median(figures["measured"])
        print(f"medians over {args.rounds} rounds (load now {load()}): measured {measured:.2f} s")
        for name in checkouts:
            plan = median(figures[name])
            rounds = [p / m for p, m in zip(figures[name], figures["measured"], strict=True)]
            print(f"  {name}: {plan:.2f} s, plan / measured {plan / measured:.2f} "
                  f"(per round {', '.join(f'{x:.2f}' for x in rounds)})")  # fmt: skip


if __name__ == "__main__":
    main()
