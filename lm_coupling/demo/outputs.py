"""The demo's steps for each model run: one task index, the folder named, the table printed.

Shared by the real model's part (`lm_coupling.demo.real`) and the bundled family's
(`lm_coupling.demo.run`).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


def shared_task_index() -> Any:
    """One lm-eval task index for all the demo's models (built once: 20-36 s saved per model)."""
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.run import TASKS_DIR

    return TaskManager(include_path=[str(TASKS_DIR)])


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
def _final_paths(source: Path, target: Path) -> Iterator[None]:
    """Print the folder lm-eval writes to (``source``) as the one it is moved to (``target``)."""
    with contextlib.redirect_stderr(_Rewriting(sys.stderr, str(source), str(target))):
        with contextlib.redirect_stdout(_Rewriting(sys.stdout, str(source), str(target))):
            yield


def evaluate_into(
    out_dir: Path, model: Path, arguments: dict[str, Any], index: Any, label: str
) -> dict[str, Any] | None:
    """Run `lm_coupling.evaluate` into ``out_dir/<model's name>``, then print its table.

    lm-eval names a run's folder after ``pretrained=`` with ``/`` replaced by
    ``__`` (for the bundled models, an absolute site-packages path); the folder
    is moved to the model's name once the run ends, and the run's own lines
    (``-> <geometry file>``) name the final folder from the start.
    """
    from lm_eval.utils import make_table, sanitize_model_name

    from lm_coupling.harness.evaluate import evaluate

    source, target = out_dir / sanitize_model_name(str(model)), out_dir / model.name
    with _final_paths(source, target):
        results = evaluate(**arguments, task_manager=index)
    if source.is_dir() and source != target:
        target.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            path.replace(target / path.name)
        source.rmdir()
    if results is not None:
        print(f"\n{label}:")
        print(make_table(results))
        if "groups" in results:
            print(make_table(results, "groups"))
    return results
