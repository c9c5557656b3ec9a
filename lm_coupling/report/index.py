"""The index of a results folder, split per run folder, so a refresh reads what changed only.

Every run refreshes ``leaderboard.csv`` from the whole folder
(`lm_coupling.report.refresh.write_leaderboard`). The index lives in
``<folder>/.lm_coupling_index/`` and holds two kinds of file:

- one **shard per run folder** (``shard-<hash>.json``, the folder lm-eval
  writes a model's runs into): for each of its results and geometry files,
  the file's size, modification time and the part of its content the
  leaderboard reads (`slim_results`, `slim_geometry`). A refresh opens the
  shard of a folder only when a file in it was added, changed or removed;
  a file whose size and time are unchanged is answered from the shard.
- one **summary** (``summary.json``): per run folder, a digest of its files'
  names, sizes and times, and what the refresh needs of its runs without
  reading them (identity, time, model signature, catalogue); the recorded
  catalogues (one copy each); and the built leaderboard rows
  (`lm_coupling.report.refresh`).

So the refresh after one more run reads the summary, the new run's files and
its folder's shard, and writes them back: the bytes it reads and writes per
run folder are those of one run, and the summary holds a few hundred bytes
per folder plus the table's own rows.

Every file of the index carries the schema `SCHEMA` and the package version;
the summary also a checksum of its content. A file that is missing,
unreadable, truncated, edited, of another schema or written by another
version is not trusted: what it described is rebuilt from the results files
(deleting the index is always safe). A file whose size or modification time
changed is parsed again. Files are written atomically (a temporary file
renamed over the old one), never read as code.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lm_coupling import __version__

INDEX_DIR = ".lm_coupling_index"
SUMMARY_NAME = "summary.json"
LEGACY_INDEX = ".lm_coupling_index.json"
"""The single-file index of lm-coupling before the split (removed when found)."""
SCHEMA = "lm_coupling.index/2"

_RESULTS_KEYS = (
    "results", "config", "date", "higher_is_better", "group_subtasks", "n-shot",
    "n-samples", "model_name", "model",
)  # fmt: skip
"""The results JSON's keys the loader reads (`lm_coupling.report.loading`, `settings`)."""

_GEOMETRY_LEFT_OUT = ("matrices", "timings", "failures")
"""Geometry-file sections the leaderboard never reads (the heatmaps and timings do);
its profiles stay (the thought/fixation boundary is read from them)."""

RESULTS, GEOMETRY = "results", "geometry"


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


def file_kind(name: str) -> str | None:
    """``results`` / ``geometry`` for the names the loader reads (``results_*.json``, ...)."""
    if not name.endswith(".json"):
        return None
    if name.startswith("results_") and len(name) >= len("results_.json"):
        return RESULTS
    if name.startswith("geometry_") and len(name) >= len("geometry_.json"):
        return GEOMETRY
    return None


def path_key(path: str | Path) -> list[str]:
    """The order `sorted(Path.rglob(...))` puts paths in: by their parts."""
    return str(path).split("/")


def scan_folder(root: Path) -> dict[str, list[tuple[str, int, int]]]:
    """Every results and geometry file under ``root``, by folder: ``(name, mtime_ns, size)``.

    The files `Path.rglob` finds (``results_*.json``, ``geometry_*.json`` at any
    depth, symbolic links to folders not followed), one ``stat`` each; folders
    are keyed by their path relative to ``root`` (``"."`` for the root).
    """
    found: dict[str, list[tuple[str, int, int]]] = {}
    pending = [str(root)]
    base = len(str(root)) + 1
    while pending:
        folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        files = []
        for entry in entries:
            try:
                if entry.is_dir() and not entry.is_symlink():
                    pending.append(entry.path)
                    continue
            except OSError:
                continue
            name = entry.name  # `file_kind`, inline: this loop sees every file of the folder
            if not name.endswith(".json") or not name.startswith(("results_", "geometry_")):
                continue
            try:
                stat = entry.stat()
            except OSError:
                continue
            files.append((name, stat.st_mtime_ns, stat.st_size))
        if files:
            found[folder[base:] or "."] = sorted(files)
    return found


def folder_digest(files: list[tuple[str, int, int]]) -> str:
    """A digest of a folder's files' names, times and sizes (a change anywhere changes it)."""
    return hashlib.blake2b(repr(files).encode(), digest_size=12).hexdigest()


def index_dir(root: Path) -> Path:
    """The index folder of a results folder."""
    return Path(root) / INDEX_DIR


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, 0o644)  # readable like the results files (mkstemp makes it 0600)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise


def _checksum(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def read_checked(path: Path) -> dict[str, Any] | None:
    """An index file's content, or None when it is missing, damaged or not this version's.

    The file is a header line (schema, package version, checksum of the rest)
    and the content as JSON.
    """
    try:
        header, _, body = path.read_text(encoding="utf-8").partition("\n")
        head = json.loads(header)
        if not isinstance(head, dict) or head.get("schema") != SCHEMA:
            return None
        if head.get("version") != __version__ or head.get("checksum") != _checksum(body):
            return None
        data = json.loads(body)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_checked(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` with its header (see `read_checked`), atomically."""
    body = json.dumps(data, separators=(",", ":"))
    head = json.dumps({"schema": SCHEMA, "version": __version__, "checksum": _checksum(body)})
    _write_atomic(path, head + "\n" + body)


class Shard:
    """The indexed files of one run folder (see the module docstring).

    Args:
        root: the results folder.
        folder: the run folder, relative to ``root`` (``"."`` for the root itself).

    Attributes:
        parsed: files parsed from disk since the shard was opened (the rest were
            answered from it).
        trusted: whether the stored shard was read and accepted.
    """

    def __init__(self, root: Path, folder: str):
        self.root = Path(root)
        self.folder = folder
        self.path = index_dir(root) / _shard_name(folder)
        data = read_checked(self.path)
        self.trusted = data is not None and data.get("folder") == folder
        files = data.get("files") if self.trusted and data is not None else None
        self.entries: dict[str, dict[str, Any]] = files if isinstance(files, dict) else {}
        self.seen: set[str] = set()
        self.parsed = 0
        self._dirty = not self.trusted

    def read(self, path: Path, kind: str, stamp: list[int] | None = None) -> Any:
        """A file's (slim) content: from the shard if unchanged, else parsed and stored.

        Args:
            path: a results (``kind="results"``) or geometry (``"geometry"``) file
                of this folder.
            kind: which slimming applies.
            stamp: its ``[mtime_ns, size]`` when the caller has it (else one ``stat``).

        Raises:
            ValueError: the file is not valid JSON (nothing is stored for it).
            OSError: it cannot be read.
        """
        name = Path(path).name
        if stamp is None:
            stat = Path(path).stat()
            stamp = [stat.st_mtime_ns, stat.st_size]
        self.seen.add(name)
        entry = self.entries.get(name)
        if entry is not None and entry.get("stamp") == list(stamp) and entry.get("kind") == kind:
            return entry["content"]
        data = json.loads(Path(path).read_text())
        content = slim_results(data) if kind == RESULTS else slim_geometry(data)
        self.entries[name] = {"kind": kind, "stamp": list(stamp), "content": content}
        self.parsed += 1
        self._dirty = True
        return content

    def save(self) -> None:
        """Write the shard (atomically) without the files no longer in the folder."""
        stale = set(self.entries) - self.seen
        for name in stale:
            del self.entries[name]
        if self._dirty or stale:
            write_checked(self.path, {"folder": self.folder, "files": self.entries})
            self._dirty = False


class FolderReader:
    """A reader of any file under ``root`` through its folder's shard (`Shard`).

    What `lm_coupling.report.loading.load_results` takes as ``index``: a
    ``read(path, kind)`` that answers unchanged files from the index.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.shards: dict[str, Shard] = {}
        self.runs: dict[Path, Any] = {}  # results files parsed this refresh, by path

    def shard(self, folder: str) -> Shard:
        """The shard of one run folder (opened once)."""
        if folder not in self.shards:
            self.shards[folder] = Shard(self.root, folder)
        return self.shards[folder]

    def folder_of(self, path: Path) -> str:
        """The folder of ``path`` relative to the root (``"."`` for the root)."""
        try:
            parent = Path(path).parent.relative_to(self.root)
        except ValueError:
            parent = Path(path).resolve().parent.relative_to(self.root.resolve())
        return str(parent)

    def read(self, path: Path, kind: str, stamp: list[int] | None = None) -> Any:
        """`Shard.read` in the file's folder's shard."""
        return self.shard(self.folder_of(path)).read(path, kind, stamp)

    @property
    def parsed(self) -> int:
        """Files parsed from disk by every shard opened."""
        return sum(shard.parsed for shard in self.shards.values())

    def save(self) -> None:
        """Save every shard opened."""
        for shard in self.shards.values():
            shard.save()


def remove_shards(root: Path, keep: set[str]) -> None:
    """Delete the shards of folders not in ``keep`` (their run folders are gone)."""
    wanted = {_shard_name(folder) for folder in keep}
    for path in _shard_files(root):
        if path.name not in wanted:
            path.unlink(missing_ok=True)


def _shard_name(folder: str) -> str:
    return f"shard-{hashlib.blake2b(folder.encode(), digest_size=10).hexdigest()}.json"


def _shard_files(root: Path) -> Iterator[Path]:
    folder = index_dir(root)
    if folder.is_dir():
        yield from folder.glob("shard-*.json")
