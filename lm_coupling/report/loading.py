"""Find and parse the files of lm-eval runs (with and without ``--metrics``).

Reads ``results_<timestamp>.json``, ``samples_<task>_<timestamp>.jsonl`` and
``geometry_<task>_<timestamp>.json`` under a folder (docs/outputs.md). A row
is one model identity ``(model, revision, dtype)``, by the rules of
docs/report.md, "Rows"; what each metric is comes from the catalogue each
run recorded (`lm_coupling.catalogue`), else the installed plugins' (with a
`CatalogueWarning`). Broken or partial files are skipped with a
`ReportWarning` naming them.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from lm_coupling.catalogue import INSTALLED, Catalogue, recorded_catalogue
from lm_coupling.model_source import filed_dtype, filed_name
from lm_coupling.report.benchmarks import benchmark_of, is_geometry_metric, parse_step
from lm_coupling.report.notices import (  # also the loader's public names
    CatalogueWarning,
    ReportInputError,
    ReportWarning,
    SettingsWarning,  # noqa: F401 (re-exported)
)
from lm_coupling.report.row_identity import separate_models
from lm_coupling.report.settings import TaskSetting, metric_options, task_settings

IDENTITY = ["model", "revision", "dtype"]
VALUE_COLUMNS = [*IDENTITY, "task", "metric", "filter", "value", "stderr", "n", "kind"]
VALUE_COLUMNS += ["file", "timestamp", "base_metric", "primary_score", "group", "setting"]
VALUE_COLUMNS += ["shots", "limit", "k_used"]
_CHECKPOINT = re.compile(r"^(?:global_)?(?:step|checkpoint|ckpt|iter)[-_]?\d+$", re.IGNORECASE)
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(?:\.\d+)?)")
_SKIP_KEYS = {"alias", "name", "sample_len", " ", ""}


@dataclass
class RunFile:
    """One parsed ``results_<timestamp>.json`` with its identity and shapes."""

    path: Path
    timestamp: float
    identity: tuple[str, str, str]
    shape: dict[str, float]
    declared: set[str]
    results: dict[str, dict[str, Any]]
    samples: dict[str, Path] = field(default_factory=dict)
    higher_is_better: dict[str, dict[str, Any]] = field(default_factory=dict)
    parents: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    options_requested: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, TaskSetting] = field(default_factory=dict)
    catalogue: Catalogue = field(default_factory=Catalogue)
    weights: str = ""  # an in-memory model's weights fingerprint (report.row_identity)


@dataclass
class LoadedResults:
    """Everything read from a results folder.

    Attributes:
        values: every (task, metric, filter) value of every run (``VALUE_COLUMNS``;
            ``kind`` "score" or "geometry").
        shapes: one row per identity: ``n_params``, ``n_layers``, ``d_model``.
        runs: the parsed results files.
        geometry: parsed geometry files, newest per (identity, task).
        skipped: the files skipped, with the reason.
        paths: display name -> full model name or path (`display_names`).
        by_results: every geometry file by (its results file, task): a value's
            own run's file (runs at two K each keep their ``coupling.k``).
        catalogue: every run's catalogue merged, the newest run's winning.
        notes: what the summary says about how the files were read.
    """

    values: pd.DataFrame
    shapes: pd.DataFrame
    runs: list[RunFile]
    geometry: list[dict[str, Any]]
    skipped: list[str]
    paths: dict[str, str] = field(default_factory=dict)
    by_results: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    catalogue: Catalogue = field(default_factory=Catalogue)
    notes: list[str] = field(default_factory=list)


def file_timestamp(path: Path, fallback: float | None = None) -> float:
    """Seconds since the epoch from an lm-eval file name, else ``fallback``, else mtime."""
    match = _TIMESTAMP.search(path.name)
    if match:
        text = match.group(1)
        fmt = "%Y-%m-%dT%H-%M-%S.%f" if "." in text else "%Y-%m-%dT%H-%M-%S"
        return datetime.strptime(text, fmt).timestamp()
    if fallback is not None and math.isfinite(fallback):
        return float(fallback)
    return path.stat().st_mtime


def _model_args(config: dict[str, Any]) -> dict[str, Any]:
    args = config.get("model_args") or {}
    if isinstance(args, str):
        pairs = (item.split("=", 1) for item in args.split(",") if "=" in item)
        return {key.strip(): value.strip() for key, value in pairs}
    return dict(args) if isinstance(args, dict) else {}


def normalize_dtype(dtype: Any) -> str:
    """``torch.float32`` -> ``float32``; None -> ``auto``."""
    if dtype is None or dtype == "":
        return "auto"
    return str(dtype).removeprefix("torch.")


def run_identity(data: dict[str, Any]) -> tuple[str, str, str]:
    """The (model, revision, dtype) of an lm-eval results JSON (docs/report.md, "Rows")."""
    config = data.get("config") or {}
    args = _model_args(config)
    model = args.get("pretrained") or args.get("model") or data.get("model_name") or "unknown"
    revision = config.get("model_revision") or args.get("revision") or "main"
    dtype = filed_dtype(config, config.get("model_dtype") or args.get("dtype"))
    model = filed_name(config, model)  # a GGUF checkpoint: its file (lm_coupling.model_source)
    model, revision = _split_local_checkpoint(str(model), str(revision))
    return model, revision, normalize_dtype(dtype)


def _split_local_checkpoint(model: str, revision: str) -> tuple[str, str]:
    """``/runs/tiny/step400`` (revision main) -> (``/runs/tiny``, ``step400``)."""
    path = model.rstrip("/")
    head, _, last = path.rpartition("/")
    if revision == "main" and head and _CHECKPOINT.match(last) and parse_step(last) is not None:
        return head, last
    return model, revision


def is_local_path(model: str) -> bool:
    """Whether a model name is a local folder rather than a hub id (``org/name``)."""
    if model.startswith(("/", "./", "../", "~")) or model.count("/") >= 2:
        return True
    return Path(model).is_dir() and "/" in model


def display_names(models: list[str]) -> dict[str, str]:
    """Short names: the shortest unique tail of >= 2 folders of a local path; others kept.

    Two paths that share a tail get longer tails until they differ (or keep
    their full name), so different folders never merge.
    """
    unique = list(dict.fromkeys(models))
    parts = {
        m: [p for p in m.rstrip("/").split("/") if p not in ("", ".", "..", "~")]
        for m in unique
        if is_local_path(m)
    }
    names = {m: m for m in unique}
    reserved = {m for m in unique if m not in parts}
    pending, depth = set(parts), 2
    while pending:
        tails = {m: "/".join(p[-depth:]) for m, p in parts.items()}
        shared = Counter(tails.values())  # another path with this tail: a count above 1
        for model in sorted(pending):
            tail = tails[model]
            clash = tail in reserved or shared[tail] > 1
            if not clash or depth >= len(parts[model]):
                names[model] = model if clash else tail
                pending.discard(model)
        depth += 1
    return names


def _local_config_shape(model: str) -> dict[str, float]:
    """n_layers and d_model from a local model folder's config.json, when there is one."""
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    layers = next((cfg[k] for k in ("num_hidden_layers", "n_layer") if k in cfg), None)
    width = next((cfg[k] for k in ("hidden_size", "n_embd", "d_model") if k in cfg), None)
    return {k: float(v) for k, v in (("n_layers", layers), ("d_model", width)) if v is not None}


def _run_shape(data: dict[str, Any], model: str) -> dict[str, float]:
    config = data.get("config") or {}
    lmc = config.get("lm_coupling") or {}
    shape = dict(lmc.get("model_shape") or {})
    out = _local_config_shape(model)
    for key in ("n_params", "n_layers", "d_model"):
        if shape.get(key) is not None:
            out[key] = float(shape[key])
    if "n_params" not in out and config.get("model_num_parameters"):
        out["n_params"] = float(config["model_num_parameters"])
    return out


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def parse_results_file(path: Path) -> RunFile:
    """Parse one results JSON.

    Raises:
        ValueError: the file is not JSON or lacks lm-eval's ``results``/``config``.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ValueError("no 'results' table (partial or foreign file)")
    if not isinstance(data.get("config"), dict):
        raise ValueError("no 'config' table (partial or foreign file)")
    identity = run_identity(data)
    lmc = data["config"].get("lm_coupling") or {}
    try:
        catalogue = recorded_catalogue(data["config"])
    except ValueError as exc:
        raise ValueError(f"config.lm_coupling.catalogue: {exc}") from exc
    if catalogue is None:  # a run without --metrics needs none; an earlier release's, installed
        catalogue = Catalogue.installed() if lmc.get("metrics") else Catalogue(source="none")
    declared = set(lmc.get("metrics") or []) | set(catalogue.metrics)
    timestamp = file_timestamp(path, _as_float(data.get("date")))
    results = {k: v for k, v in data["results"].items() if isinstance(v, dict)}
    run = RunFile(path, timestamp, identity, _run_shape(data, identity[0]), declared, results)
    hib = data.get("higher_is_better")
    run.higher_is_better = {k: v for k, v in (hib or {}).items() if isinstance(v, dict)}
    for group, subtasks in (data.get("group_subtasks") or {}).items():
        for task in subtasks if isinstance(subtasks, list) else []:
            run.parents[str(task)] = str(group)
    run.options, run.options_requested = metric_options(data)
    run.settings = task_settings(data, list(results))
    run.catalogue = catalogue
    run.weights = str(_model_args(data["config"]).get("weights") or "")
    return run


def k_setting_name(
    metric: str,
    options: dict[str, Any],
    requested: dict[str, Any] | None = None,
    catalogue: Catalogue | None = None,
) -> str:
    """``coupling`` run with option k = 10 -> ``coupling_k10`` (0.1 -> ``coupling_k0.1``).

    The name carries the K asked for (``requested``, the results'
    ``options_requested``) over the K used (``options``); the option is the
    metric's ``k_option`` in ``catalogue`` (default: the installed plugins').
    A metric without a K option, or a run that did not record it, keeps its name.
    """
    catalogue = catalogue if catalogue is not None else Catalogue.installed()
    option = catalogue.k_option(metric)
    value = (requested or {}).get(option) if option is not None else None
    value = value if value is not None else options.get(option) if option is not None else None
    if value is None:
        return metric
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{metric}_k{text}"


def primary_score_metric(run: RunFile, task: str) -> str | None:
    """The score metric of a task: a benchmark's leaderboard metric, else lm-eval's first.

    lm-eval's first: the first non-geometry metric with a value in the task's
    ``higher_is_better`` table (its ``metric_list`` order), else in its results.
    """
    entry = run.results.get(task, {})
    present = {k.split(",", 1)[0] for k, v in entry.items() if "," in k and _is_number(v)}
    bench = benchmark_of(task)
    if bench is not None:
        return bench.metric if bench.metric in present else None
    ordered = [m for m, better in run.higher_is_better.get(task, {}).items() if better is not None]
    ordered += sorted(present)
    return next(
        (
            m
            for m in ordered
            if m in present
            and not m.endswith("_stderr")
            and not is_geometry_metric(m, run.declared, run.catalogue)
        ),
        None,
    )


def _k_used(value: Any) -> float:
    """An integer K as recorded in the options used; NaN for none or a fraction (old files)."""
    if not _is_number(value):
        return math.nan
    return float(value) if float(value).is_integer() and value >= 1 else math.nan


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _run_values(run: RunFile) -> list[dict[str, Any]]:
    rows = []
    for task, entry in run.results.items():
        n = _as_float(entry.get("sample_len"))
        primary = primary_score_metric(run, task)
        for key, value in entry.items():
            if "," not in key or key in _SKIP_KEYS:
                continue
            metric, filt = key.split(",", 1)
            if metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            geometry = is_geometry_metric(metric, run.declared, run.catalogue)
            kind = "geometry" if geometry else "score"
            name = metric
            if geometry:
                name = k_setting_name(metric, run.options, run.options_requested, run.catalogue)
            setting = run.settings.get(task) or TaskSetting(None, None)
            rows.append(
                dict(
                    zip(IDENTITY, run.identity, strict=True),
                    task=task,
                    metric=name,
                    base_metric=metric,
                    primary_score=kind == "score" and metric == primary,
                    group=run.parents.get(task, ""),
                    filter=filt,
                    value=float(value),
                    stderr=_as_float(entry.get(f"{metric}_stderr,{filt}")),
                    n=n,
                    kind=kind,
                    file=str(run.path),
                    timestamp=run.timestamp,
                    setting=setting.label(),
                    shots=setting.shots,
                    limit=setting.limit,
                    k_used=_k_used(run.options.get(run.catalogue.k_option(metric) or "")),
                )
            )
    return rows


def _parse_geometry(
    path: Path, runs_by_file: dict[Path, RunFile], names: dict[str, str]
) -> dict[str, Any]:
    data = json.loads(path.read_text())
    schema = str(data.get("schema", "")) if isinstance(data, dict) else ""
    if not schema.startswith("lm_coupling.geometry/"):
        raise ValueError("not an lm_coupling.geometry file (no 'schema')")
    model = data.get("model") or {}
    match = _TIMESTAMP.search(path.name)
    sibling = path.with_name(f"results_{match.group(1)}.json") if match else None
    if sibling in runs_by_file:
        identity = runs_by_file[sibling].identity
    else:
        name, revision = _split_local_checkpoint(
            str(model.get("name", "unknown")), str(model.get("revision") or "main")
        )
        identity = (names.get(name, name), revision, normalize_dtype(model.get("dtype")))
    results_file = str(sibling) if sibling in runs_by_file else ""
    stamp = file_timestamp(path)
    return dict(data, identity=identity, path=str(path), timestamp=stamp, results_file=results_file)


def _skip(path: Path, reason: str, skipped: list[str]) -> None:
    skipped.append(f"{path}: {reason}")
    warnings.warn(f"lm-coupling report skipped {path}: {reason}", ReportWarning, stacklevel=3)


def _shapes(runs: list[RunFile], geometry: list[dict[str, Any]]) -> pd.DataFrame:
    shapes: dict[tuple[str, str, str], dict[str, float]] = {}
    for run in sorted(runs, key=lambda r: r.timestamp):
        shapes.setdefault(run.identity, {}).update(run.shape)
    for geo in geometry:
        model = geo.get("model") or {}
        known = shapes.setdefault(geo["identity"], {})
        for key in ("n_params", "n_layers", "d_model"):
            if key not in known and model.get(key) is not None:
                known[key] = float(model[key])
    rows = [dict(zip(IDENTITY, k, strict=True), **v) for k, v in shapes.items()]
    return pd.DataFrame(rows, columns=[*IDENTITY, "n_params", "n_layers", "d_model"])


def load_results(results_dir: str | Path) -> LoadedResults:
    """Read every results, samples and geometry file under ``results_dir``, recursively.

    Raises:
        ReportInputError: the folder does not exist or holds no readable results file.
    """
    root = Path(results_dir)
    if not root.is_dir():
        raise ReportInputError(
            f"results folder {root} does not exist; pass the --output_path of your lm_eval runs"
        )
    skipped: list[str] = []
    runs = []
    for path in sorted(root.rglob("results_*.json")):
        try:
            runs.append(parse_results_file(path))
        except ValueError as exc:
            _skip(path, str(exc), skipped)
    if not runs and skipped:  # results files exist: say what is wrong with each
        raise ReportInputError(
            f"no readable lm-eval results_*.json under {root}; skipped {len(skipped)}: "
            + "; ".join(skipped)
        )
    if not runs:
        raise ReportInputError(
            f"no lm-eval results_*.json under {root}; run lm_eval with --output_path {root} first"
        )
    for run in runs:  # each run's samples files, beside it with its timestamp
        match = _TIMESTAMP.search(run.path.name)
        for task in run.results if match else ():
            path = run.path.with_name(f"samples_{task}_{match.group(1)}.jsonl")
            if path.exists():
                run.samples[task] = path
    separate_models(runs)  # different models under one name never share a row
    names = display_names([run.identity[0] for run in runs])
    for run in runs:
        run.identity = (names[run.identity[0]], *run.identity[1:])
    by_file = {run.path: run for run in runs}
    newest: dict[tuple, dict[str, Any]] = {}
    by_results: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(root.rglob("geometry_*.json")):
        try:
            geo = _parse_geometry(path, by_file, names)
        except (OSError, ValueError, AttributeError) as exc:
            _skip(path, str(exc), skipped)
            continue
        key = (geo["identity"], geo.get("task"))
        if key not in newest or geo["timestamp"] > newest[key]["timestamp"]:
            newest[key] = geo
        if geo["results_file"]:
            by_results[(geo["results_file"], str(geo.get("task")))] = geo
    rows = [row for run in runs for row in _run_values(run)]
    values = pd.DataFrame(rows, columns=VALUE_COLUMNS)
    geometry = list(newest.values())
    paths = {short: full for full, short in names.items()}
    catalogue, notes = _catalogue(runs)
    shapes = _shapes(runs, geometry)
    return LoadedResults(
        values, shapes, runs, geometry, skipped, paths, by_results, catalogue, notes
    )


def _catalogue(runs: list[RunFile]) -> tuple[Catalogue, list[str]]:
    """The runs' catalogues merged (newest first), and a note naming the files without one."""
    merged = Catalogue()
    for run in sorted(runs, key=lambda r: -r.timestamp):
        if run.catalogue.metrics:
            merged = merged.merged(run.catalogue) if merged.metrics else run.catalogue
    derived = [r for r in runs if r.catalogue.source == INSTALLED]
    if not derived:
        return merged, []
    names = ", ".join(str(r.path) for r in derived[:3]) + (" ..." if len(derived) > 3 else "")
    note = (
        f"{len(derived)} results file(s) record no catalogue of metrics (written by an "
        "earlier lm-coupling): their metrics' labels, bounds and profile axes were taken "
        f"from the installed plugins ({names}); re-run them to record their own."
    )
    warnings.warn(note, CatalogueWarning, stacklevel=3)
    return merged, [note]
