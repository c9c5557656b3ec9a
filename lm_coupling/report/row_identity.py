"""Two different models filed under one name never share a leaderboard row.

Runs with one identity are one model only when what they recorded agrees:
weights fingerprint (an in-memory model, `lm_coupling.harness.model_identity`),
parameter and layer counts. Runs that disagree are renamed
``P [weights 1a2b3c4d]`` or ``P [3 layers, 87104 params]``, with a
`ReportWarning`; a field one run did not record never splits.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from lm_coupling.report.notices import ReportWarning

SIGNATURE_FIELDS = ("weights", "n_params", "n_layers")


def model_signature(run: Any) -> dict[str, Any]:
    """What a run recorded of its model: weights fingerprint, parameter and layer counts."""
    out: dict[str, Any] = {"weights": run.weights} if run.weights else {}
    for key in ("n_params", "n_layers"):
        value = run.shape.get(key)
        if value is not None and math.isfinite(float(value)):
            out[key] = int(value)
    return out


def _conflict(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return any(key in a and key in b and a[key] != b[key] for key in SIGNATURE_FIELDS)


def _label(signature: dict[str, Any], differing: set[str]) -> str:
    if "weights" in differing and "weights" in signature:
        return f"weights {signature['weights'][:8]}"
    parts = []
    if "n_layers" in signature:
        parts.append(f"{signature['n_layers']} layers")
    if "n_params" in signature:
        parts.append(f"{signature['n_params']} params")
    return ", ".join(parts) or "unrecorded model"


def separate_models(runs: list[Any]) -> None:
    """Give runs of different models filed under one identity identities of their own.

    Within an identity, a run joins the first model (in time order) whose
    signature it does not contradict; with several models, every run is
    renamed ``<model> [<what differs>]``, with a `ReportWarning` per split.
    """
    groups: dict[tuple, list[Any]] = {}
    for run in sorted(runs, key=lambda r: r.timestamp):
        groups.setdefault(tuple(run.identity), []).append(run)
    for identity, members in groups.items():
        models: list[tuple[dict[str, Any], list[Any]]] = []
        for run in members:
            signature = model_signature(run)
            for known, group in models:
                if not _conflict(known, signature):
                    known.update(signature)
                    group.append(run)
                    break
            else:
                models.append((dict(signature), [run]))
        if len(models) < 2:
            continue
        differing = {
            key
            for key in SIGNATURE_FIELDS
            if len({str(sig.get(key)) for sig, _ in models if key in sig}) > 1
        }
        names = []
        for signature, group in models:
            name = f"{identity[0]} [{_label(signature, differing)}]"
            names.append(name)
            for run in group:
                run.identity = (name, *run.identity[1:])
        files = "; ".join(
            f"{n}: {', '.join(str(r.path) for r in g)}"
            for n, (_, g) in zip(names, models, strict=True)
        )
        message = (
            f"{len(models)} different models ({', '.join(sorted(differing))} differ) were filed "
            f"under the name {identity[0]!r}; they are kept apart as {', '.join(map(repr, names))} "
            f"({files}). Name each model: evaluate(model=..., model_name='NAME') for a model in "
            "memory, or its own pretrained= path"
        )
        warnings.warn(message, ReportWarning, stacklevel=3)
