"""The run's own inputs checked before anything loads: tasks, ``--limit``, ``--output_path``.

lm-eval finds an empty task list only after indexing every task, a ``--limit``
of 0 only after loading the model, and an ``--output_path`` that is a file only
when it writes the results; these checks need neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_coupling.errors import ConfigurationError

__all__ = ["check_limit", "check_output_path", "check_tasks"]


def check_tasks(tasks: Any) -> None:
    """Refuse a run without a task (``--tasks`` missing or empty, ``tasks=[]``).

    Raises:
        ConfigurationError: no task named.
    """
    words = tasks.split(",") if isinstance(tasks, str) else list(tasks or ())
    if not [w for w in words if not isinstance(w, str) or w.strip()]:
        raise ConfigurationError(
            "no task given: name one or more with --tasks (Python: tasks=[...]), e.g. "
            "--tasks lmc_arc_easy_offline; `lm_eval ls tasks` lists them"
        )


def check_limit(limit: Any) -> None:
    """Refuse a ``--limit`` that selects no document (0 or below; a count, or a fraction below 1).

    Raises:
        ConfigurationError: a limit of 0 or below.
    """
    if limit is None:
        return
    try:
        value = float(limit)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"--limit {limit!r} is not a number: give a count of documents per task (e.g. 10) "
            "or a fraction below 1 (e.g. 0.1)"
        ) from None
    if not value > 0:
        raise ConfigurationError(
            f"--limit {value:g} selects no document: give a count of documents per task "
            "(e.g. 10) or a fraction below 1 (e.g. 0.1), or leave --limit out to run them all"
        )


def check_output_path(output_path: Any) -> None:
    """Refuse an ``--output_path`` whose results folder is an existing file.

    lm-eval writes into ``<output_path>/<model folder>/`` (for a ``.json``
    path: into that file's folder, `lm_coupling.files.output_root`).

    Raises:
        ConfigurationError: the folder the results go to is an existing file.
    """
    if not output_path:
        return
    from lm_coupling.files import output_root

    path = Path(output_path).expanduser()
    root = output_root(path)
    blocked = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        raise ConfigurationError(
            f"--output_path {output_path}: {blocked} is an existing file, not a folder, so the "
            "results could not be written there; give a folder (new or existing), e.g. "
            f"--output_path {root.with_name(root.name + '_results')}"
        )
