"""Named studies for ``lm-coupling sweep --study NAME``: models, tasks and settings as data.

A study is a JSON file: the package's own (``lm_coupling/sweep/studies/<name>.json``,
listed by :func:`study_names`) or any path. Keys:

- ``name``; ``description`` and ``source`` (for the reader): what the study is and where
  its list comes from;
- ``tasks``: the lm-eval tasks (``--tasks``); ``metrics``: ``--metrics``;
- ``lm_eval_args``: further arguments of every model's run (``--metric_args``, ...);
  arguments typed on the command line come after them, so they win;
- ``model_args``: added to every model's ``pretrained=`` (``--model_args``);
- ``task_costs``: per task of ``tasks``, what the plan counts: ``documents`` (all
  leaf tasks together), ``leaves`` (leaf tasks, each gets ``coupling_docs``),
  ``smallest_leaf`` (documents of the smallest leaf), ``requests`` (loglikelihood
  requests per document), ``tokens`` (mean tokens per request, few-shot context
  included) and ``gen_tokens`` (generated tokens per document);
- ``models``: ``{"model": NAME, "revision": REV (braces expand), "shape": {...}}``;
  ``shape`` (``model_type``, ``n_layers``, ``d_model``, ``n_heads``, ``vocab``,
  ``d_ff``; ``params`` is for the reader) is used by the plan only where the
  model's config cannot be read (a hub model offline);
- ``excluded``: ``{"model": ..., "reason": ...}``: entries of the source list left
  out, each with its reason (printed by ``--plan``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_coupling.errors import ConfigurationError
from lm_coupling.sweep.spec import ModelEntry, entries_for

STUDIES_DIR = Path(__file__).resolve().parent / "studies"
COST_KEYS = ("documents", "leaves", "smallest_leaf", "requests", "tokens", "gen_tokens")


@dataclass(frozen=True)
class TaskCost:
    """What one task of a study costs in documents and tokens (see the module docstring)."""

    task: str
    documents: int
    leaves: int = 1
    smallest_leaf: int | None = None
    requests: float = 1.0
    tokens: float = 128.0
    gen_tokens: float = 0.0


@dataclass(frozen=True)
class StudyModel:
    """One model (or checkpoint) of a study, with the shape its entry records."""

    entry: ModelEntry
    shape: dict[str, Any] = field(default_factory=dict)


@dataclass
class Study:
    """A named study (see the module docstring)."""

    name: str
    path: Path
    tasks: str
    metrics: str | None
    lm_eval_args: list[str]
    model_args: str | None
    task_costs: dict[str, TaskCost]
    models: list[StudyModel]
    excluded: list[dict[str, str]]

    @property
    def entries(self) -> list[ModelEntry]:
        """The models in order, as the sweep runs them."""
        return [m.entry for m in self.models]

    def shape_of(self, entry: ModelEntry) -> dict[str, Any]:
        """The shape the study records for ``entry`` ({} when none)."""
        return next((m.shape for m in self.models if m.entry == entry), {})


def study_names() -> list[str]:
    """The studies shipped with the package."""
    return sorted(p.stem for p in STUDIES_DIR.glob("*.json"))


def _path_of(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return path
    shipped = STUDIES_DIR / f"{name}.json"
    if shipped.is_file():
        return shipped
    raise ConfigurationError(
        f"--study {name}: no such study; give one of {', '.join(study_names())} or the path of "
        "a study .json file (docs/sweep.md, 'Named studies')"
    )


def _need(data: dict, key: str, path: Path):
    if key not in data:
        raise ConfigurationError(f"study {path}: the key {key!r} is missing (docs/sweep.md)")
    return data[key]


def _task_cost(task: str, value: Any, path: Path) -> TaskCost:
    if not isinstance(value, dict) or "documents" not in value:
        raise ConfigurationError(
            f"study {path}: task_costs.{task} needs at least 'documents' (and may give "
            f"{', '.join(COST_KEYS[1:])})"
        )
    unknown = sorted(set(value) - set(COST_KEYS) - {"note"})
    if unknown:
        raise ConfigurationError(f"study {path}: task_costs.{task}: unknown keys {unknown}")
    return TaskCost(task, **{k: v for k, v in value.items() if k in COST_KEYS})


def load_study(name: str) -> Study:
    """The study ``name`` (shipped) or at the path ``name``.

    Raises:
        ConfigurationError: no such study, unreadable JSON, a missing key, or a
            task of ``tasks`` without its ``task_costs`` entry.
    """
    path = _path_of(name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"study {path}: cannot read it ({exc})") from exc
    tasks = str(_need(data, "tasks", path))
    costs = {t: _task_cost(t, v, path) for t, v in (data.get("task_costs") or {}).items()}
    missing = [t for t in tasks.split(",") if t not in costs]
    if missing:
        raise ConfigurationError(
            f"study {path}: task_costs has no entry for {', '.join(missing)}; the plan needs "
            "each task's documents (docs/sweep.md, 'Named studies')"
        )
    models = []
    for item in _need(data, "models", path):
        if not isinstance(item, dict) or "model" not in item:
            raise ConfigurationError(f"study {path}: cannot read model item {item!r}")
        shape = dict(item.get("shape") or {})
        models += [StudyModel(e, shape) for e in entries_for(item["model"], item.get("revision"))]
    if not models:
        raise ConfigurationError(f"study {path}: no model")
    return Study(
        name=str(data.get("name") or path.stem),
        path=path,
        tasks=tasks,
        metrics=data.get("metrics"),
        lm_eval_args=[str(a) for a in data.get("lm_eval_args") or []],
        model_args=data.get("model_args"),
        task_costs=costs,
        models=models,
        excluded=list(data.get("excluded") or []),
    )
