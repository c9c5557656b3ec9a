"""Check, before the model loads, that an offline task's data folder has the splits it reads.

lm-coupling's offline tasks read ``<data_dir>/<benchmark>/<split>.jsonl``
(`lm_coupling.tasks.offline_data`); lm-eval reads two splits to build a task,
the evaluated one and the few-shot source (even at zero shots).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lm_coupling.errors import DataUnavailableError

LOADER = "offline_data.load_offline"
"""The ``custom_dataset`` every offline task names (its resolved path ends with it)."""


def required_splits(cfg: Mapping[str, Any]) -> dict[str, str]:
    """``{split: role}`` of the splits lm-eval 0.4.13's ``ConfigurableTask`` reads to build a task.

    The evaluated split (``test_split`` else ``validation_split``), then the
    few-shot source (``fewshot_split`` else ``training_split`` else ``validation_split``).
    """
    evaluated = cfg.get("test_split") or cfg.get("validation_split")
    few_shot = cfg.get("fewshot_split") or cfg.get("training_split") or cfg.get("validation_split")
    splits: dict[str, str] = {}
    if evaluated:
        splits[str(evaluated)] = "the split it evaluates"
    if few_shot and few_shot not in splits:
        splits[str(few_shot)] = (
            "the split lm-eval draws few-shot examples from (read when the task is built, "
            "even at 0 shots)"
        )
    return splits


def _members(index: Mapping[str, Any], spec: Any, seen: set[str]) -> Iterator[dict[str, Any]]:
    """The task configs a task, group or tag name (or a group's dict entry) stands for."""
    overrides: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        name = spec.get("task") or spec.get("group")
        overrides = {k: v for k, v in spec.items() if k not in ("task", "group")}
    else:
        name = spec
    if not isinstance(name, str) or name in seen:
        return
    entry = index.get(name)
    if entry is None:
        return
    kind = getattr(entry.kind, "name", str(entry.kind))
    cfg = dict(entry.cfg or {})
    if kind == "TASK":
        yield {**cfg, **overrides, "task": name}
        return
    seen = seen | {name}
    if kind == "GROUP":
        subtasks = cfg.get("task") or []
        for sub in subtasks if isinstance(subtasks, list) else [subtasks]:
            yield from _members(index, sub, seen)
    elif kind == "TAG":
        for other, candidate in index.items():
            if name in (getattr(candidate, "tags", None) or ()):
                yield from _members(index, other, seen)


def check_offline_splits(task_manager: Any, tasks: Iterable[Any], metadata: Mapping) -> None:
    """Refuse an offline task whose data folder lacks a split lm-eval will read.

    Args:
        task_manager: lm-eval's ``TaskManager`` (its ``task_index``).
        tasks: the resolved task names (groups and tags expanded here).
        metadata: the run's task metadata (``lmc_data_dir``).

    Raises:
        DataUnavailableError: names the task, the folder, the missing file,
            the files found and what to do.
    """
    from lm_coupling.tasks.offline_data import DATA_DIR_ENV, resolve_data_dir

    index = getattr(task_manager, "task_index", None) or {}
    data_dir = resolve_data_dir((metadata or {}).get("lmc_data_dir"))
    for spec in tasks:
        for cfg in _members(index, spec, set()):
            if not str(cfg.get("custom_dataset") or "").endswith(LOADER):
                continue
            benchmark = (cfg.get("dataset_kwargs") or {}).get("benchmark")
            if not benchmark:
                continue
            folder = Path(data_dir) / str(benchmark)
            found = sorted(p.name for p in folder.glob("*.jsonl")) if folder.is_dir() else []
            for split, role in required_splits(cfg).items():
                if f"{split}.jsonl" in found:
                    continue
                raise DataUnavailableError(
                    f"task {cfg['task']} reads {folder / (split + '.jsonl')}, {role}, and "
                    f"there is no such file (found: {', '.join(found) or 'none'}). Add "
                    f"{split}.jsonl to {folder} (the same fields as the other splits; a few "
                    "rows cut off another split do, see lm_coupling/tasks/README.md), or point "
                    f"${DATA_DIR_ENV} (or --metadata '{{\"lmc_data_dir\": ...}}') at a folder "
                    "that has it"
                )
