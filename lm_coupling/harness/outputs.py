"""Write ``geometry_<task>_<timestamp>.json`` beside lm-eval's results file."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

import lm_coupling
from lm_coupling.harness.session import GeometrySession, TaskRecords
from lm_coupling.plugins.builtin.coupling import clamped_k

SCHEMA = "lm_coupling.geometry/1"
MATRIX_PROFILES = ("coupling", "alignment_ratio")


def _model_identity(results: dict[str, Any], session: GeometrySession) -> dict[str, Any]:
    config = results.get("config", {})
    model_args = config.get("model_args") or {}
    if isinstance(model_args, str):
        model_args = dict(pair.split("=", 1) for pair in model_args.split(",") if "=" in pair)
    return {
        "name": model_args.get("pretrained", config.get("model")),
        "revision": config.get("model_revision") or model_args.get("revision", "main"),
        "dtype": str(config.get("model_dtype") or model_args.get("dtype", "")).replace(
            "torch.", ""
        ),
        **session.model_shape,
    }


def profile_summary(arrays: list[np.ndarray]) -> dict[str, Any]:
    """Element-wise NaN-aware mean, standard error and count of profiles."""
    stack = np.stack(arrays).astype(np.float64)
    finite = np.isfinite(stack)
    n = finite.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(
            n > 0, np.nansum(np.where(finite, stack, 0), axis=0) / np.maximum(n, 1), np.nan
        )
        sq = np.nansum(np.where(finite, (stack - mean) ** 2, 0), axis=0)
        std = np.sqrt(sq / np.maximum(n - 1, 1))
        stderr = np.where(n > 1, std / np.sqrt(np.maximum(n, 1)), np.nan)
    return {"mean": _json_array(mean), "stderr": _json_array(stderr), "n": n.tolist()}


def _json_array(array: np.ndarray) -> list:
    """NaN becomes None (JSON null)."""
    return np.where(np.isfinite(array), array, None).tolist()


def _coupling_section(profiles: dict, records: TaskRecords, session: GeometrySession):
    options = session.selection.options
    if "coupling" not in session.selection.metrics:
        return None
    methods = [doc.jacobian_methods for doc in records.documents if doc.jacobian_methods]
    per_layer = (
        [Counter(layer).most_common(1)[0][0] for layer in zip(*methods, strict=False)]
        if methods
        else []
    )
    n_sampled = sum(np.isfinite(doc.values.get("coupling", np.nan)) for doc in records.documents)
    d_model = session.model_shape.get("d_model") or 1
    return {
        "k": clamped_k(options["k"], d_model),
        "norm": options["norm"],
        "elementwise_abs": options["elementwise_abs"],
        "pairs": options["pairs"],
        "n_sampled": int(n_sampled),
        "singular_values": profiles.get("singular_values", {}).get("mean"),
        "spectral_gap": profiles.get("spectral_gap", {}).get("mean"),
        "method": per_layer,
        # Engine diagnostics per layer (see lm_coupling.capture.jacobian): most
        # common route, mean iterations and residual over the sampled
        # documents, and whether the layer was ill-defined in any of them.
        "route": per_layer,
        "iterations": profiles.get("jacobian_iterations", {}).get("mean"),
        "residual": profiles.get("jacobian_residual", {}).get("mean"),
        "ill_defined": [
            None if v is None else bool(v > 0)
            for v in profiles.get("jacobian_ill_defined", {}).get("mean") or []
        ],
    }


def geometry_document(
    task_name: str, records: TaskRecords, session: GeometrySession, results: dict[str, Any]
) -> dict[str, Any]:
    """The geometry file's content for one task (schema ``lm_coupling.geometry/1``)."""
    summaries: dict[str, Any] = {}
    for name in session.selection.profiles:
        arrays = [doc.profiles[name] for doc in records.documents if name in doc.profiles]
        if arrays and len({a.shape for a in arrays}) == 1:
            summaries[name] = profile_summary(arrays)
    document = {
        "schema": SCHEMA,
        "lm_coupling_version": lm_coupling.__version__,
        "task": task_name,
        "model": _model_identity(results, session),
        "options": session.selection.options,
        "metrics": list(session.selection.metrics),
        "n_documents": len(records.documents),
        "profiles": {k: v for k, v in summaries.items() if k not in MATRIX_PROFILES},
        "matrices": {
            k: {"mean": v["mean"], "n": int(max(np.ravel(v["n"]), default=0))}
            for k, v in summaries.items()
            if k in MATRIX_PROFILES
        },
        "coupling": _coupling_section(summaries, records, session),
        "failures": records.failures,
    }
    extras = session.runner.pm.hook.lmc_aggregate_task(
        selected=session.selection.metrics, profiles=summaries, options=session.selection.options
    )
    for extra in extras:
        document.update(extra or {})
    return document


def results_file_location(output_path: str, model_dir_name: str) -> Path:
    """The folder lm-eval's EvaluationTracker wrote its results file into."""
    path = Path(output_path)
    return path.parent if path.suffix == ".json" else path / model_dir_name


def write_geometry_files(
    directory: Path, date_id: str, session: GeometrySession, results: dict[str, Any]
) -> list[Path]:
    """Write one geometry file per task that has measured documents."""
    written = []
    for task_name, records in sorted(session.records.items()):
        if not records.documents:
            continue
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", task_name)
        path = directory / f"geometry_{safe}_{date_id}.json"
        document = geometry_document(task_name, records, session, results)
        path.write_text(json.dumps(document, indent=2, default=_jsonable), encoding="utf-8")
        written.append(path)
    return written


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
