"""Per-task running summaries, so that a run's memory does not grow with its documents.

Each profile is summarised per shape (`ProfileByShape`), so a document whose
profile has another shape than most is still reported, naming its plugin.
The summaries merge across data-parallel ranks (Chan, Golub and LeVeque's
pairwise update of the mean and the sum of squared deviations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RunningProfile:
    """Element-wise NaN-aware count, mean and sum of squared deviations of one profile.

    Each document's profile (all of one shape, `ProfileByShape`) is folded in
    as it comes (Welford's update, the case ``n_b = 1`` of `_fold`): nothing
    is kept per document.

    Attributes:
        n: finite values per element.
        mean: their mean (0 where n is 0).
        m2: the sum of their squared deviations from the mean.
    """

    n: np.ndarray | None = None
    mean: np.ndarray | None = None
    m2: np.ndarray | None = None

    def add(self, array: Any) -> None:
        """Fold one document's profile in (non-finite elements are not counted)."""
        value = np.asarray(array, dtype=np.float64)
        finite = np.isfinite(value)
        self._fold(finite.astype(np.int64), np.where(finite, value, 0.0), np.zeros_like(value))

    def merge(self, other: RunningProfile) -> None:
        """Fold another summary of the same shape in (Chan et al.'s pairwise update)."""
        if other.n is not None:
            self._fold(other.n, other.mean, other.m2)

    def _fold(self, n_b: np.ndarray, mean_b: np.ndarray, m2_b: np.ndarray) -> None:
        """Chan, Golub and LeVeque's update by a part ``(n_b, mean_b, m2_b)``, in place.

        ``n = n_a + n_b``, ``delta = mean_b - mean_a``;
        ``m2 = m2_a + m2_b + delta^2 n_a n_b / n``, ``mean = mean_a + delta n_b / n``.
        """
        if self.n is None:  # the update from zeros gives the part itself, exactly
            self.n = np.zeros_like(n_b)
            self.mean, self.m2 = np.zeros(n_b.shape), np.zeros(n_b.shape)
        n = self.n + n_b
        delta = mean_b - self.mean
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(n > 0, n_b / np.maximum(n, 1), 0.0)
            self.m2 += m2_b + delta**2 * self.n * share
        self.mean += delta * share
        self.n += n_b

    def summary(self) -> dict[str, Any] | None:
        """``{"mean", "stderr", "n"}`` lists (NaN as None), or None when empty."""
        if self.n is None:
            return None
        n = self.n
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(n > 0, self.mean, np.nan)
            std = np.sqrt(self.m2 / np.maximum(n - 1, 1))
            stderr = np.where(n > 1, std / np.sqrt(np.maximum(n, 1)), np.nan)
        return {"mean": _json_array(mean), "stderr": _json_array(stderr), "n": n.tolist()}


@dataclass
class ProfileByShape:
    """One profile's running summary per shape, and which documents had each shape.

    A profile of another shape on some documents neither spoils the summary
    nor vanishes: each shape keeps its own `RunningProfile`, and its documents
    as runs ``[start, stop)`` of positions in the task's scoring order.

    Attributes:
        shapes: running summary per shape, in the order the shapes first came.
        runs: per shape, ``[start, stop)`` positions in `TaskRecords.profiled_ids`.
    """

    shapes: dict[tuple[int, ...], RunningProfile] = field(default_factory=dict)
    runs: dict[tuple[int, ...], list[list[int]]] = field(default_factory=dict)

    def add(self, position: int, array: Any) -> None:
        """Take the profile of the document at ``position`` in the task's scoring order."""
        array = np.asarray(array, dtype=np.float64)
        self.shapes.setdefault(array.shape, RunningProfile()).add(array)
        _extend_runs(self.runs.setdefault(array.shape, []), position, position + 1)

    def merge(self, other: ProfileByShape, offset: int) -> None:
        """Fold another rank's profile in; its positions come ``offset`` after this one's."""
        for shape, profile in other.shapes.items():
            self.shapes.setdefault(shape, RunningProfile()).merge(profile)
            runs = self.runs.setdefault(shape, [])
            for start, stop in other.runs[shape]:
                _extend_runs(runs, start + offset, stop + offset)

    def shape(self) -> tuple[int, ...] | None:
        """The shape most documents' profile has (the first to come, on a tie)."""
        counts = {shape: sum(b - a for a, b in runs) for shape, runs in self.runs.items()}
        return max(counts, key=counts.__getitem__) if counts else None

    def summary(self) -> dict[str, Any] | None:
        """`RunningProfile.summary` over the documents of the most common shape."""
        shape = self.shape()
        return None if shape is None else self.shapes[shape].summary()

    def odd(self, doc_ids: list[Any]) -> list[tuple[Any, tuple[int, ...]]]:
        """``(doc_id, shape)`` of the documents left out of `summary` (another shape)."""
        shape = self.shape()
        return [
            (doc_ids[i], other)
            for other, runs in self.runs.items()
            if other != shape
            for start, stop in runs
            for i in range(start, stop)
        ]


def _extend_runs(runs: list[list[int]], start: int, stop: int) -> None:
    """Append ``[start, stop)`` to sorted runs, joined to the last one when adjacent."""
    if runs and runs[-1][1] == start:
        runs[-1][1] = stop
    else:
        runs.append([start, stop])


@dataclass
class RunningTimings:
    """Sums and counts of each document's timings (`DocumentGeometry.timings`).

    A timing is seconds (a number) or seconds per layer (a list); one whose
    per-layer length differs between documents is left out of ``per_layer``.
    """

    totals: dict[str, list[Any]] = field(default_factory=dict)  # name -> [sum, count]
    mixed: set[str] = field(default_factory=set)

    def add(self, timings: dict[str, Any]) -> None:
        """Fold one document's timings in."""
        for name, value in timings.items():
            self._add(name, np.asarray(value, dtype=np.float64), 1)

    def _add(self, name: str, total: np.ndarray, count: int) -> None:
        entry = self.totals.get(name)
        if entry is None:
            self.totals[name] = [total.copy(), count]
        elif entry[0].shape != total.shape:
            self.mixed.add(name)
        else:
            entry[0] = entry[0] + total
            entry[1] += count

    def merge(self, other: RunningTimings) -> None:
        """Fold another rank's timings in."""
        for name, (total, count) in other.totals.items():
            self._add(name, total, count)
        self.mixed |= other.mixed

    def summary(self) -> dict[str, Any]:
        """The geometry file's ``timings``: seconds per document, and per layer."""
        if not self.totals:
            return {}
        scalars = {k: v for k, v in self.totals.items() if v[0].ndim == 0}
        counts = {name: count for name, (_, count) in scalars.items()}
        return {
            "n_documents": max(counts.values(), default=0),
            "n_documents_per_part": counts,
            "seconds_per_document": {
                k: float(total / count) for k, (total, count) in scalars.items()
            },
            "per_layer": {
                k: (total / count).tolist()
                for k, (total, count) in self.totals.items()
                if total.ndim and k not in self.mixed
            },
        }


def _json_array(array: np.ndarray) -> list:
    """NaN becomes None (JSON null)."""
    return np.where(np.isfinite(array), array, None).tolist()
