"""The leaderboard refresh after each run, at a cost that does not grow with the folder.

`write_leaderboard` writes ``<folder>/leaderboard.csv``: the table
`lm_coupling.report.leaderboard.build_leaderboard` builds from every run in
the folder, byte for byte. It keeps, in the folder's index
(`lm_coupling.report.index`), one **record per leaderboard row** (a model
identity): the row's cells and the few facts about the row that other rows
depend on. A refresh:

1. lists the folder (one ``stat`` per results or geometry file) and compares
   each run folder's digest of names, sizes and times with the summary's;
2. reads the files of the changed run folders only (through their shards),
   and from the summary what it needs of every run without reading it
   (identity, time, model signature, catalogue), so identities are resolved
   across the folder exactly as `lm_coupling.report.loading.load_results`
   does (`separate_models`, `display_names`, the merged catalogue);
3. rebuilds the records of the rows whose run folders changed, with the
   same functions as the full build applied to those rows alone
   (`newest_values`, `geometry_rows`, `row_columns`, `geometry_table`): each of
   them computes a row from the row's own values, given what comes from other
   rows, which the refresh passes in:

   - the **scored groups** (`scored_groups`: a group's own score makes its
     subtasks one unit on every row), kept as each record's groups and
     primary-scored tasks;
   - the **common task sets** of the geometry columns (`geometry_table`), kept
     as each record's units per metric, and whether a metric has a K;
   - the runs' **catalogue** (sampled metrics, boundary profiles);
   - the **column order**: each record keeps, per geometry metric, the
     position of its first value in the full build's order (run time, then
     file path, then position in the file), so the columns come out in the
     order the full build's grouping gives them;

   a record built under other groups, catalogue or common sets than the ones
   now in force is rebuilt too (a rerun that adds a task to one model can
   change every row's mean: that refresh reads those rows' folders);
4. assembles the table from the records (sorted rows, integer columns as
   `integer_columns` makes them) and writes it as pandas writes it
   (`_write_csv`).

What a refresh reads is the summary, the changed folders' shards and files,
and nothing per unchanged run; what it computes per unchanged row is a
cell copy. A run that replaces an earlier run of the same model and task is
in the same run folder (lm-eval writes a model's runs into one), so its
row is rebuilt from all of its runs and the newest wins as in the full build.

Fallback: a geometry file without its results file whose model has no
results in the folder (its boundary row would enter the common sets without
a leaderboard row) makes the refresh build the whole table as the report
does, and keep no records.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd

from lm_coupling.catalogue import CONFIG_KEY, INSTALLED, Catalogue
from lm_coupling.report.benchmarks import BENCHMARKS
from lm_coupling.report.index import (
    GEOMETRY,
    LEGACY_INDEX,
    SUMMARY_NAME,
    FolderReader,
    file_kind,
    folder_digest,
    index_dir,
    path_key,
    read_checked,
    remove_shards,
    scan_folder,
    write_checked,
)
from lm_coupling.report.leaderboard import (
    INTEGER_COLUMNS,
    _first_filter,
    benchmark_scores,
    build_leaderboard,
    geometry_rows,
    row_columns,
    settings_messages,
    warn_settings,
)
from lm_coupling.report.loading import (
    IDENTITY,
    VALUE_COLUMNS,
    ReportWarning,
    _catalogue,
    _parse_geometry,
    _run_values,
    _shapes,
    display_names,
    load_results,
    parse_results_file,
)
from lm_coupling.report.newest import OTHER_SETTING, newest_values, setting_conflicts
from lm_coupling.report.row_identity import model_signature, separate_models
from lm_coupling.report.row_settings import ROW_SETTING_COLUMNS, cross_row_messages, mixed_messages
from lm_coupling.report.tasksets import geometry_table

_BASE = [*IDENTITY, "step", "n_params", "n_layers", "d_model"]
_BENCH = {b.column for b in BENCHMARKS}


def _filled(column: str) -> bool:
    """Whether a column is in the table only when some row has a value in it."""
    return column in _BENCH or column.startswith("score:")


@dataclass
class RefreshStats:
    """What one refresh did (the tests count it).

    Attributes:
        folders_read: run folders whose shard was opened.
        parsed: files parsed from disk (the rest were answered from the index).
        rows_built: leaderboard rows built (the rest were copied from their records).
        full: whether the whole table was built (the fallback of the module docstring).
    """

    folders_read: int = 0
    parsed: int = 0
    rows_built: int = 0
    full: bool = False
    built: list[tuple[str, str, str]] = field(default_factory=list)


def write_leaderboard(results_dir: str | Path) -> Path:
    """Refresh ``results_dir/leaderboard.csv`` (see the module docstring).

    The same table as the report's ``leaderboard.csv``, without the
    statistics and figures: the run command refreshes it after every run.

    Raises:
        ReportInputError: the folder does not exist or holds no readable results file.
    """
    return refresh(results_dir)[0]


def refresh(results_dir: str | Path) -> tuple[Path, RefreshStats]:
    """`write_leaderboard`, with what it did (`RefreshStats`)."""
    root = Path(results_dir)
    stats = RefreshStats()
    if not root.is_dir():
        load_results(root)  # raises the loader's error
    (root / LEGACY_INDEX).unlink(missing_ok=True)
    reader = FolderReader(root)
    summary = read_checked(index_dir(root) / SUMMARY_NAME) or {}
    before = summary.get("folders") if isinstance(summary.get("folders"), dict) else {}
    catalogues = dict(summary.get("catalogues") or {})
    folders: dict[str, dict[str, Any]] = {}
    for folder, files in scan_folder(root).items():
        digest = folder_digest(files)
        known = before.get(folder)
        if (
            isinstance(known, dict)
            and known.get("digest") == digest
            and _complete(known, catalogues)
        ):
            folders[folder] = known
        else:
            folders[folder] = _describe(root, folder, files, reader, catalogues) | {
                "digest": digest
            }
    with warnings.catch_warnings(record=True) as said:  # said below, unless built whole
        warnings.simplefilter("always")
        state = _State(root, reader, folders, catalogues, UnitSets(summary.get("unitsets")))
    stored = summary.get("records") if isinstance(summary.get("records"), dict) else {}
    packer = Packer(summary.get("shared"))
    records: dict[str, dict[str, Any]] = {}
    try:
        if not state.runs or state.ghosts:
            raise _WholeTable  # the loader says what it says while building the whole table
        for warning in said:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
        try:
            records = {key: packer.unpack(record) for key, record in stored.items()}
            board, messages = state.table(records, stats)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError):
            if not stored:
                raise
            records = {}
            board, messages = state.table({}, stats)  # records of another form: rebuilt
    except _WholeTable:
        used = {key: catalogues[key] for key in state.catalogue_keys if key in catalogues}
        return _full(root, reader, {"folders": folders, "catalogues": used}, stats), stats
    path = root / "leaderboard.csv"
    _write_csv(path, *board)
    warn_settings(messages)
    reader.save()
    if set(before) - set(folders):
        remove_shards(root, set(folders))
    used = {key: catalogues[key] for key in state.catalogue_keys if key in catalogues}
    packed = {
        key: stored[key] if records.get(key) is record else packer.pack(record)
        for key, record in state.records.items()
    }
    new = {
        "folders": folders,
        "catalogues": used,
        "unitsets": state.sets.to_store(state.records),
        "shared": packer.to_store(packed),
        "records": packed,
    }
    if new != summary:
        write_checked(index_dir(root) / SUMMARY_NAME, new)
    stats.folders_read, stats.parsed = len(reader.shards), reader.parsed
    return path, stats


class _WholeTable(Exception):
    """The refresh builds the whole table (the fallback of the module docstring)."""


def _complete(info: dict[str, Any], catalogues: dict[str, Any]) -> bool:
    """Whether a folder's stored description names only catalogues the summary holds."""
    keys = {run.get("catalogue") for run in info.get("runs", {}).values()}
    return all(key in ("installed", "none") or key in catalogues for key in keys)


def _full(root: Path, reader: FolderReader, summary: dict, stats: RefreshStats) -> Path:
    """The whole table, built as the report builds it (through the index's shards)."""
    stats.full = True
    loaded = load_results(root, index=reader)
    selected, provenance = newest_values(loaded.values, loaded.paths)
    board, _ = build_leaderboard(
        selected,
        loaded.shapes,
        benchmark_scores(selected),
        loaded.geometry,
        loaded.by_results,
        loaded.runs,
        loaded.catalogue,
    )
    reader.save()
    write_checked(index_dir(root) / SUMMARY_NAME, {**summary, "records": {}})
    warn_settings(settings_messages(board, provenance, selected))
    path = root / "leaderboard.csv"
    board.to_csv(path, index=False)
    stats.folders_read, stats.parsed = len(reader.shards), reader.parsed
    stats.rows_built = len(board)
    return path


def _path(root: Path, folder: str, name: str) -> Path:
    return root / name if folder == "." else root / folder / name


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _describe(
    root: Path,
    folder: str,
    files: list[tuple[str, int, int]],
    reader: FolderReader,
    catalogues: dict[str, Any],
) -> dict[str, Any]:
    """What the refresh needs of a run folder's files without reading them again.

    Per results file: its identity as recorded, time, model signature and
    catalogue (stored once per distinct catalogue in ``catalogues``); per
    geometry file without a results file beside it, its model as recorded;
    per file the loader skips, the reason.
    """
    shard = reader.shard(folder)
    runs, orphans, broken = {}, {}, {}
    by_file = {}
    for name, _, _ in files:
        path = _path(root, folder, name)
        if name.startswith("results_"):
            try:
                run = parse_results_file(path, shard)
            except ValueError as exc:
                broken[name] = str(exc)
                continue
            by_file[path] = reader.runs[path] = run
            runs[name] = dict(
                identity=list(run.identity),
                ts=run.timestamp,
                sig=model_signature(run),
                catalogue=_catalogue_key(shard.entries[name]["content"], run, catalogues),
            )
    for name, _, _ in files:
        path = _path(root, folder, name)
        if name.startswith("geometry_"):
            try:
                geo = _parse_geometry(path, by_file, {}, shard)
            except (OSError, ValueError, AttributeError) as exc:
                broken[name] = str(exc)
                continue
            if not geo["results_file"]:
                orphans[name] = list(geo["identity"])
    return {"runs": runs, "orphans": orphans, "broken": broken}


def _catalogue_key(content: dict[str, Any], run: Any, catalogues: dict[str, Any]) -> str:
    """The key of a run's recorded catalogue in ``catalogues`` (added there), or its source."""
    lmc = (content.get("config") or {}).get("lm_coupling") or {}
    data = lmc.get(CONFIG_KEY) if isinstance(lmc, dict) else None
    if data is None:
        return "installed" if run.catalogue.source == INSTALLED else "none"
    order = lmc.get("metrics") if isinstance(lmc.get("metrics"), list) else []
    key = "c" + _digest([data, order])
    catalogues.setdefault(key, {"data": data, "order": order})
    return key


class _State:
    """The folder as the summary describes it: runs, identities, catalogue, and the rows."""

    def __init__(
        self, root: Path, reader: FolderReader, folders: dict, catalogues: dict, sets: UnitSets
    ):
        self.root, self.reader, self.folders, self.sets = root, reader, folders, sets
        self.records: dict[str, dict[str, Any]] = {}
        self.catalogue_keys: set[str] = set()
        self.runs = self._runs(catalogues)
        self.ghosts = False
        if not self.runs:
            return  # the full build says why (`load_results`)
        self._warn_skipped()
        separate_models(self.runs)
        names = display_names([run.identity[0] for run in self.runs])
        self.names = names
        self.paths = {short: full for full, short in names.items()}
        self.identity_of: dict[str, tuple[str, str, str]] = {}
        self.folders_of: dict[tuple, set[str]] = {}
        self.in_folder: dict[str, set[tuple]] = {}
        for run in self.runs:
            run.identity = (names[run.identity[0]], *run.identity[1:])
            self.identity_of[str(run.path)] = run.identity
            self._link(run.identity, run.folder)
        self.catalogue, _ = _catalogue(self.runs)
        for folder, info in folders.items():
            for raw in info["orphans"].values():
                identity = (names.get(raw[0], raw[0]), raw[1], raw[2])
                if identity not in self.folders_of:
                    self.ghosts = True
                self._link(identity, folder)

    def _link(self, identity: tuple, folder: str) -> None:
        self.folders_of.setdefault(identity, set()).add(folder)
        self.in_folder.setdefault(folder, set()).add(identity)

    def _warn_skipped(self) -> None:
        for kind in ("results_", "geometry_"):
            skipped = [
                (path_key(_path(self.root, folder, name)), _path(self.root, folder, name), why)
                for folder, info in self.folders.items()
                for name, why in info["broken"].items()
                if name.startswith(kind)
            ]
            for _, path, why in sorted(skipped, key=lambda item: item[0]):
                warnings.warn(f"lm-coupling report skipped {path}: {why}", ReportWarning, 4)

    def _runs(self, catalogues: dict) -> list[SimpleNamespace]:
        """Every run as the summary describes it (``path``: the file's path as text)."""
        base = str(self.root)
        made: dict[str, Catalogue] = {}
        runs = []
        for folder, info in self.folders.items():
            for name, run in info["runs"].items():
                key = run["catalogue"]
                if key not in made:
                    made[key] = _catalogue_of(key, catalogues)
                self.catalogue_keys.add(key)
                sig = run["sig"]
                runs.append(
                    SimpleNamespace(
                        path=f"{base}/{name}" if folder == "." else f"{base}/{folder}/{name}",
                        folder=folder,
                        identity=tuple(run["identity"]),
                        timestamp=run["ts"],
                        shape={k: sig[k] for k in ("n_params", "n_layers") if k in sig},
                        weights=sig.get("weights", ""),
                        catalogue=made[key],
                    )
                )
        return sorted(runs, key=lambda run: path_key(run.path))

    # -- the table ------------------------------------------------------------------
    def table(
        self, stored: dict, stats: RefreshStats
    ) -> tuple[tuple[list[str], dict[str, list]], list[str]]:
        """The leaderboard (columns, cells by column) and its settings messages."""
        identities = sorted(i for i in self.folders_of)
        local = {i: self._local(i) for i in identities}
        valid = {
            i: stored[_key(i)]
            for i in identities
            if isinstance(stored.get(_key(i)), dict) and stored[_key(i)].get("local") == local[i]
        }
        loaded = self._load(self._closure(set(identities) - set(valid)))
        groups_of = {i: (set(r["A"]), set(r["B"])) for i, r in valid.items()}
        for part in loaded:
            groups_of.update(part.groups)
        every_a = set().union(*(a for a, _ in groups_of.values()))
        every_b = set().union(*(b for _, b in groups_of.values()))
        groups = every_a & every_b
        context = _digest(
            [sorted(groups), sorted(self.catalogue.sampled_metrics()),
             list(self.catalogue.boundary_profiles())]
        )  # fmt: skip
        stale = {i for i, r in valid.items() if r.get("context") != context}
        built = {i for part in loaded for i in part.identities}
        loaded += self._load(self._closure(stale) - built)
        records = {i: r for i, r in valid.items() if i not in stale}
        for part in loaded:
            records.update(part.records(groups, self.catalogue, local, context))
        common, with_k = _common_sets(records.values(), self.sets)
        signature = _geo_signatures(records, common, with_k)
        built = {i for part in loaded for i in part.identities}
        stale = {i for i in records if i not in built and records[i].get("geo_sig") != signature[i]}
        more = self._load(self._closure(stale) - built)
        for part in more:
            records.update(part.records(groups, self.catalogue, local, context))
        loaded += more
        for part in loaded:
            for identity, cells in part.geometry_cells(common, with_k).items():
                records[identity]["geo"] = cells
                records[identity]["geo_sig"] = signature[identity]
        if any(i not in records for i in identities):
            raise _WholeTable  # a model with runs but no values (see the module docstring)
        stats.built = sorted(i for part in loaded for i in part.identities)
        stats.rows_built = len(stats.built)
        self.records = {_key(i): records[i] for i in identities}
        board = _assemble([records[i] for i in identities], with_k, self.sets)
        messages = [m for i in identities for m in records[i]["conflicts"]]
        mixed = [(i, records[i]["base"].get("mixed_settings")) for i in identities]
        mixed = [(i, text) for i, text in mixed if isinstance(text, str) and text]
        if mixed:
            index = pd.MultiIndex.from_tuples([i for i, _ in mixed], names=IDENTITY)
            table = pd.DataFrame({"mixed_settings": [t for _, t in mixed]}, index=index)
            messages += mixed_messages(table)
        messages += _cross_row([records[i] for i in identities])
        return board, messages

    def _local(self, identity: tuple) -> list:
        """What a row is built from, by itself: its name and its run folders' digests."""
        folders = sorted(self.folders_of[identity])
        return [list(identity), [[f, self.folders[f]["digest"]] for f in folders]]

    def _closure(self, identities: set[tuple]) -> set[tuple]:
        """The identities sharing run folders with ``identities`` (built together)."""
        todo, seen, folders = list(identities), set(identities), set()
        while todo:
            for folder in self.folders_of[todo.pop()]:
                if folder in folders:
                    continue
                folders.add(folder)
                for other in self.in_folder[folder] - seen:
                    seen.add(other)
                    todo.append(other)
        return seen

    def _load(self, identities: set[tuple]) -> list[_Rows]:
        """The runs and geometry files of ``identities``, read as `load_results` reads them."""
        if not identities:
            return []
        folders = set().union(*(self.folders_of[i] for i in identities))
        results, geometry = [], []
        for folder in folders:
            info = self.folders[folder]
            results += [_path(self.root, folder, name) for name in info["runs"]]
            names = [name for name in self._geometry_names(folder) if name not in info["broken"]]
            geometry += [_path(self.root, folder, name) for name in names]
        runs = []
        for path in sorted(results, key=path_key):
            run = self.reader.runs.pop(path, None) or parse_results_file(path, self.reader)
            run.identity = self.identity_of[str(path)]
            runs.append(run)
        by_file = {run.path: run for run in runs}
        newest: dict[tuple, dict[str, Any]] = {}
        by_results: dict[tuple[str, str], dict[str, Any]] = {}
        for path in sorted(geometry, key=path_key):
            geo = _parse_geometry(path, by_file, self.names, self.reader)
            key = (geo["identity"], geo.get("task"))
            if key not in newest or geo["timestamp"] > newest[key]["timestamp"]:
                newest[key] = geo
            if geo["results_file"]:
                by_results[(geo["results_file"], str(geo.get("task")))] = geo
        rows = [row for run in runs for row in _run_values(run)]
        values = pd.DataFrame(rows, columns=VALUE_COLUMNS)
        values["_pos"] = values.groupby("file", sort=False).cumcount()
        documents = list(newest.values())
        return [_Rows(self.root, runs, values, documents, by_results, self.paths, self.sets)]

    def _geometry_names(self, folder: str) -> list[str]:
        """The geometry files of one run folder (listed again: the summary keeps no names)."""
        directory = self.root if folder == "." else self.root / folder
        return [p.name for p in directory.iterdir() if file_kind(p.name) == GEOMETRY]


def _catalogue_of(key: str, catalogues: dict) -> Catalogue:
    if key == "installed":
        return Catalogue.installed()
    if key == "none" or key not in catalogues:
        return Catalogue(source="none")
    stored = catalogues[key]
    return Catalogue.from_json(stored["data"], order=stored["order"])


def _key(identity: tuple) -> str:
    return json.dumps(list(identity))


class UnitSets:
    """The sets of units the records name (each stored once in the summary, by digest)."""

    def __init__(self, stored: Any):
        stored = stored if isinstance(stored, dict) else {}
        self.sets = {key: frozenset(units) for key, units in stored.items()}
        self.used: set[str] = set()

    def key(self, units: set[str]) -> str:
        """The key of a set (added when new)."""
        ordered = sorted(units)
        key = _digest(ordered)
        self.sets.setdefault(key, frozenset(ordered))
        return key

    def get(self, key: str) -> frozenset[str]:
        """The set of a key; a key the summary lacks makes the summary untrusted."""
        if key not in self.sets:
            raise _WholeTable
        return self.sets[key]

    def to_store(self, records: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
        """The sets the records name."""
        used = set()
        for record in records.values():
            used.update(record["units"].values())
            used.update(c["units"] for c in record["geo"].values() if isinstance(c, dict))
        return {key: sorted(self.sets[key]) for key in sorted(used)}


def _distinct(rows: pd.DataFrame, by: list[str], columns: list[str]) -> list[tuple]:
    """The identity and ``columns`` of the first row of each distinct (identity, ``by``)."""
    keep = rows.drop_duplicates([*IDENTITY, *by])
    return list(keep[[*IDENTITY, *columns]].itertuples(index=False, name=None))


class Packer:
    """Records as the summary stores them: what rows share, stored once (by digest).

    A record's task groups, task settings, unit sets and the like, its cells'
    column names and its long texts (the settings column) are the same on
    most rows of a campaign: each is stored once in the summary's ``shared``
    table and named by its digest in the records.
    """

    FIELDS = ("A", "B", "tasks", "units", "k", "filled", "conflicts")
    LONG = 24

    def __init__(self, stored: Any):
        self.shared: dict[str, Any] = stored if isinstance(stored, dict) else {}

    def _ref(self, value: Any) -> str:
        key = _digest(value)
        self.shared.setdefault(key, value)
        return key

    def pack(self, record: dict[str, Any]) -> dict[str, Any]:
        """A record as stored."""
        out = dict(record)
        for name in self.FIELDS:
            out[name] = self._ref(record[name])
        for part in ("base", "geo"):
            cells = record[part]
            values = [
                {"@": self._ref(v)} if isinstance(v, str) and len(v) > self.LONG else v
                for v in cells.values()
            ]
            out[part] = [self._ref(list(cells)), values]
        return out

    def unpack(self, stored: dict[str, Any]) -> dict[str, Any]:
        """A stored record as the refresh reads it (KeyError: a name the summary lacks)."""
        shared = self.shared
        out = dict(stored)
        for name in self.FIELDS:
            out[name] = shared[stored[name]]
        for part in ("base", "geo"):
            names, values = stored[part]
            values = [shared[v["@"]] if isinstance(v, dict) and "@" in v else v for v in values]
            out[part] = dict(zip(shared[names], values, strict=True))
        return out

    def to_store(self, packed: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The shared values the stored records name."""
        used = set()
        for record in packed.values():
            used.update(record[name] for name in self.FIELDS)
            for part in ("base", "geo"):
                names, values = record[part]
                used.add(names)
                used.update(v["@"] for v in values if isinstance(v, dict) and "@" in v)
        return {key: self.shared[key] for key in sorted(used)}


class _Rows:
    """Some identities' values, loaded, and the records built from them."""

    def __init__(self, root, runs, values, geometry, by_results, paths, sets):
        self.prefix, self.sets = len(str(root)) + 1, sets
        self.runs, self.geometry, self.by_results = runs, geometry, by_results
        self.selected, self.provenance = newest_values(values, paths)
        self.identities = set(self.selected[IDENTITY].itertuples(index=False, name=None))
        sel = self.selected
        self.groups = {i: (set(), set()) for i in self.identities}
        named = sel[sel["group"].notna() & (sel["group"] != "")]
        for *identity, group in _distinct(named, ["group"], ["group"]):
            self.groups[tuple(identity)][0].add(group)
        primary = sel[(sel["kind"] == "score") & sel["primary_score"].astype(bool)]
        for *identity, task in _distinct(primary, ["task"], ["task"]):
            self.groups[tuple(identity)][1].add(task)
        self.long = pd.DataFrame()

    def records(self, groups, catalogue, local, context) -> dict[tuple, dict[str, Any]]:
        """One record per identity, the geometry cells left for `geometry_cells`."""
        sel = self.selected
        shapes = _shapes(self.runs, self.geometry)
        base = row_columns(sel, shapes, benchmark_scores(sel), self.runs, groups)
        long = geometry_rows(sel, self.geometry, self.by_results, catalogue, groups)
        geo = _first_filter(sel[sel["kind"] == "geometry"], None)
        n_values = len(geo)
        files = list(dict.fromkeys(geo["file"]))
        number = {file: i for i, file in enumerate(files)}
        keys = [
            [0, ts, number[file], int(pos)]
            for ts, file, pos in zip(geo["timestamp"], geo["file"], geo["_pos"], strict=True)
        ]
        keys += [[1]] * (len(long) - n_values)
        long = long.assign(_key=keys)
        finite = np.isfinite(long["value"].astype(float))
        self.long = long[finite].drop(columns="_key")
        out: dict[tuple, dict[str, Any]] = {}
        for row in base.to_dict("records"):
            identity = tuple(row[k] for k in IDENTITY)
            out[identity] = dict(
                local=local[identity],
                context=context,
                A=sorted(self.groups[identity][0]),
                B=sorted(self.groups[identity][1]),
                base={k: _cell(v) for k, v in row.items()},
                filled=[k for k, v in row.items() if _filled(k) and not _missing(v)],
                units={},
                k=[],
                files=[],
                first={},
                tasks={},
                conflicts=[],
                geo={},
                geo_sig=None,
            )
        cell = [*IDENTITY, "metric"]
        long = long.assign(_row=np.arange(len(long)))
        ok = long[finite.to_numpy()]
        first_ok = {
            (*i, m): (row, key)
            for *i, m, row, key in _distinct(ok, ["metric"], ["metric", "_row", "_key"])
        }
        for *identity, metric, row, key in _distinct(long, ["metric"], ["metric", "_row", "_key"]):
            record = out[tuple(identity)]
            first = [self._key(key, files, record)]
            found = first_ok.get((*identity, metric))
            if found is None or found[0] != row:  # the metric's first value is not finite
                first.append(None if found is None else self._key(found[1], files, record))
            record["first"][metric] = first
        units: dict[tuple, set[str]] = {}
        for *identity, metric, unit in _distinct(ok, ["metric", "unit"], ["metric", "unit"]):
            units.setdefault((*identity, metric), set()).add(unit)
        for (*identity, metric), found in units.items():
            out[tuple(identity)]["units"][metric] = self.sets.key(found)
        with_k = ok[ok["k_used"].notna()].drop_duplicates(cell)
        for *identity, metric in with_k[cell].itertuples(index=False, name=None):
            out[tuple(identity)]["k"].append(metric)
        tasks = sel.drop_duplicates([*IDENTITY, "task"])
        for identity, task, setting in zip(
            tasks[IDENTITY].itertuples(index=False, name=None),
            tasks["task"],
            tasks["setting"],
            strict=True,
        ):
            out[identity]["tasks"][task] = setting
        for message, identity in _conflicts(self.provenance):
            out[identity]["conflicts"].append(message)
        return out

    def _key(self, key: list, files: list[str], record: dict) -> list:
        """A value's place in the full build's order, its file named in ``record["files"]``."""
        if key[0] == 1:
            return key
        name = files[key[2]][self.prefix :]
        if name not in record["files"]:
            record["files"].append(name)
        return [0, key[1], record["files"].index(name), key[3]]

    def geometry_cells(self, common, with_k) -> dict[tuple, dict[str, Any]]:
        """Each identity's geometry cells under the whole table's common sets."""
        out: dict[tuple, dict[str, Any]] = {i: {} for i in self.identities}
        if self.long.empty:
            return out
        wide, _ = geometry_table(self.long, common=common, with_k=with_k)
        for identity, row in zip(wide.index, wide.to_dict("records"), strict=True):
            cells = {k: _cell(v) for k, v in row.items() if not _missing(_cell(v))}
            for column, text in cells.items():  # the tasks of a value: a stored unit set
                if column.endswith("__tasks") and isinstance(text, str) and text:
                    cells[column] = {"units": self.sets.key(set(text.split(";")))}
            out[tuple(identity)] = cells
        return out


def _conflicts(provenance: pd.DataFrame) -> list[tuple[str, tuple]]:
    """`setting_conflicts` of each identity, with the identity."""
    if not (provenance["status"] == OTHER_SETTING).any():
        return []
    return [
        (message, tuple(identity))
        for identity, rows in provenance.groupby(IDENTITY, sort=True)
        for message in setting_conflicts(rows)
    ]


def _cell(value: Any) -> Any:
    """A table cell as JSON keeps it: missing as NaN, numpy scalars as Python's."""
    if value is None or value is pd.NA:
        return _NAN
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _common_sets(records, sets: UnitSets) -> tuple[dict[str, set[str]], set[str]]:
    """Per geometry metric, the units every row with the metric has; the metrics with a K.

    Rows measured on the same units (a campaign's usual case) are counted once.
    """
    distinct = {tuple(sorted(r["units"].items())) for r in records}
    common: dict[str, set[str]] = {}
    for pairs in distinct:
        for metric, key in pairs:
            units = sets.get(key)
            common[metric] = common[metric] & units if metric in common else set(units)
    with_k = set().union(*(r["k"] for r in records)) if records else set()
    return common, with_k


def _geo_signatures(records: dict, common: dict, with_k: set) -> dict[tuple, str]:
    """Per row, a digest of the common sets and K columns of its metrics (one per metric set)."""
    made: dict[tuple, str] = {}
    out = {}
    for identity, record in records.items():
        metrics = tuple(sorted(record["units"]))
        if metrics not in made:
            made[metrics] = _digest([[m, sorted(common[m]), m in with_k] for m in metrics])
        out[identity] = made[metrics]
    return out


def _order_key(key: list | None, record: dict) -> tuple | None:
    """A stored place in the full build's order (`_Rows._key`) as a comparable tuple."""
    if key is None or key[0] == 1:
        return None if key is None else (1,)
    return (0, key[1], path_key(record["files"][key[2]]), key[3])


def _geometry_order(records: list[dict]) -> list[str]:
    """The geometry metrics in the full build's column order (see the module docstring)."""
    first_any: dict[str, tuple] = {}
    first_ok: dict[str, tuple] = {}
    for record in records:
        for metric, first in record["first"].items():
            any_key = _order_key(first[0], record)
            ok_key = _order_key(first[-1], record)
            if metric not in first_any or any_key < first_any[metric]:
                first_any[metric] = any_key
            if ok_key is not None and (metric not in first_ok or ok_key < first_ok[metric]):
                first_ok[metric] = ok_key
    finite = sorted(first_ok, key=lambda m: first_ok[m])
    rest = sorted((m for m in first_any if m not in first_ok), key=lambda m: first_any[m])
    return finite + rest


def _assemble(
    records: list[dict], with_k: set[str], sets: UnitSets
) -> tuple[list[str], dict[str, list]]:
    """The leaderboard from its rows' records (columns in the full build's order)."""
    present = set().union(*(r["filled"] for r in records))
    bench = [b.column for b in BENCHMARKS if b.column in present]
    scores = sorted(c for c in present if c.startswith("score:"))
    geometry = []
    finite = {m for r in records for m in r["units"]}
    for metric in _geometry_order(records):
        geometry.append(metric)
        if metric in finite:
            geometry += [f"{metric}__tasks", f"{metric}__n"]
            if metric in with_k:
                geometry.append(f"{metric}__k_used")
    columns = [*_BASE, *bench, "n_benchmarks", "average", *scores, *geometry]
    columns += ROW_SETTING_COLUMNS
    data: dict[str, list] = {column: [] for column in columns}
    for record in records:
        cells = {**record["base"], **record["geo"]}
        for column, cell in record["geo"].items():
            if isinstance(cell, dict):
                cells[column] = ";".join(sorted(sets.get(cell["units"])))
        for column, values in data.items():
            values.append(cells.get(column, _NAN))
    return columns, data


def _write_csv(path: Path, columns: list[str], data: dict[str, list]) -> None:
    """The table as `pandas.DataFrame.to_csv` writes it after `integer_columns`.

    A count column (`INTEGER_COLUMNS`, ``<metric>__n``) whose values are all
    whole numbers is written as integers; a float as its shortest repr (what
    pandas writes for float64); a missing value as nothing; quoting as the
    csv module's minimal quoting (pandas writes through it). The tests compare
    the bytes with pandas' own.
    """
    texts = []
    for column in columns:
        values = data[column]
        if column in INTEGER_COLUMNS or column.endswith("__n"):
            numbers = [_number(v) for v in values]
            found = [v for v in numbers if not math.isnan(v)]
            if all(math.isfinite(v) and v % 1 == 0 for v in found):
                texts.append(["" if math.isnan(v) else str(round(v)) for v in numbers])
                continue
            values = numbers
        texts.append(
            [
                v if type(v) is str else ("" if v != v else repr(v)) if type(v) is float else str(v)
                for v in values
            ]
        )
    with open(path, "w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(zip(*texts, strict=True))


def _number(value: Any) -> float:
    """`pandas.to_numeric` with ``errors="coerce"`` of one cell."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            return float(value) if isinstance(value, str) and value.strip() else _NAN
        except ValueError:
            return _NAN
    return float(value)


_NAN = float("nan")


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _cross_row(records: list[dict]) -> list[str]:
    """`cross_row_messages` from the records' task settings (only tasks seen in two settings)."""
    seen: dict[str, set[str]] = {}
    for record in records:
        for task, setting in record["tasks"].items():
            seen.setdefault(task, set()).add(setting)
    mixed = {task for task, settings in seen.items() if len(settings) > 1}
    rows = [
        dict(model="", revision="", dtype=str(i), task=task, setting=setting)
        for i, record in enumerate(records)
        for task, setting in record["tasks"].items()
        if task in mixed
    ]
    return cross_row_messages(pd.DataFrame(rows)) if rows else []
