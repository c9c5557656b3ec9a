"""The real-model tier's settings and its one way of running lm_coupling.evaluate."""

from __future__ import annotations

import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TASKS = ("lmc_arc_easy_offline", "lmc_winogrande_offline")
LIMIT = 6
COUPLING_DOCS = 1  # per task: one ARC-Easy and one WinoGrande document
PER_DOCUMENT = (
    "lss", "expodistance", "equidistance", "logit_lens_entropy", "tv_to_target",
    "fixation_depth", "prompt_entropy", "prompt_entropy_min_layer", "curvature",
    "curvature_min_layer", "effective_rank",
)  # fmt: skip


def sampled_defaults() -> tuple[str, ...]:
    """The default metrics measured on the coupling sample, read from the built-in catalogue."""
    from lm_coupling.plugins.manager import get_registry, new_plugin_manager

    registry = get_registry(new_plugin_manager(False))
    return tuple(sorted(n for n, s in registry.metrics.items() if s.sampled and not s.opt_in))


# The metrics the float64 reference (smollm2_reference.py) recomputes: the per-document ones
# above and the sampled ones (coupling and its alignment ratio, on the sampled documents).
REFERENCED = PER_DOCUMENT + sampled_defaults()
METRICS = ",".join(REFERENCED)


def gguf_args(path: Path) -> dict[str, str]:
    """``model_args`` of the GGUF route."""
    return {"pretrained": str(path.parent), "gguf_file": path.name}


def evaluate_values(model_args: dict[str, str], data_dir: Path, metrics: str) -> dict:
    """``lm_coupling.evaluate`` on the two tasks; results with the per-document samples."""
    import lm_coupling

    started = time.perf_counter()
    results = lm_coupling.evaluate(
        model_args=model_args, tasks=list(TASKS), metrics=metrics,
        metric_args=f"coupling_docs={COUPLING_DOCS}" if "coupling" in metrics else None,
        metadata={"lmc_data_dir": str(data_dir)},
        limit=LIMIT, log_samples=True,
    )  # fmt: skip
    return {
        "results": results["results"],
        "samples": results["samples"],
        "seconds": time.perf_counter() - started,
    }
