"""lm-coupling's task folder, and the error for a task whose data cannot be reached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_coupling.errors import DataUnavailableError

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
"""lm-coupling's task YAMLs (the ``lmc_*`` tasks); always on the include path."""


def data_unavailable(task_list: Any, exc: Exception) -> DataUnavailableError:
    """`DataUnavailableError` for a hub task whose data cannot be downloaded."""
    offline = sorted(p.stem for p in TASKS_DIR.glob("lmc_*_offline.yaml"))
    return DataUnavailableError(
        f"the data of {task_list!r} cannot be downloaded ({exc}). Without network, run "
        f"lm-coupling's offline variants, which read local JSONL files: {', '.join(offline)}, "
        "lmc_mmlu_offline (all six benchmarks: lmc_openllm_v1_offline). Point "
        "$LM_COUPLING_DATA_DIR at your converted files (layout: lm_coupling/tasks/README.md); "
        "without it they run on the bundled sample documents."
    )
