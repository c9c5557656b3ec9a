"""SmolLM2-135M's accuracy on the real items, with and without ``--metrics all``, per document.

Loads SmolLM2-135M-Instruct once (``lm-coupling models fetch smollm2``, GGUF
Q4_1 dequantized to float32) and evaluates the real ARC-Easy and WinoGrande
items (``../shared/benchmarks`` or ``$LM_COUPLING_SHARED_BENCHMARKS``,
converted to the offline layout: ``--limit`` evaluated, 5 more as the few-shot
split) zero-shot twice in this process, one lm-eval task index for both:

* plain: lm-eval's own ``HFLM`` (``lm_eval.simple_evaluate``), no lm-coupling;
* ``lm_coupling.evaluate(..., metrics="all")``, coupling on ``--coupling-docs``
  documents per task.

Prints, per task, ``acc`` (and ``acc_norm``) of both runs, their standard
errors, and how many documents' per-document scores differ between them (the
claim: none).

Usage::

    python bench/smollm2_accuracy.py --limit 55 --coupling-docs 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASKS = ("lmc_arc_easy_offline", "lmc_winogrande_offline")


def _by_doc(samples: list[dict]) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for row in samples:
        rows.setdefault(row["doc_id"], row)
    return rows


def main(argv=None) -> None:
    """Run both and print the table (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=55, help="items per task (55 at most)")
    parser.add_argument("--coupling-docs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "tests"))
    from fixtures.benchmarks import write_offline_benchmarks
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lm_coupling
    from lm_coupling.fetch import fetch
    from lm_coupling.harness.run import TASKS_DIR

    data = Path(tempfile.mkdtemp(prefix="lmc_smollm2_accuracy_"))
    write_offline_benchmarks(data, n_items=args.limit, n_fewshot=5)
    metadata = {"lmc_data_dir": str(data)}
    path = fetch("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    index = TaskManager(include_path=[str(TASKS_DIR)], metadata=metadata)
    loads = [" ".join(f"{x:.1f}" for x in os.getloadavg())]
    started = time.perf_counter()
    plain = simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size),
        tasks=list(TASKS), limit=args.limit, task_manager=index, metadata=metadata,
        log_samples=True,
    )  # fmt: skip
    plain_s = time.perf_counter() - started
    loads.append(" ".join(f"{x:.1f}" for x in os.getloadavg()))
    started = time.perf_counter()
    geometry = lm_coupling.evaluate(
        model=model, tokenizer=tokenizer, model_name=str(path), tasks=list(TASKS),
        metrics="all", metric_args=f"coupling_docs={args.coupling_docs}", limit=args.limit,
        batch_size=args.batch_size, task_manager=index, metadata=metadata, log_samples=True,
    )  # fmt: skip
    geometry_s = time.perf_counter() - started
    loads.append(" ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(
        f"\nSmolLM2-135M-Instruct (GGUF Q4_1 -> float32), zero-shot, real items, batch "
        f"{args.batch_size}; plain {plain_s:.0f} s, --metrics all (coupling on "
        f"{args.coupling_docs} document per task) {geometry_s:.0f} s; load {' | '.join(loads)}\n"
    )
    print("| task | documents | metric | plain lm-eval | with `--metrics all` | documents "
          "that differ |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|")
    for task in TASKS:
        a, b = plain["results"][task], geometry["results"][task]
        rows_a = _by_doc(plain["samples"][task])
        rows_b = _by_doc(geometry["samples"][task])
        for key in ("acc", "acc_norm"):
            if f"{key},none" not in a:
                continue
            differ = sum(rows_a[d][key] != rows_b[d][key] for d in rows_a)
            print(
                f"| {task} | {len(rows_a)} | {key} | {a[f'{key},none']:.4f} "
                f"(+- {a[f'{key}_stderr,none']:.3f}) | {b[f'{key},none']:.4f} | {differ} |"
            )
    names = [k.split(",")[0] for k in geometry["results"][TASKS[0]] if not k.endswith("stderr")]
    print(f"\ngeometry rows of {TASKS[0]}: {', '.join(n for n in names if n != 'alias')}")


if __name__ == "__main__":
    main()
