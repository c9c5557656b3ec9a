"""lm-eval runs for the overhead benchmarks: a saved random model, one run, one fresh process.

Geometry runs through the library core that ``lm_eval ... --metrics`` executes
(``lm_coupling.harness.evaluate.evaluate_record``, sharing this process's task
index); ``plain`` runs lm-eval's own ``hf`` model through ``simple_evaluate``.
The caller builds one ``TaskManager`` per process, so lm-eval's task indexing
(~15 s) is outside every timing; model loading, request building, the forward
passes and scoring are inside it.

:func:`run_fresh` runs one configuration in a fresh ``python bench/lmeval_runs.py
--worker SPEC`` subprocess: an untimed warm-up run on one document per task
(imports, first kernel calls, dataset caches), then the timed run. It returns
the timed run's wall time, its peak memory (CUDA ``max_memory_allocated``, or
peak RSS), counted from after the warm-up once the warm-up's memory is handed
back (a collection, ``malloc_trim``; ``peak_reset`` says whether the peak
could be reset there, else it counts from the process's start), and how many
documents got geometry.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from timing import is_cuda, peak_mb, reset_peak, trim_heap

TRAJ_LENS = "lss,expodistance,equidistance,logit_lens_entropy"
DEFAULT_TASKS = (
    "lmc_arc_easy_offline,lmc_arc_challenge_offline,lmc_hellaswag_offline,lmc_mmlu_sample,"
    "lmc_truthfulqa_mc2_offline,lmc_winogrande_offline"
)
"""The log-likelihood tasks of ``lmc_demo`` (all bundled documents). gsm8k is left out:
its time is spent in decoding steps, which capture never touches, so it would only
dilute the ratio."""


@dataclasses.dataclass
class RunSpec:
    """One lm-eval configuration: ``metrics=None`` is plain ``--model hf``."""

    model_dir: str
    tasks: str = DEFAULT_TASKS
    limit: int | None = None
    batch_size: str = "8"
    device: str = "cpu"
    dtype: str = "float32"
    metrics: str | None = None
    metric_args: str | None = None
    warm_up: bool = True
    """:func:`run_fresh` first runs one document per task, untimed (``--quick``: no)."""


def tokenizer_texts(seed: int = 0) -> list[str]:
    """The bundled demo items plus seeded pseudo-words: enough for an 8k BPE vocabulary."""
    from lm_coupling.demo.assets import bundled_tasks_data_path

    items = sorted(bundled_tasks_data_path().rglob("*.jsonl"))
    docs = [path.read_text(encoding="utf-8") for path in items]
    rng = random.Random(seed)
    onsets = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl st tr".split()
    nuclei = "a e i o u ai ea ou io".split()
    syllables = [onset + nucleus for onset in onsets for nucleus in nuclei]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(6000)]
    docs += [" ".join(rng.choice(words) for _ in range(60)) for _ in range(2000)]
    return docs


def save_random_model(
    path: Path,
    model_type: str,
    *,
    tokenizer_vocab: int,
    model_vocab: int | None = None,
    dtype: str = "float32",
    **sizes,
) -> Path:
    """Save a randomly initialised ``model_type`` model and a trained BPE tokenizer to ``path``.

    Like ``tiny_models.save_tiny_model``, but the model keeps the
    default attention implementation (what ``--model hf`` loads), may have a
    wider embedding than the tokenizer (``model_vocab``, e.g. Pythia's 50304)
    and is built directly in ``dtype`` on the GPU when one exists.

    Args:
        path: output folder.
        model_type: a ``tiny_models.ARCHITECTURES`` name.
        tokenizer_vocab: BPE vocabulary trained on :func:`tokenizer_texts`.
        model_vocab: rows of the embedding (default: the tokenizer's size).
        dtype: ``float32`` or ``bfloat16`` weights.
        **sizes: ``d_model``, ``n_layers``, ``n_heads``, ``d_ff``, ``max_len``.
    """
    import transformers
    from tiny_models import tiny_config, train_tokenizer

    tokenizer = train_tokenizer(tokenizer_texts(), vocab_size=tokenizer_vocab)
    config = tiny_config(model_type, max(model_vocab or 0, len(tokenizer)), **sizes)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return path


def task_manager(tasks: str = DEFAULT_TASKS):
    """A ``TaskManager`` that knows lm-coupling's bundled tasks.

    When every task is a bundled ``lmc_*`` task, lm-eval's own task folder is
    not indexed (0.1 s instead of ~15 s); task indexing is outside every timing.
    """
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.run import TASKS_DIR

    bundled_only = all(name.startswith("lmc_") for name in tasks.split(","))
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=not bundled_only)


def _coupled(geometry) -> bool:
    value = geometry.values.get("coupling", math.nan)
    return math.isfinite(value)


BREAKDOWN = (
    "jacobian",  # the document's share of the batched engine call (the parts below and more)
    "jacobian_forward",  # the prompt's forward pass that gives the frozen prefix
    "jacobian_products",  # the d vector-Jacobian products per block
    "factorisation",  # the top-(K+1) eigen/singular pairs per block
    "reduction",  # A = U^T J V for every pair of blocks
    "metrics",  # the plugins' lmc_compute_batch
)


def breakdown(documents) -> dict[str, float]:
    """Mean seconds per coupled document of each part in `BREAKDOWN` (DocumentGeometry.timings)."""
    coupled = [doc.timings for doc in documents if _coupled(doc)]
    if not coupled:
        return {}
    return {part: sum(t.get(part, 0.0) for t in coupled) / len(coupled) for part in BREAKDOWN}


def run_in_process(spec: RunSpec, tm, limit: int | None = None) -> dict:
    """One ``simple_evaluate`` of ``spec`` in this process.

    Returns:
        ``wall_s``, ``cpu_s`` (process CPU time), ``batch_sizes`` (lm-eval's
        chosen batch sizes, for ``auto``), ``n_geometry`` (documents measured),
        ``n_coupling`` (documents with a finite coupling value) and
        ``breakdown``: the mean seconds per coupled document of each part of
        the geometry work, from the documents' own timings (`BREAKDOWN`);
        ``gc_s`` and ``gc_full``: seconds in Python's garbage collector and
        its full (oldest-generation) collections during the run (`CollectorTime`).
    """
    kwargs = dict(
        model_args=f"pretrained={spec.model_dir},dtype={spec.dtype}",
        tasks=spec.tasks.split(","),
        task_manager=tm,
        batch_size=spec.batch_size,
        limit=limit if limit is not None else spec.limit,
        device=spec.device,
        bootstrap_iters=0,
        verbosity="ERROR",
    )
    collector = CollectorTime()
    start, cpu = time.perf_counter(), time.process_time()
    with collector:
        results, measured, n_geometry = _evaluate(spec, kwargs)
    return {
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,
        "gc_s": collector.seconds,
        "gc_full": collector.full,
        "batch_sizes": (results or {}).get("config", {}).get("batch_sizes", []),
        "n_geometry": n_geometry,
        "n_coupling": sum(_coupled(g) for g in measured),
        "breakdown": breakdown(measured),
    }


def _evaluate(spec: RunSpec, kwargs: dict) -> tuple[dict | None, list, int]:
    """lm-eval's results, the documents kept whole and the documents measured."""
    import lm_eval

    if spec.metrics is None:
        # simple_evaluate logs samples by default (rendering every document's target once
        # more); the geometry run, like the lm_eval command line, does not: same work.
        results = lm_eval.simple_evaluate(model="hf", log_samples=False, **kwargs)
        measured, n_geometry = [], 0
    else:
        from lm_coupling.harness.evaluate import evaluate_record

        kwargs.pop("verbosity")
        record = evaluate_record(
            metrics=spec.metrics, metric_args=spec.metric_args, verbosity="ERROR", **kwargs
        )
        # The documents kept whole are the sampled ones (harness.task_records.TaskRecords).
        results = record.results
        records = record.session.records.tasks.values()
        measured = [doc for task in records for doc in task.documents]
        n_geometry = sum(getattr(t, "n_documents", len(t.documents)) for t in records)
        if not n_geometry:
            raise RuntimeError(f"{spec.metrics} measured no document: the bench is broken")
    return results, measured, n_geometry


OLDEST_GENERATION = 2
"""CPython's oldest garbage-collector generation: a collection of it is a full one."""


class CollectorTime:
    """Inside the context: the seconds Python's garbage collector ran, and its full collections.

    A full collection walks every object the process keeps (lm-eval's requests
    and documents above all); CPython up to 3.12 runs one when the objects
    that survived the younger collections since the last one pass a quarter
    of those kept. One more or one fewer in a run moves its CPU time by the
    cost of a whole walk, so a per-document figure taken between two N can
    jump by it.
    """

    def __init__(self) -> None:
        self.seconds, self.full, self._started = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.full += info["generation"] == OLDEST_GENERATION

    def __enter__(self) -> CollectorTime:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def _worker(spec_json: str) -> None:
    """Subprocess entry: run one spec once and print its result and peak memory as JSON."""
    spec = RunSpec(**json.loads(spec_json))
    tm = task_manager(spec.tasks)
    if spec.warm_up:  # untimed: imports, first calls, dataset caches
        run_in_process(spec, tm, limit=1)
    # The warm-up's model lives in reference cycles (lm-eval's HFLM has them) until a
    # collection, and the C heap keeps what it freed resident: both are handed back,
    # and the peak counted from here, so that it is the measured run's own.
    gc.collect()
    if is_cuda(spec.device):
        torch.cuda.empty_cache()
    trim_heap()
    peak_reset = reset_peak(spec.device)
    out = run_in_process(spec, tm)
    out["peak_mb"] = peak_mb(spec.device)
    out["peak_reset"] = peak_reset
    print("RESULT " + json.dumps(out), flush=True)


def start_fresh(spec: RunSpec) -> subprocess.Popen:
    """Start ``spec`` in a fresh subprocess (`finish_fresh` reads its result)."""
    argv = [sys.executable, __file__, "--worker", json.dumps(dataclasses.asdict(spec))]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_fresh(proc: subprocess.Popen, spec: RunSpec) -> dict:
    """Wait for a `start_fresh` run; its :func:`run_in_process` result plus ``peak_mb``.

    Raises:
        RuntimeError: the subprocess failed (its stderr tail is in the message).
    """
    stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"lm-eval run {spec} failed:\n{stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run_fresh(spec: RunSpec) -> dict:
    """Run ``spec`` once in a fresh subprocess; its :func:`run_in_process` result plus ``peak_mb``.

    Raises:
        RuntimeError: the subprocess failed (its stderr tail is in the message).
    """
    return finish_fresh(start_fresh(spec), spec)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one lm-eval run (bench worker)")
    parser.add_argument("--worker", required=True, help="RunSpec as JSON")
    _worker(parser.parse_args().worker)
