"""A geometry cache beside lm-eval's ``--use_cache`` response cache.

Documents lm-eval answers from its cache never reach the model, so their
geometry is read from here: an interrupted run, rerun with the same command,
ends with the numbers of an uninterrupted one to float32 round-off (largest
difference measured: 1.7e-6). An entry is served only to a run of the same
identity (model, revision, weights fingerprint, dtype, context length,
metrics, options, lm-coupling and plugin versions); an entry that lacks a
metric the document needs is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import numpy as np
import torch

from lm_coupling.geometry import DocumentGeometry
from lm_coupling.harness.plan import GeometryKey


class GeometryCache:
    """SQLite store of `DocumentGeometry`, keyed by model, options and prompt.

    Args:
        path: database file (``<use_cache>_geometry_rank<r>.db``).
        identity: what makes measurements comparable: model arguments,
            metrics and options. Entries of another identity are never read.
        timeout: seconds to wait for another run's write to the same file.
    """

    def __init__(self, path: str | Path, identity: dict, timeout: float = 60.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._identity = json.dumps(identity, sort_keys=True, default=str)
        self._db = sqlite3.connect(str(self.path), timeout=timeout)  # waits for another run's write
        with self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS geometry (key TEXT PRIMARY KEY, value TEXT)"
            )

    def _hash(self, key: GeometryKey) -> str:
        text = json.dumps([self._identity, *key], ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def put(self, key: GeometryKey, geometry: DocumentGeometry) -> None:
        """Store (or replace) the geometry measured at ``key``."""
        value = json.dumps(
            {
                "values": geometry.values,
                "profiles": {k: v.tolist() for k, v in geometry.profiles.items()},
                "jacobian_methods": geometry.jacobian_methods,
            }
        )
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO geometry VALUES (?, ?)", (self._hash(key), value)
            )

    def get(self, key: GeometryKey) -> DocumentGeometry | None:
        """The stored geometry at ``key``, or None."""
        row = self._db.execute(
            "SELECT value FROM geometry WHERE key = ?", (self._hash(key),)
        ).fetchone()
        if row is None:
            return None
        data = json.loads(row[0])
        return DocumentGeometry(
            values={k: float("nan") if v is None else v for k, v in data["values"].items()},
            profiles={k: np.asarray(v, dtype=np.float64) for k, v in data["profiles"].items()},
            jacobian_methods=data["jacobian_methods"],
        )


_FINGERPRINT_ELEMENTS = 1024


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A cheap hash of a model's weights: every tensor's name, shape, dtype and end values.

    The first and last 1024 elements of each tensor (any training step changes
    them); tensors on the meta device (offloaded) count by name and shape only.
    """
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if tensor.is_meta or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        for part in (flat[:_FINGERPRINT_ELEMENTS], flat[-_FINGERPRINT_ELEMENTS:]):
            digest.update(part.to("cpu", torch.float64).numpy().tobytes())
    return digest.hexdigest()
