"""An index of a results folder, so that the leaderboard refresh reads only what changed.

Every run refreshes ``leaderboard.csv`` from the whole folder
(`lm_coupling.report.leaderboard.write_leaderboard`); without an index, the
hundredth run of a campaign would parse a hundred runs' files. The index,
``<folder>/.lm_coupling_index.json``, keeps for each results and geometry file
its size, modification time and the part of its content the leaderboard reads
(`slim_results`, `slim_geometry`): a file whose size and time are unchanged is
answered from the index; a new or changed one is parsed and added; a file that
vanished is dropped. The index is plain JSON (never code), written atomically,
and rebuilt from the files whenever it is missing, unreadable or of another
schema, so deleting it is always safe. It also keeps the leaderboard rows
built by the last refresh (`lm_coupling.report.row_cache`, under the package
version), so a refresh rebuilds only the rows that changed. The full report (`build_report`) reads
the files themselves (it draws the matrices the index leaves out).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from lm_coupling import __version__
from lm_coupling.report.row_cache import RowCache

INDEX_NAME = ".lm_coupling_index.json"
SCHEMA = "lm_coupling.index/1"

_RESULTS_KEYS = (
    "results", "config", "date", "higher_is_better", "group_subtasks", "n-shot",
    "n-samples", "model_name", "model",
)  # fmt: skip
"""The results JSON's keys the loader reads (`lm_coupling.report.loading`, `settings`)."""

_GEOMETRY_LEFT_OUT = ("matrices", "timings", "failures")
"""Geometry-file sections the leaderboard never reads (the heatmaps and timings do);
its profiles stay (the thought/fixation boundary is read from them)."""


def slim_results(data: Any) -> Any:
    """The keys of a results JSON the leaderboard reads (``configs`` reduced to the shots)."""
    if not isinstance(data, dict):
        return data
    slim = {key: data[key] for key in _RESULTS_KEYS if key in data}
    configs = data.get("configs")
    if isinstance(configs, dict):
        slim["configs"] = {
            task: {"num_fewshot": cfg.get("num_fewshot")} if isinstance(cfg, dict) else cfg
            for task, cfg in configs.items()
        }
    return slim


def slim_geometry(data: Any) -> Any:
    """A geometry file without the sections the leaderboard never reads (`_GEOMETRY_LEFT_OUT`)."""
    if not isinstance(data, dict):
        return data
    return {key: value for key, value in data.items() if key not in _GEOMETRY_LEFT_OUT}


class FolderIndex:
    """The index of one results folder (see the module docstring).

    Args:
        root: the results folder.

    Attributes:
        parsed: files parsed from disk since the index was opened (the rest
            were answered from it).
        rows: the built leaderboard rows (`RowCache`; its ``rebuilt`` counts the
            rows built since the index was opened).
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.path = self.root / INDEX_NAME
        data = self._load()
        entries = data.get("files")
        self.entries: dict[str, dict[str, Any]] = entries if isinstance(entries, dict) else {}
        rows = data.get("rows")
        fresh = isinstance(rows, dict) and data.get("version") == __version__
        self.rows = RowCache(rows if fresh else None)
        self.seen: set[str] = set()
        self.parsed = 0
        self._dirty = False

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return {}
        return data

    def read(self, path: Path, kind: str) -> Any:
        """A file's (slim) content: from the index if unchanged, else parsed and indexed.

        Args:
            path: a results (``kind="results"``) or geometry (``"geometry"``) file.
            kind: which slimming applies.

        Raises:
            ValueError: the file is not valid JSON (nothing is indexed for it).
            OSError: it cannot be read.
        """
        try:  # the loader's paths are under the root as given: no resolve per file
            key = str(Path(path).relative_to(self.root))
        except ValueError:
            key = str(Path(path).resolve().relative_to(self.root.resolve()))
        stat = Path(path).stat()
        stamp = [stat.st_mtime_ns, stat.st_size]
        self.seen.add(key)
        entry = self.entries.get(key)
        if entry is not None and entry.get("stamp") == stamp and entry.get("kind") == kind:
            return entry["content"]
        data = json.loads(Path(path).read_text())
        content = slim_results(data) if kind == "results" else slim_geometry(data)
        self.entries[key] = {"kind": kind, "stamp": stamp, "content": content}
        self.parsed += 1
        self._dirty = True
        return content

    def save(self) -> None:
        """Write the index (atomically), without the files and rows no longer in the folder."""
        stale = set(self.entries) - self.seen
        for key in stale:
            del self.entries[key]
        rows = self.rows.to_store()
        if not (self._dirty or stale or self.rows.dirty):
            return
        text = json.dumps(
            {"schema": SCHEMA, "version": __version__, "files": self.entries, "rows": rows}
        )
        handle, tmp = tempfile.mkstemp(prefix=INDEX_NAME, dir=self.root)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(text)
            os.chmod(tmp, 0o644)  # readable like the results files (mkstemp makes it 0600)
            os.replace(tmp, self.path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise
