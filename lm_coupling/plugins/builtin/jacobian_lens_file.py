"""Jacobian-lens files, interchangeable with TransformerLens's (``JacobianLens.save`` / ``load``).

A lens file is the reference implementation's artifact, which TransformerLens
4.3 writes and reads (``torch.save``; ``torch.load(path, weights_only=True)``):

    {"J": {l: [d, d]}, "n_prompts": N, "source_layers": [l, ...], "d_model": d,
     "metadata": {...}}

with ``J[l]`` the transport of block l's output (0-based), i.e. state ``l + 1``
here, rows the output coordinates, for ``l = 0 .. L-2`` (the last block's
transport is the identity and is not stored). lm-coupling adds, under keys
TransformerLens ignores, the transport of state 0 (``"lm_coupling_state0"``)
and ``metadata["lm_coupling"]`` (format, version, task, L, estimator, a
fingerprint of the unembedding). :func:`load_lens` reads either; states
without a transport are NaN (docs/metrics.md, "The Jacobian lens").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_coupling.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

FORMAT = "lm_coupling.jacobian_lens"
VERSION = 2
STATE0 = "lm_coupling_state0"
"""Top-level key of the state-0 (embedding output) transport; TransformerLens ignores it."""

ESTIMATOR_NAMES = {"reference": "jacobian_lens", "last_position": "lm_coupling_last_position"}
"""Our estimator option -> the ``metadata["estimator"]`` written (TransformerLens's name first)."""


def save_lens(
    path: str | Path,
    jacobians: torch.Tensor,
    n_documents: int,
    task: str,
    identity: dict[str, Any] | None = None,
    fit: dict[str, Any] | None = None,
) -> Path:
    """Write a fitted lens ``[L+1, d, d]`` in the interchange format; returns the file written.

    Args:
        path: a ``.pt`` path, or a folder (``jlens_<task>.pt`` inside).
        jacobians: ``J_l`` for states l = 0..L (``J_L = I``; not stored).
        n_documents: documents the lens was fitted on.
        task: the task it was fitted on (``metadata["corpus"]``).
        identity: ``jacobian.lens_fit.model_identity`` of the model.
        fit: the fit's options (``estimator``, ``skip_first_positions``, ...).
    """
    import torch

    path = Path(path)
    if path.suffix != ".pt":
        path = path / f"jlens_{task}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    J = jacobians.detach().to("cpu", torch.float32).contiguous()
    n_layers, d = J.shape[0] - 1, J.shape[-1]
    identity, fit = dict(identity or {}), dict(fit or {})
    estimator = fit.pop("estimator", "reference")
    metadata: dict[str, Any] = {
        "model_name": identity.get("model_name"),
        "model_revision": identity.get("model_revision"),
        "estimator": ESTIMATOR_NAMES.get(estimator, estimator),
        "hook_convention": "blocks.{layer}.hook_out",
        "corpus": task,
        "n_prompts": int(n_documents),
        "fit_dtype": "float32",
        "target_layer": n_layers - 1,
        **fit,
        "lm_coupling": {
            "format": FORMAT,
            "version": VERSION,
            "task": task,
            "n_layers": n_layers,
            "estimator": estimator,
            "model_type": identity.get("model_type"),
            "unembedding_sha256": identity.get("unembedding_sha256"),
        },
    }
    record = {
        "J": {layer - 1: J[layer].clone() for layer in range(1, n_layers)},
        "n_prompts": int(n_documents),
        "source_layers": list(range(n_layers - 1)),
        "d_model": int(d),
        "metadata": metadata,
        STATE0: J[0].clone(),
    }
    torch.save(record, path)
    return path


def _refuse(path: Path, why: str) -> ConfigurationError:
    return ConfigurationError(f"jlens_path={path}: {why}")


def load_lens(
    path: str | Path, n_layers: int, d_model: int, unembedding_sha256: str | None = None
) -> dict[str, Any]:
    """Read a lens file and check it belongs to a model of L blocks, width d and this head.

    Args:
        path: the file.
        n_layers: L of the model read through it.
        d_model: d of that model.
        unembedding_sha256: that model's fingerprint
            (``jacobian.lens_fit.unembedding_fingerprint``); a file
            that records another is refused.

    Returns:
        ``{"jacobians": [L+1, d, d] float32 (NaN where the file has no
        transport; J_L = I), "n_documents", "task", "n_layers", "d_model",
        "metadata"}``.

    Raises:
        ConfigurationError: the file is not a lens, or it belongs to another
            model (width, depth, final-layer target, unembedding).
    """
    import torch

    path = Path(path)
    record = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(record, dict) and record.get("format") == FORMAT:
        raise _refuse(
            path,
            "is an lm-coupling lens of version 1, which this version no longer reads: "
            "fit the lens again (jlens_fit)",
        )
    if not isinstance(record, dict) or "J" not in record:
        raise _refuse(path, f"is not a Jacobian lens file ({FORMAT} or TransformerLens's)")
    transports = dict(record["J"])
    metadata = dict(record.get("metadata") or {})
    ours = metadata.get("lm_coupling") if isinstance(metadata.get("lm_coupling"), dict) else {}
    widths = {tuple(m.shape) for m in transports.values()}
    if widths - {(d_model, d_model)}:
        raise _refuse(
            path,
            f"holds transports of shape {sorted(widths)}; this model has d = {d_model}: the "
            "lens belongs to another model",
        )
    outside = sorted(int(layer) for layer in transports if not 0 <= int(layer) < n_layers - 1)
    if outside:
        raise _refuse(
            path,
            f"has source layers {outside} outside this model's 0..{n_layers - 2} (L = "
            f"{n_layers}): the lens belongs to another model",
        )
    target = int(metadata.get("target_layer", n_layers - 1))
    recorded_depth = ours.get("n_layers")
    if target != n_layers - 1 or (recorded_depth is not None and recorded_depth != n_layers):
        raise _refuse(
            path,
            f"was fitted with target layer {target} (of {recorded_depth or '?'} blocks); this "
            f"model's final block is {n_layers - 1}: the lens belongs to another model",
        )
    recorded = ours.get("unembedding_sha256")
    if recorded and unembedding_sha256 and recorded != unembedding_sha256:
        raise _refuse(
            path,
            f"was fitted on model {metadata.get('model_name')!r} with another unembedding "
            f"(sha256 {recorded[:12]}..., this model's {unembedding_sha256[:12]}...): fit the "
            "lens on this model",
        )
    J = torch.full((n_layers + 1, d_model, d_model), math.nan)
    J[n_layers] = torch.eye(d_model)
    for layer, matrix in transports.items():
        J[int(layer) + 1] = matrix.float()
    if isinstance(record.get(STATE0), torch.Tensor):
        J[0] = record[STATE0].float()
    return {
        "jacobians": J,
        "n_documents": int(record.get("n_prompts", 0)),
        "task": ours.get("task", metadata.get("corpus")),
        "n_layers": n_layers,
        "d_model": d_model,
        "metadata": metadata,
    }
