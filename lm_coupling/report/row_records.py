"""The records the leaderboard refresh keeps, one per row (`lm_coupling.report.refresh`).

A record holds a row's cells and what other rows depend on: its task groups
and primary-scored tasks (the scored groups), the units each geometry value
was measured on and whether a metric has a K (the common task sets), where
its first value of each geometry metric sits in the full build's order (the
column order), its tasks' settings and its settings messages. `Rows` builds
the records of some rows with the full build's functions; `Packer` and
`UnitSets` store them compactly in the index's summary (what rows share,
once, by digest); `assemble` and `write_csv` put the table together and
write it as pandas writes the full build's table.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lm_coupling.report.benchmarks import BENCHMARKS
from lm_coupling.report.index import path_key
from lm_coupling.report.leaderboard import (
    INTEGER_COLUMNS,
    _first_filter,
    benchmark_scores,
    geometry_rows,
    row_columns,
)
from lm_coupling.report.loading import IDENTITY, _shapes
from lm_coupling.report.newest import OTHER_SETTING, newest_values, setting_conflicts
from lm_coupling.report.row_settings import ROW_SETTING_COLUMNS, cross_row_messages
from lm_coupling.report.tasksets import geometry_table

_BASE = [*IDENTITY, "step", "n_params", "n_layers", "d_model"]
_BENCH = {b.column for b in BENCHMARKS}


def _filled(column: str) -> bool:
    """Whether a column is in the table only when some row has a value in it."""
    return column in _BENCH or column.startswith("score:")


class WholeTable(Exception):
    """The refresh builds the whole table (the fallback of the module docstring)."""


def digest(value: Any) -> str:
    """A short digest of a JSON value (keys sorted)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


class UnitSets:
    """The sets of units the records name (each stored once in the summary, by digest)."""

    def __init__(self, stored: Any):
        stored = stored if isinstance(stored, dict) else {}
        self.sets = {key: frozenset(units) for key, units in stored.items()}
        self.used: set[str] = set()

    def key(self, units: set[str]) -> str:
        """The key of a set (added when new)."""
        ordered = sorted(units)
        key = digest(ordered)
        self.sets.setdefault(key, frozenset(ordered))
        return key

    def get(self, key: str) -> frozenset[str]:
        """The set of a key; a key the summary lacks makes the summary untrusted."""
        if key not in self.sets:
            raise WholeTable
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
        key = digest(value)
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


class Rows:
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


def common_sets(records, sets: UnitSets) -> tuple[dict[str, set[str]], set[str]]:
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


def geo_signatures(records: dict, common: dict, with_k: set) -> dict[tuple, str]:
    """Per row, a digest of the common sets and K columns of its metrics (one per metric set)."""
    made: dict[tuple, str] = {}
    out = {}
    for identity, record in records.items():
        metrics = tuple(sorted(record["units"]))
        if metrics not in made:
            made[metrics] = digest([[m, sorted(common[m]), m in with_k] for m in metrics])
        out[identity] = made[metrics]
    return out


def _order_key(key: list | None, record: dict) -> tuple | None:
    """A stored place in the full build's order (`Rows._key`) as a comparable tuple."""
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


def assemble(
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


def write_csv(path: Path, columns: list[str], data: dict[str, list]) -> None:
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


def settings_across_rows(records: list[dict]) -> list[str]:
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
