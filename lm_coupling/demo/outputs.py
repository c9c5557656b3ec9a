"""The demo's steps for each model run: one task index, the folder named, the table printed.

Shared by the real model's part (`lm_coupling.demo.real`) and the bundled family's
(`lm_coupling.demo.run`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def shared_task_index() -> Any:
    """One lm-eval task index for all the demo's models (built once: 20-36 s saved per model)."""
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.run import TASKS_DIR

    return TaskManager(include_path=[str(TASKS_DIR)])


def name_output_folder(out_dir: Path, model: Path) -> Path:
    """Move lm-eval's folder for ``model`` (its whole path, sanitized) to ``out_dir/<name>``.

    lm-eval names a run's folder after ``pretrained=`` with ``/`` replaced by
    ``__``: for the bundled models, an absolute site-packages path. The files
    keep their names and content (the results still record the full path).
    """
    from lm_eval.utils import sanitize_model_name

    source = out_dir / sanitize_model_name(str(model))
    target = out_dir / model.name
    if not source.is_dir() or source == target:
        return target
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        path.replace(target / path.name)
    source.rmdir()
    return target


def print_table(model: Path, results: dict[str, Any] | None) -> None:
    """lm-eval's results table of one model: accuracy with the geometry rows beside it."""
    if results is None:
        return
    from lm_eval.utils import make_table

    print(f"\n{model.name}:")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
