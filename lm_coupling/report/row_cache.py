"""Built leaderboard rows kept between refreshes, so a refresh rebuilds only the rows that changed.

The leaderboard refresh after a run (`lm_coupling.report.leaderboard.write_leaderboard`)
builds some columns row by row in Python (the settings columns,
`lm_coupling.report.row_settings`: about 10 ms per model row). A `RowCache`
keeps each row's built part under a fingerprint of everything it is built
from, so a refresh after one more run rebuilds that run's row(s) only; the
cross-row parts (which task groups are scored, the table's order) are
recomputed over the whole table, vectorised.

A row's fingerprint (`row_keys`) hashes, per identity, its selected values'
columns that the row reads, in order, each value's file stamp (modification
time in ns and size: a results file rewritten in place changes it) and, per
value, whether its task's group is scored across the whole table (the one
cross-row input of a row). Hashing is vectorised
(`pandas.util.hash_pandas_object`), 64 bits per value, combined
order-sensitively per identity. The cache is stored in the folder's index
(`lm_coupling.report.index`) under the package version; another version
starts empty, so a changed format never reads old rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

ROW_KEY_COLUMNS = ("task", "group", "setting", "limit", "kind", "metric", "file")
"""The selected values' columns a cached row part is built from (with file stamps)."""


def file_stamps(files: pd.Series) -> pd.Series:
    """``"<mtime_ns>:<size>"`` of each file (one ``stat`` per distinct file, mapped back)."""
    stamps = {}
    for file in files.unique():
        try:
            stat = os.stat(file)
            stamps[file] = f"{stat.st_mtime_ns}:{stat.st_size}"
        except OSError:
            stamps[file] = "missing"
    return files.map(stamps)


def row_keys(selected: pd.DataFrame, groups: set[str], identity: list[str]) -> pd.Series:
    """One fingerprint per identity (see the module docstring), indexed by identity.

    Args:
        selected: the values the leaderboard uses (`newest_values`).
        groups: the task groups scored across the table (`scored_groups`).
        identity: the identity columns (`lm_coupling.report.loading.IDENTITY`; passed
            in, as the loader itself imports the index that imports this module).
    """
    if selected.empty:
        return pd.Series([], index=pd.MultiIndex.from_tuples([], names=identity), dtype=str)
    parts = selected[[*identity, *ROW_KEY_COLUMNS]].astype(str)
    parts = parts.assign(
        _stamp=file_stamps(selected["file"]).to_numpy(),
        _scored=selected["group"].isin(groups).astype(str).to_numpy(),
    )
    hashes = pd.util.hash_pandas_object(parts, index=False).to_numpy(np.uint64)
    grouped = selected.groupby(identity, sort=False)
    codes = grouped.ngroup().to_numpy()
    position = grouped.cumcount().to_numpy().astype(np.uint64)
    weighted = hashes * (np.uint64(2) * position + np.uint64(1))  # order-sensitive; wraps
    total = np.zeros(grouped.ngroups, dtype=np.uint64)
    np.add.at(total, codes, weighted)
    count = np.bincount(codes, minlength=grouped.ngroups)
    first = selected[identity].drop_duplicates()
    keys = [f"{h:016x}.{n}" for h, n in zip(total.tolist(), count.tolist(), strict=True)]
    return pd.Series(keys, index=pd.MultiIndex.from_frame(first), dtype=str)


class RowCache:
    """Built row parts by fingerprint, one section per part (see the module docstring).

    Args:
        stored: ``{section: {fingerprint: record}}`` as read from the index.

    Attributes:
        rebuilt: rows built (not answered from the cache) since it was opened, per
            section.
    """

    def __init__(self, stored: dict[str, dict[str, Any]] | None = None):
        self.sections: dict[str, dict[str, Any]] = stored or {}
        self.used: dict[str, set[str]] = {}
        self.rebuilt: dict[str, int] = {}
        self.dirty = False

    def rows(
        self,
        section: str,
        keys: pd.Series,
        build: Callable[[pd.MultiIndex], dict[tuple, dict[str, Any]]],
    ) -> list[dict[str, Any]]:
        """The records of every identity of ``keys``, in its order; missing ones built.

        Args:
            section: which row part.
            keys: fingerprints by identity (`row_keys`).
            build: builds the records of the identities it is given, by identity.
        """
        stored = self.sections.setdefault(section, {})
        fingerprints = keys.tolist()
        missing = [i for i, key in enumerate(fingerprints) if key not in stored]
        if missing:
            built = build(keys.index[missing])
            for i in missing:
                stored[fingerprints[i]] = built[keys.index[i]]
            self.rebuilt[section] = self.rebuilt.get(section, 0) + len(missing)
            self.dirty = True
        self.used.setdefault(section, set()).update(fingerprints)
        return [stored[key] for key in fingerprints]

    def to_store(self) -> dict[str, dict[str, Any]]:
        """The sections without the rows this refresh did not use (vanished or changed rows)."""
        out = {}
        for section, stored in self.sections.items():
            used = self.used.get(section, set())
            if len(used) != len(stored):
                self.dirty = True
            if used:  # a section not used at all (another catalogue) is dropped
                out[section] = {key: stored[key] for key in used if key in stored}
        return out
