"""Per-document coupling cost inside ``lm_eval --metrics coupling`` vs the engine alone.

Used by ``bench/jacobian.py --through-lm-eval``. At ARC prompt length
(``lmc_arc_challenge_offline``, zero-shot), on a GPT-2-small-shaped random model
saved with an 8k BPE tokenizer:

* CLI: two fresh-process lm-eval runs over the same ``docs + 1`` documents,
  ``coupling_docs=docs+1`` and ``coupling_docs=1``; the wall-time difference
  divided by the difference in documents that got a finite coupling value is
  lm-eval's marginal cost of one coupled document (everything else in the two
  runs is the same work).
* engine: ``JacobianEngine`` (default route) plus the coupling matrix on the
  same documents' contexts, tokenized as lm-eval's ``hf`` model does (no
  special tokens), in this process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from engine_runs import default_route, engine_coupling, route_summary
from lmeval_runs import RunSpec, run_fresh, save_random_model, task_manager
from timing import median, timed

from lm_coupling.model.architecture import locate_model_parts

ARC = "lmc_arc_challenge_offline"


def arc_contexts(n_docs: int) -> list[str]:
    """Zero-shot contexts of the first ``n_docs`` ARC-Challenge documents, as lm-eval makes them."""
    from lm_eval.tasks import get_task_dict

    task = get_task_dict([ARC], task_manager(ARC))[ARC]
    task.build_all_requests(limit=n_docs, rank=0, world_size=1)
    contexts = {}
    for instance in task.instances:
        contexts.setdefault(instance.doc_id, instance.args[0])
    return [contexts[i] for i in sorted(contexts)]


def engine_per_document(model_dir: Path, contexts: list[str], args) -> tuple[float, float, str]:
    """Median engine seconds per document on ``contexts``, their mean length, the routes."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(args.device).eval()
    parts = locate_model_parts(model)
    prompts = [
        torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], device=args.device)
        for text in contexts
    ]
    route = default_route()
    engine_coupling(model, parts, prompts[0][:4], 2, route)  # warm-up
    seconds, summary = [], ""
    for ids in prompts:
        (_, factors), s = timed(
            lambda ids=ids: engine_coupling(model, parts, ids, args.k, route), args.device
        )
        seconds.append(s)
        summary = route_summary(factors)
    mean_t = sum(len(p) for p in prompts) / len(prompts)
    return median(seconds), mean_t, summary


def cli_per_document(model_dir: Path, args) -> float:
    """lm-eval's marginal seconds per coupled document (median of ``--repeats`` pairs)."""
    n = args.docs + 1
    specs = {
        many: RunSpec(
            str(model_dir),
            ARC,
            limit=n,
            batch_size="8",
            device=args.device,
            metrics="coupling",
            metric_args=f"k={args.k},coupling_docs={many}",
        )
        for many in (1, n)
    }
    per_doc = []
    for i in range(args.repeats):
        out = {many: run_fresh(spec) for many, spec in specs.items()}
        extra_docs = out[n]["n_coupling"] - out[1]["n_coupling"]
        if extra_docs < 1:
            raise RuntimeError(f"coupling_docs={n} coupled no more documents than 1: {out}")
        per_doc.append((out[n]["wall_s"] - out[1]["wall_s"]) / extra_docs)
        print(f"  round {i + 1}: lm-eval {per_doc[-1]:.2f} s per coupled document", flush=True)
        parts = out[n].get("breakdown") or {}
        if parts:
            rest = per_doc[-1] - parts["jacobian"] - parts["metrics"]
            line = (
                "    of which, per coupled document: engine {jacobian:.2f} s (prefix forward "
                "{jacobian_forward:.2f}, products {jacobian_products:.2f}, factorisation "
                "{factorisation:.2f}, reduction {reduction:.2f}), metrics {metrics:.3f} s; "
                "the rest (plan, capture, records, lm-eval's own scoring) {rest:.2f} s"
            )
            print(line.format(rest=rest, **parts), flush=True)
    return median(per_doc)


def lm_eval_rows(args: argparse.Namespace, tmp: Path, sizes: dict) -> list[tuple]:
    """Rows of the table: the CLI's and the engine's per-document cost at ARC length."""
    model_dir = save_random_model(
        tmp / "model",
        "gpt2",
        tokenizer_vocab=512 if args.quick else 8192,
        max_len=1024,
        **sizes,
    )
    contexts = arc_contexts(args.docs + 1)
    engine_s, mean_t, routes = engine_per_document(model_dir, contexts, args)
    cli_s = cli_per_document(model_dir, args)
    L = sizes["n_layers"]
    label = f"ARC (mean T={mean_t:.0f})"
    blank = (None,) * 5  # speed-up, x floor, max|dC|, vs, counts
    return [
        (f"{label}: lm-eval --metrics coupling", cli_s / L, cli_s, *blank, routes),
        (f"{label}: engine, same prompts", engine_s / L, engine_s, *blank, routes),
    ]
