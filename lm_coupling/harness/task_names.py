"""Unknown task names, reported in about a second instead of after lm-eval's task index.

lm-eval loads every task YAML (about 14,000 files in 0.4.13: 20-36 s on a
loaded 2-core machine) before it can say that a name matches nothing.
`check_task_names` reads the same files as text (about 1 s) and collects every
word after a ``task:``, ``group:`` or ``tag:`` key: a superset of the names
lm-eval's index can hold (all 14,761 of 0.4.13's), so a word outside it is
certainly no task; a word inside it is left to lm-eval's own resolution
(`lm_coupling.harness.run.resolve_tasks`). Glob patterns (``mmlu_*``) match as
lm-eval matches them (``fnmatch``); YAML file paths are not checked here.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable
from pathlib import Path

from lm_coupling.errors import ConfigurationError

_KEY = re.compile(r"^\s*(?:-\s*)?([\"']?)(?:task|group|tag)\1\s*:\s*(.*?)\s*(?:#.*)?$")
_ITEM = re.compile(r"^\s*-\s*([^\s:#{}\[\]]+)\s*(?:#.*)?$")
_IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}


def lm_eval_tasks_dir() -> Path:
    """lm-eval's own task folder (found without importing lm-eval)."""
    import importlib.util

    locations = importlib.util.find_spec("lm_eval").submodule_search_locations
    return Path(next(iter(locations))) / "tasks"


def _words(value: str) -> list[str]:
    value = value.strip().strip("'\"")
    if value.startswith("[") and value.endswith("]"):
        return [w.strip().strip("'\"") for w in value[1:-1].split(",") if w.strip()]
    return [value] if value and not value.startswith(("{", "!", "&", "*")) else []


def names_in(text: str) -> set[str]:
    """Every word after a ``task:``/``group:``/``tag:`` key of one YAML text."""
    names: set[str] = set()
    in_list = False
    for line in text.splitlines():
        match = _KEY.match(line)
        if match:
            words = _words(match.group(2))
            names.update(words)
            in_list = not match.group(2)
            continue
        if in_list:
            item = _ITEM.match(line)
            if item:
                names.add(item.group(1).strip("'\""))
            elif line.strip():
                in_list = False
    return names


def task_names(folders: Iterable[Path]) -> set[str]:
    """The candidate names of every YAML file under ``folders`` (see the module docstring)."""
    names: set[str] = set()
    for folder in folders:
        for path in Path(folder).rglob("*"):
            # YAML files and the include templates (``_default_template_yaml``, ``naijarc``)
            if path.suffix not in ("", ".yaml", ".yml") and not path.name.endswith("yaml"):
                continue
            if _IGNORE_DIRS.intersection(path.parts) or not path.is_file():
                continue
            try:
                names |= names_in(path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                continue
    return names


def check_task_names(tasks: str | Iterable[object], include_paths: Iterable[str]) -> None:
    """Refuse a task name that no task YAML can define, before lm-eval indexes its tasks.

    Args:
        tasks: the ``--tasks`` words (a comma string or a list; non-strings,
            such as task config dicts, are left to lm-eval).
        include_paths: lm-coupling's task folder and the user's (`include_paths`).

    Raises:
        ConfigurationError: a name matches no task (with close names).
    """
    words = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    words = [w.strip() for w in words if isinstance(w, str) and w.strip()]
    words = [w for w in words if not w.endswith((".yaml", ".yml")) and "/" not in w]
    if not words:
        return
    known = task_names([lm_eval_tasks_dir(), *map(Path, include_paths)])
    missing = [w for w in words if w not in known and not fnmatch.filter(known, w)]
    if missing:
        raise unknown_tasks(missing, known)


def unknown_tasks(missing: list[str], known: Iterable[str]) -> ConfigurationError:
    """The error for task names that match no task, with the names closest to the first."""
    close = difflib.get_close_matches(missing[0], sorted(known), n=3)
    hint = f" Close names: {', '.join(close)}." if close else ""
    return ConfigurationError(
        f"task(s) not found: {', '.join(missing)}.{hint} `lm_eval ls tasks` lists them; "
        "lm-coupling's offline tasks are named lmc_*_offline (all six: lmc_openllm_v1_offline)"
    )
