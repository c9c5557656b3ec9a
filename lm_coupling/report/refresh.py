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
3. rebuilds the records (`lm_coupling.report.row_records`) of the rows whose
   run folders changed, with the
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
   now in force is rebuilt too (a new model without a task every other
   model has changes every row's mean: that refresh reads those rows'
   folders);
4. assembles the table from the records (sorted rows, integer columns as
   `integer_columns` makes them) and writes it as pandas writes it
   (`write_csv`).

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

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd

from lm_coupling.catalogue import CONFIG_KEY, INSTALLED, Catalogue
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
    benchmark_scores,
    build_leaderboard,
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
    display_names,
    keep_geometry,
    load_results,
    parse_results_file,
)
from lm_coupling.report.newest import newest_values
from lm_coupling.report.row_identity import model_signature, separate_models
from lm_coupling.report.row_records import (
    Packer,
    Rows,
    UnitSets,
    WholeTable,
    assemble,
    common_sets,
    digest,
    geo_signatures,
    settings_across_rows,
    write_csv,
)
from lm_coupling.report.row_settings import mixed_messages


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
            raise WholeTable  # the loader says what it says while building the whole table
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
    except WholeTable:
        used = {key: catalogues[key] for key in state.catalogue_keys if key in catalogues}
        return _full(root, reader, {"folders": folders, "catalogues": used}, stats), stats
    path = root / "leaderboard.csv"
    write_csv(path, *board)
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
    key = "c" + digest([data, order])
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
        context = digest(
            [sorted(groups), sorted(self.catalogue.sampled_metrics()),
             list(self.catalogue.boundary_profiles())]
        )  # fmt: skip
        stale = {i for i, r in valid.items() if r.get("context") != context}
        built = {i for part in loaded for i in part.identities}
        loaded += self._load(self._closure(stale) - built)
        records = {i: r for i, r in valid.items() if i not in stale}
        for part in loaded:
            records.update(part.records(groups, self.catalogue, local, context))
        common, with_k = common_sets(records.values(), self.sets)
        signature = geo_signatures(records, common, with_k)
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
            raise WholeTable  # a model with runs but no values (see the module docstring)
        stats.built = sorted(i for part in loaded for i in part.identities)
        stats.rows_built = len(stats.built)
        self.records = {_key(i): records[i] for i in identities}
        board = assemble([records[i] for i in identities], with_k, self.sets)
        messages = [m for i in identities for m in records[i]["conflicts"]]
        mixed = [(i, records[i]["base"].get("mixed_settings")) for i in identities]
        mixed = [(i, text) for i, text in mixed if isinstance(text, str) and text]
        if mixed:
            index = pd.MultiIndex.from_tuples([i for i, _ in mixed], names=IDENTITY)
            table = pd.DataFrame({"mixed_settings": [t for _, t in mixed]}, index=index)
            messages += mixed_messages(table)
        messages += settings_across_rows([records[i] for i in identities])
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

    def _load(self, identities: set[tuple]) -> list[Rows]:
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
            keep_geometry(geo, newest, by_results)
        rows = [row for run in runs for row in _run_values(run)]
        values = pd.DataFrame(rows, columns=VALUE_COLUMNS)
        values["_pos"] = values.groupby("file", sort=False).cumcount()
        documents = list(newest.values())
        return [Rows(self.root, runs, values, documents, by_results, self.paths, self.sets)]

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
