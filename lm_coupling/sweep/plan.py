"""Which (model, task) pairs of a sweep still need running: sharding and resume.

Completeness rule (what a rerun skips): a (model, revision, task) is complete
when the results folder holds an lm-eval ``results_<ts>.json`` that

1. parses, with ``results`` and ``config`` tables;
2. names the same model and revision (the report's identity: the
   ``pretrained`` argument and the revision; a local ``.../step<N>`` folder is
   revision ``step<N>`` of its parent, as in the report);
3. has the task in ``results`` (or in ``group_subtasks`` for a group);
4. when the sweep selects metrics by name, lists each of them in
   ``config.lm_coupling.metrics``;
5. when the sweep selects any metric, has, for the task and every subtask of
   it (``group_subtasks``, recursively), a ``geometry_<subtask>_<ts>.json``
   beside it, from the same run (same timestamp), that parses with
   ``n_documents`` > 0.

The rule ignores every other lm-eval setting (``--limit``, few-shot, batch
size): write to a new folder when you change them.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_coupling.errors import ConfigurationError
from lm_coupling.files import geometry_file_for
from lm_coupling.report.loading import run_identity
from lm_coupling.sweep.runner import model_args_for
from lm_coupling.sweep.spec import ModelEntry


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n, e.g. ``$SLURM_ARRAY_TASK_ID/$N``) -> (i, n); None -> (0, 1).

    Raises:
        ConfigurationError: not of the form i/n with 0 <= i < n.
    """
    if text is None:
        return 0, 1
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not int(match.group(1)) < int(match.group(2)):
        raise ConfigurationError(
            f"--shard {text!r}: expected i/n with 0 <= i < n, e.g. --shard 0/4 "
            "(SLURM: --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)"
        )
    return int(match.group(1)), int(match.group(2))


def shard_entries(entries: Sequence[ModelEntry], index: int, count: int) -> list[ModelEntry]:
    """Shard ``index`` of ``count``: every count-th entry from ``index`` (round robin).

    Deterministic in the order of MODELS; the shards partition the list, and
    neighbouring checkpoints land on different jobs, which balances their cost.
    """
    return [entry for position, entry in enumerate(entries) if position % count == index]


def entry_identity(entry: ModelEntry) -> tuple[str, str]:
    """(model, revision) the report will give this entry's results."""
    model, revision, _ = run_identity({"config": {"model_args": model_args_for(entry, None)}})
    return model, revision


@dataclass
class _Run:
    path: Path
    data: dict[str, Any]
    identity: tuple[str, str]


def _read_json(path: Path, what: str, then: str) -> Any:
    """The JSON in ``path``; None, with a warning saying ``then``, where it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        message = f"lm-coupling sweep: the {what} {path} cannot be read ({exc!r}); {then}"
        warnings.warn(message, UserWarning, stacklevel=3)
        return None


def _read_runs(out_dir: Path) -> list[_Run]:
    runs = []
    for path in sorted(out_dir.rglob("results_*.json")):
        data = _read_json(path, "results file", "its tasks count as not done and are run again")
        if isinstance(data, dict) and isinstance(data.get("results"), dict):
            if isinstance(data.get("config"), dict):
                model, revision, _ = run_identity(data)
                runs.append(_Run(path, data, (model, revision)))
    return runs


def _leaves(task: str, group_subtasks: dict[str, list[str]], seen: frozenset = frozenset()):
    children = group_subtasks.get(task) or []
    if not children or task in seen:
        return [task]
    return [leaf for c in children for leaf in _leaves(c, group_subtasks, seen | {task})]


def _geometry_ok(run: _Run, task: str) -> bool:
    path = geometry_file_for(run.path, task)  # the writer's own naming rule
    if path is None or not path.is_file():
        return False  # not measured: the task is run again
    data = _read_json(path, "geometry file", "the task counts as not done and is run again")
    return isinstance(data, dict) and int(data.get("n_documents") or 0) > 0


def task_complete(run: _Run, task: str, metrics: Sequence[str] | None) -> bool:
    """Whether ``run`` holds ``task`` completely (rules 3 to 5 of the module docstring)."""
    groups = run.data.get("group_subtasks") or {}
    if task not in run.data["results"] and task not in groups:
        return False
    if metrics is None:
        return True
    declared = set(((run.data["config"].get("lm_coupling") or {}).get("metrics")) or [])
    if any(name != "all" and name not in declared for name in metrics):
        return False
    return all(_geometry_ok(run, leaf) for leaf in _leaves(task, groups))


def missing_tasks(
    entry: ModelEntry,
    tasks: Sequence[str],
    metrics: Sequence[str] | None,
    runs: Iterable[_Run],
) -> list[str]:
    """The tasks of ``entry`` no run in the folder holds completely."""
    identity = entry_identity(entry)
    mine = [run for run in runs if run.identity == identity]
    return [t for t in tasks if not any(task_complete(run, t, metrics) for run in mine)]


@dataclass(frozen=True)
class PlannedModel:
    """One model of this job's shard and the tasks it still needs."""

    entry: ModelEntry
    tasks: tuple[str, ...]

    @property
    def done(self) -> bool:
        """Every task already complete in the folder."""
        return not self.tasks


def plan_sweep(
    entries: Sequence[ModelEntry],
    tasks: Sequence[str],
    metrics: Sequence[str] | None,
    out_dir: Path,
    shard: tuple[int, int] = (0, 1),
) -> list[PlannedModel]:
    """This shard's models, each with the tasks still missing in ``out_dir``."""
    runs = _read_runs(out_dir) if out_dir.is_dir() else []
    mine = shard_entries(entries, *shard)
    return [PlannedModel(e, tuple(missing_tasks(e, tasks, metrics, runs))) for e in mine]
