"""Write ``geometry_<task>_<timestamp>.json`` beside lm-eval's results file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, TextIO

import numpy as np

import lm_coupling
from lm_coupling.errors import GeometryWarning
from lm_coupling.files import geometry_file_name
from lm_coupling.harness.session import GeometrySession
from lm_coupling.harness.task_records import TaskRecords
from lm_coupling.model_source import filed_dtype, filed_name
from lm_coupling.plugins.calls import isolated_answers, warn_failures

SCHEMA = "lm_coupling.geometry/1"


def _model_identity(results: dict[str, Any], session: GeometrySession) -> dict[str, Any]:
    config = results.get("config", {})
    model_args = config.get("model_args") or {}  # a dict: the core hands lm-eval one
    dtype = str(config.get("model_dtype") or model_args.get("dtype", "")).replace("torch.", "")
    return {
        "name": filed_name(config, model_args.get("pretrained", config.get("model"))),
        "revision": config.get("model_revision") or model_args.get("revision", "main"),
        "dtype": filed_dtype(config, dtype),
        **session.model_shape,
    }


def geometry_document(
    task_name: str,
    records: TaskRecords,
    session: GeometrySession,
    results: dict[str, Any],
    output_dir: Path | None = None,
    run_id: str = "",
) -> dict[str, Any]:
    """The geometry file's content for one task (schema ``lm_coupling.geometry/1``).

    ``output_dir`` (the folder the geometry file goes to; None without
    ``--output_path``) and ``run_id`` (the timestamp in the files' names)
    reach the plugins' ``lmc_aggregate_task``, so that a plugin writes its own
    files beside the geometry file.
    """
    failures = list(records.failures)
    warn_failures(task_name, failures)
    summaries = profile_summaries(task_name, records, session, failures)
    matrices = {m for spec in session.selection.specs.values() for m in spec.matrices}
    document = {
        "schema": SCHEMA,
        "lm_coupling_version": lm_coupling.__version__,
        "task": task_name,
        "model": _model_identity(results, session),
        "options": session.options_used(),
        "metrics": list(session.selection.metrics),
        "n_documents": records.n_documents,
        "capture": dict(records.capture),
        "n_measured": records.n_measured(session.selection.metrics),
        "profiles": {k: v for k, v in summaries.items() if k not in matrices},
        "matrices": {
            k: {"mean": v["mean"], "n": int(max(np.ravel(v["n"]), default=0))}
            for k, v in summaries.items()
            if k in matrices
        },
        "failures": failures,
    }
    sample = session.plans.sample_record(task_name)
    if sample is not None:
        document["sample"] = sample
    timings = records.timings.summary()
    if timings:
        document["timings"] = timings
    # Each plugin writes its own sections (the built-in coupling plugin: "coupling"),
    # each called on its own: one that raises is named in failures, the others write.
    arguments = dict(
        selected=session.selection.metrics,
        profiles=summaries,
        options=session.options_used(),
        documents=records.documents,
        task=task_name,
        doc_ids=list(records.kept_ids),
        output_dir=output_dir,
        run_id=run_id,
    )
    answered = isolated_answers(session.runner.pm, "lmc_aggregate_task", **arguments)
    for plugin, (extra, error) in answered.items():
        if error is not None:
            error = f"lmc_aggregate_task raised {error!r}"
            failures.append({"doc_id": None, "plugin": plugin, "error": error})
            warnings.warn(
                f"lm-coupling: task {task_name!r}: plugin {plugin!r}: {error}",
                GeometryWarning,
                stacklevel=2,
            )
            continue
        document.update(extra or {})
    _count_task_level(document, session, records)
    return document


def _count_task_level(
    document: dict[str, Any], session: GeometrySession, records: TaskRecords
) -> None:
    """``n_measured`` of a task-level metric: the documents its section says it used."""
    for name, spec in session.selection.specs.items():
        if not spec.task_level:
            continue
        value = task_level_value(document, name)
        section = document.get(name) if isinstance(document.get(name), dict) else {}
        used = section.get("n", records.n_documents) if value is not None else 0
        document["n_measured"][name] = int(used)


def task_level_value(document: dict[str, Any], name: str) -> float | None:
    """The finite ``value`` of the section ``name`` of a geometry document, else None."""
    section = document.get(name)
    value = section.get("value") if isinstance(section, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
        return float(value)
    return None


def _task_rows(results: dict[str, Any], documents: dict[str, Any]):
    """Each task's ``(name, geometry document, its metric names, a writer of one row)``.

    The writer puts a metric's value in lm-eval's row of the task under its
    first filter (``name,none``), with the stderr ``"N/A"`` and its direction.
    """
    table = results.get("results") or {}
    for task_name, document in documents.items():
        row = table.get(task_name)
        if not isinstance(row, dict):
            continue
        keys = [k for k in row if "," in k and "_stderr" not in k]
        filter_key = keys[0].split(",", 1)[1] if keys else "none"

        def put(name: str, value: float, higher: bool, row=row, key=filter_key, task=task_name):
            row[f"{name},{key}"] = value
            row[f"{name}_stderr,{key}"] = "N/A"
            results.setdefault("higher_is_better", {}).setdefault(task, {})[name] = higher

        yield task_name, document, {k.split(",", 1)[0] for k in keys}, put


def add_task_level_values(
    results: dict[str, Any], documents: dict[str, Any], session: GeometrySession
) -> None:
    """Put each task-level metric's value in lm-eval's results, once per task.

    A task-level metric (`MetricSpec.task_level`) has no per-document value, so
    lm-eval never sees it; its value, computed by its plugin's
    ``lmc_aggregate_task`` (the section named like the metric, ``"value"``),
    is written here under the task's first filter (``name,none``) with the
    stderr ``"N/A"`` (one number: no spread over documents), before the
    results are printed, saved or logged. Groups do not aggregate it.
    """
    for _task, document, _present, put in _task_rows(results, documents):
        for name, spec in session.selection.specs.items():
            value = task_level_value(document, name) if spec.task_level else None
            if value is not None:
                put(name, value, spec.higher_is_better)


def add_undefined_rows(
    results: dict[str, Any], documents: dict[str, Any], session: GeometrySession
) -> None:
    """Keep a row for each metric that is NaN on every document of a task, with the reason.

    lm-eval averages a metric over the documents that define it, so one
    defined on none would vanish from its table, the results and the
    leaderboard. It is written as NaN (stderr ``"N/A"``) under the task's
    first filter, and ``config.lm_coupling.undefined[task][metric]`` says why:
    its plugin failed, NaN is an answer its spec expects
    (`MetricSpec.nan_expected`), or the geometry is undefined.
    """
    config = (results.get("config") or {}).get("lm_coupling")
    for task_name, document, present, put in _task_rows(results, documents):
        errors = {m: f["error"] for f in document["failures"] for m in f.get("metrics", ())}
        for name, spec in session.selection.specs.items():
            if spec.task_level or name in present:
                continue
            if spec.nan_expected:
                reason = "NaN on every document: an answer its spec expects (nan_expected)"
            elif name in errors:
                reason = f"NaN on every document: plugin {spec.plugin!r} failed ({errors[name]})"
            else:
                reason = "NaN on every document measured: undefined geometry"
            put(name, np.nan, spec.higher_is_better)
            if isinstance(config, dict):
                config.setdefault("undefined", {}).setdefault(task_name, {})[name] = reason


def profile_summaries(
    task_name: str, records: TaskRecords, session: GeometrySession, failures: list[dict]
) -> dict[str, Any]:
    """Mean, stderr and n of each declared profile over the task's documents.

    Read from the streamed summaries (`lm_coupling.harness.streaming.ProfileByShape`).
    Documents whose profile has another shape than most documents' are left
    out of that profile's summary and reported (`warn_failures`, and a
    ``failures`` entry per document naming the plugin and the profile).
    """
    owner = {p: spec for spec in session.selection.specs.values() for p in spec.profiles}
    summaries: dict[str, Any] = {}
    for name in session.selection.profiles:
        streamed = records.profiles.get(name)
        summary = streamed.summary() if streamed is not None else None
        if summary is None:
            continue
        odd = streamed.odd(records.profiled_ids)
        if odd:
            spec = owner[name]
            error = (
                f"profile {name!r} has shape {odd[0][1]} where most documents' have "
                f"{streamed.shape()}; left out of the profile's summary"
            )
            failure = {"plugin": spec.plugin, "metrics": [spec.name], "error": error}
            new = [{"doc_id": doc_id, **failure} for doc_id, _ in odd]
            warn_failures(task_name, new)
            failures.extend(new)
        summaries[name] = summary
    return summaries


def geometry_documents(
    session: GeometrySession,
    results: dict[str, Any],
    output_dir: Path | None = None,
    run_id: str = "",
) -> dict[str, Any]:
    """Per task with measured documents, its geometry document (the file's content)."""
    return {
        task_name: geometry_document(task_name, records, session, results, output_dir, run_id)
        for task_name, records in sorted(session.records.tasks.items())
        if records.n_documents
    }


def write_geometry_file(
    directory: Path, task_name: str, date_id: str, document: dict[str, Any]
) -> Path:
    """Write one task's geometry document as ``geometry_<task>_<date_id>.json``."""
    path = directory / geometry_file_name(task_name, date_id)
    path.write_text(json.dumps(document, indent=2, default=_jsonable), encoding="utf-8")
    return path


def refresh_leaderboard(results_dir: Path, stream: TextIO | None = None) -> Path | None:
    """Rebuild ``results_dir/leaderboard.csv`` from every run in the folder.

    The run's own files are already written; a failure here is a warning that
    names its cause, never a lost run.
    """
    try:
        from lm_coupling.report import write_leaderboard

        path = write_leaderboard(results_dir)
    except Exception as exc:  # the run's results stand; the refresh is reported as failed
        warnings.warn(
            f"lm-coupling: the leaderboard in {results_dir} was not updated ({exc!r}); run "
            f"`lm-coupling report {results_dir}` to see the full error",
            GeometryWarning,
            stacklevel=2,
        )
        return None
    print(f"lm-coupling: leaderboard updated: {path}", file=stream)
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
