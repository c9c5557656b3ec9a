"""The leaderboard refresh: the same bytes as a full build, reading only what changed.

Folders of real lm_eval runs with geometry (`make_results`) are grown one
run folder at a time, rewritten, rerun and pruned; after every step the
refresh's ``leaderboard.csv`` is compared byte for byte with the table the
report builds from the files alone (`build_leaderboard`, no index), and the
refresh's own counts (rows built, folders and files read) are checked. A
damaged or stale index is detected and rebuilt. Files opened by a refresh
are counted with an audit hook: the same number at 3 and 6 models.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from make_results import EXTRA_TASK, TASK, make_results_dir

from lm_coupling.report.index import INDEX_DIR, LEGACY_INDEX, SUMMARY_NAME
from lm_coupling.report.leaderboard import benchmark_scores, build_leaderboard
from lm_coupling.report.loading import load_results
from lm_coupling.report.newest import newest_values
from lm_coupling.report.refresh import refresh

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _full(root: Path) -> bytes:
    """``leaderboard.csv`` as the report builds it from the files (no index)."""
    loaded = load_results(root)
    selected, _ = newest_values(loaded.values, loaded.paths)
    board, _ = build_leaderboard(
        selected,
        loaded.shapes,
        benchmark_scores(selected),
        loaded.geometry,
        loaded.by_results,
        loaded.runs,
        loaded.catalogue,
    )
    out = io.StringIO()
    board.to_csv(out, index=False)
    return out.getvalue().encode()


def _refreshed(root: Path):
    path, stats = refresh(root)
    assert path.read_bytes() == _full(root)
    return stats


def _tasks(folder: Path) -> set[str]:
    return set(json.loads(next(folder.glob("results_*.json")).read_text())["results"])


def _rerun(folder: Path, stamp: str, score: float, coupling: float) -> None:
    """A newer run of the same model and tasks: other scores and geometry."""
    results = json.loads(next(folder.glob("results_*.json")).read_text())
    for task, entry in results["results"].items():
        entry["acc_norm,none"] = score
        entry["coupling,none"] = coupling
        source = next(folder.glob(f"geometry_{task}_*.json"))
        geometry = json.loads(source.read_text())
        geometry["n_measured"] = {k: 3 for k in geometry["n_measured"]}
        (folder / f"geometry_{task}_{stamp}.json").write_text(json.dumps(geometry))
    (folder / f"results_{stamp}.json").write_text(json.dumps(results))


def test_incremental_refresh_writes_the_full_builds_bytes(real_runs, tmp_path):
    source = make_results_dir(tmp_path / "source", real_runs, n_models=6)
    # The clones (two tasks) first, then the real runs (one task), each group in reverse
    # name order: new rows sort before the rows already there, and the common task set
    # of the geometry columns shrinks when the first one-task model arrives.
    folders = sorted((p for p in source.iterdir() if p.is_dir()), reverse=True)
    folders.sort(key=lambda p: len(_tasks(p)), reverse=True)
    root = tmp_path / "campaign"
    root.mkdir()
    seen: list[set[str]] = []
    for n, folder in enumerate(folders, start=1):
        shutil.copytree(folder, root / folder.name)
        stats = _refreshed(root)
        common = set.intersection(*seen) if seen else set()
        if not seen or common <= _tasks(folder):  # nothing shared changed: one row built
            assert stats.rows_built == 1, (n, stats)
        else:  # the common task set shrank: every row's geometry means change
            assert stats.rows_built == n and not stats.full
        assert stats.folders_read == stats.rows_built
        assert stats.parsed == len(list(folder.glob("*.json")))
        seen.append(_tasks(folder))
    assert {TASK, EXTRA_TASK} in seen and {TASK} in seen
    board = pd.read_csv(root / "leaderboard.csv")
    assert len(board) == len(folders)

    unchanged = _refreshed(root)
    assert (unchanged.rows_built, unchanged.folders_read, unchanged.parsed) == (0, 0, 0)

    # A rerun of one model (newer files beside the old ones): newest wins, one row built.
    target = root / folders[0].name
    _rerun(target, "2025-03-01T10-00-00.000000", score=0.123, coupling=0.456)
    rerun = _refreshed(root)
    assert rerun.rows_built == 1 and rerun.folders_read == 1
    assert (pd.read_csv(root / "leaderboard.csv")["arc"] == 0.123).sum() == 1

    # The same model rerun in another setting (other shots): the newest setting wins.
    results = json.loads(next(target.glob("results_2025-03*")).read_text())
    results["n-shot"][TASK] = 3
    results["configs"][TASK]["num_fewshot"] = 3
    (target / "results_2025-04-01T10-00-00.000000.json").write_text(json.dumps(results))
    assert _refreshed(root).rows_built == 1

    # Files rewritten in place: a results file (another metric option), a geometry file.
    first = sorted(root.rglob("results_*.json"))[0]
    data = json.loads(first.read_text())
    data["config"]["lm_coupling"]["options"]["norm"] = "l2"
    first.write_text(json.dumps(data))
    assert _refreshed(root).rows_built == 1
    geometry = sorted(root.rglob("geometry_*.json"))[-1]
    data = json.loads(geometry.read_text())
    data["n_documents"] = int(data.get("n_documents") or 0) + 7
    geometry.write_text(json.dumps(data))
    assert _refreshed(root).parsed == 1

    # A vanished run folder: its row, its shard and its record leave.
    shards = len(list((root / INDEX_DIR).glob("shard-*.json")))
    shutil.rmtree(root / folders[-1].name)
    gone = _refreshed(root)
    assert gone.folders_read == 0 and not gone.full
    assert len(list((root / INDEX_DIR).glob("shard-*.json"))) == shards - 1
    assert len(pd.read_csv(root / "leaderboard.csv")) == len(folders) - 1


def test_damaged_or_stale_index_is_rebuilt_not_trusted(real_runs, tmp_path):
    root = make_results_dir(tmp_path / "results", real_runs, n_models=4)
    (root / LEGACY_INDEX).write_text("{}")  # the single-file index of earlier releases
    n_rows = _refreshed(root).rows_built
    assert n_rows == 4 and not (root / LEGACY_INDEX).exists()
    summary = root / INDEX_DIR / SUMMARY_NAME
    header, body = summary.read_text().split("\n", 1)

    summary.write_text(header + "\n" + body[: len(body) // 2])  # truncated
    assert _refreshed(root).rows_built == n_rows

    # Valid JSON, one cell changed: the checksum no longer matches.
    data = json.loads(body)
    record = next(iter(data["records"].values()))
    names, values = record["base"]
    values[data["shared"][names].index("n_layers")] = 1000.0
    summary.write_text(header + "\n" + json.dumps(data, separators=(",", ":")))
    assert _refreshed(root).rows_built == n_rows
    assert 1000 not in set(pd.read_csv(root / "leaderboard.csv")["n_layers"])

    # Written by another version of lm-coupling: not read.
    head = json.loads(summary.read_text().split("\n", 1)[0])
    text = summary.read_text().split("\n", 1)[1]
    summary.write_text(json.dumps(dict(head, version="0.0.0")) + "\n" + text)
    assert _refreshed(root).rows_built == n_rows

    # A damaged shard: its folder's files are parsed again when that folder changes.
    folder = sorted(p for p in root.iterdir() if p.is_dir() and p.name != INDEX_DIR)[0]
    for shard in (root / INDEX_DIR).glob("shard-*.json"):
        shard.write_text("garbage")
    results = next(folder.glob("results_*.json"))
    results.write_text(results.read_text() + " ")
    damaged = _refreshed(root)
    assert damaged.parsed == len(list(folder.glob("*.json"))) and damaged.rows_built == 1

    # A stale summary (an older copy put back after a run was added) is caught.
    old = summary.read_bytes()
    extra = root / "extra__main"
    shutil.copytree(folder, extra)
    added = next(extra.glob("results_*.json"))
    data = json.loads(added.read_text())
    data["config"]["model_args"]["pretrained"] += "-extra"
    added.write_text(json.dumps(data))
    assert _refreshed(root).rows_built == 1
    summary.write_bytes(old)
    assert _refreshed(root).rows_built == 1  # the new folder is not in the old summary
    assert len(pd.read_csv(root / "leaderboard.csv")) == 5


def _opened_during(root: Path, call) -> list[str]:
    """Files under ``root`` that ``call`` opens (audit events, Python 3.8+)."""
    opened: list[str] = []
    active = [False]
    prefix = str(root)

    def hook(event, args):
        if active[0] and event == "open" and isinstance(args[0], str | Path):
            path = str(args[0])
            if path.startswith(prefix):
                opened.append(path[len(prefix) + 1 :])

    sys.addaudithook(hook)  # cannot be removed: it records only while active
    active[0] = True
    try:
        call()
    finally:
        active[0] = False
    return opened


def _grown(source: Path, root: Path, n: int) -> Path:
    """``n`` run folders: copies of ``source``'s under other model names."""
    base = sorted(p for p in source.iterdir() if p.is_dir())[-1]
    for i in range(n):
        folder = root / f"m{i:03d}__main"
        shutil.copytree(base, folder)
        path = next(folder.glob("results_*.json"))
        data = json.loads(path.read_text())
        data["config"]["model_args"]["pretrained"] += f"-m{i:03d}"
        path.write_text(json.dumps(data))
    return root


def test_refresh_after_one_more_run_opens_the_same_files_at_any_size(real_runs, tmp_path):
    source = make_results_dir(tmp_path / "source", real_runs, n_models=4)
    counts = {}
    for n in (3, 6):
        root = _grown(source, tmp_path / f"folder{n}", n + 1)
        last = root / f"m{n:03d}__main"
        moved = tmp_path / f"held{n}"
        shutil.move(last, moved)
        refresh(root)  # the index is warm
        shutil.move(moved, last)
        opened = _opened_during(root, lambda r=root: refresh(r))
        assert _full(root) == (root / "leaderboard.csv").read_bytes()
        folders = {Path(p).parts[0] for p in opened}
        assert folders <= {INDEX_DIR, last.name, "leaderboard.csv"}, opened
        new_files = [p for p in opened if Path(p).parts[0] == last.name]
        assert sorted(set(new_files)) == sorted(
            f"{last.name}/{f.name}" for f in last.glob("*.json")
        )
        counts[n] = len(opened)
        # The bytes read: the summary, the new folder's shard and files, not the rest.
        shards = [p for p in opened if "shard-" in p]
        assert len(set(shards)) <= 2, shards  # the new folder's shard (read, then written)
    assert counts[3] == counts[6], counts


def test_refresh_of_runs_without_geometry_and_of_a_broken_file(real_runs, tmp_path):
    root = make_results_dir(tmp_path / "results", real_runs, n_models=3, geometry=None)
    assert _refreshed(root).rows_built == 3
    board = pd.read_csv(root / "leaderboard.csv")
    assert len(board) == 3 and not any(c.startswith("coupling") for c in board.columns)
    broken = root / "broken__main"
    broken.mkdir()
    (broken / "results_2025-05-01T00-00-00.json").write_text("{not json")
    with pytest.warns(UserWarning, match="skipped"):
        stats = _refreshed(root)
    assert stats.rows_built == 0 and len(pd.read_csv(root / "leaderboard.csv")) == 3
    with pytest.warns(UserWarning, match="skipped"):  # said again on every refresh
        assert _refreshed(root).parsed == 0


def _variant(folder: Path, dest: Path, name: str, stamp: str, drop: str | None, nan: list[str]):
    """A copy of a run folder as another model at another time: a task dropped, the
    metric keys in reverse order, the metrics ``nan`` not a number on every task."""
    dest.mkdir()
    results = json.loads(next(folder.glob("results_*.json")).read_text())
    results["config"]["model_args"]["pretrained"] += f"-{name}"
    if drop:
        del results["results"][drop]
    for task, entry in results["results"].items():
        for metric in nan:
            entry[f"{metric},none"] = float("nan")
        results["results"][task] = dict(reversed(list(entry.items())))
        geometry = next(folder.glob(f"geometry_{task}_*.json")).read_text()
        (dest / f"geometry_{task}_{stamp}.json").write_text(geometry)
    (dest / f"results_{stamp}.json").write_text(json.dumps(results))


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0)])
def test_mixed_task_sets_nan_metrics_and_column_order_match_the_full_build(
    real_runs, tmp_path, order
):
    source = make_results_dir(tmp_path / "source", real_runs, n_models=4)
    clone = next(p for p in sorted(source.iterdir()) if len(_tasks(p)) == 2)
    metrics = json.loads(next(clone.glob("results_*.json")).read_text())["config"]
    metrics = metrics["lm_coupling"]["metrics"]
    everywhere, here = metrics[1], metrics[2]
    staged = tmp_path / "staged"
    staged.mkdir()
    # An ordinary model, then (earlier in time, metric keys reversed) one without the second
    # task, then one without the first: no task is common to all, the metrics are "mixed".
    _variant(clone, staged / "a__main", "a", "2025-02-01T10-00-00.000000", None, [everywhere])
    _variant(clone, staged / "b__main", "b", "2024-12-01T10-00-00.000000", EXTRA_TASK,
             [everywhere, here])  # fmt: skip
    _variant(clone, staged / "c__main", "c", "2025-03-01T10-00-00.000000", TASK, [everywhere])
    root = tmp_path / "root"
    root.mkdir()
    names = ["a__main", "b__main", "c__main"]
    for i in order:
        shutil.move(staged / names[i], root / names[i])
        _refreshed(root)
    board = pd.read_csv(root / "leaderboard.csv")
    assert board[everywhere].isna().all() and f"{everywhere}__tasks" not in board
    assert board[here].isna().sum() == 1
    tasks = board[next(c for c in board.columns if c.endswith("__tasks"))].fillna("")
    assert set(tasks) == {f"{TASK};{EXTRA_TASK}", TASK, EXTRA_TASK}  # each its own units


def test_geometry_files_without_their_results_file(real_runs, tmp_path):
    root = make_results_dir(tmp_path / "results", real_runs, n_models=4)
    assert not _refreshed(root).full
    # A newer geometry file of a model that has results (its run's results file lost):
    # it is that model's newest geometry for the task, and the row is built with it.
    folder = sorted(p for p in root.iterdir() if p.is_dir() and p.name != INDEX_DIR)[0]
    source = next(folder.glob(f"geometry_{TASK}_*.json"))
    data = json.loads(source.read_text())
    data["n_documents"] = 5
    (folder / f"geometry_{TASK}_2026-01-01T00-00-00.000000.json").write_text(json.dumps(data))
    attached = _refreshed(root)
    assert not attached.full and attached.rows_built == 1
    # One of a model with no results in the folder: the whole table is built.
    ghost = root / "ghost__main"
    ghost.mkdir()
    data["model"] = dict(data["model"], name="/nowhere/ghost")
    (ghost / f"geometry_{TASK}_2026-01-02T00-00-00.000000.json").write_text(json.dumps(data))
    assert _refreshed(root).full
    shutil.rmtree(ghost)
    again = _refreshed(root)
    assert not again.full and again.rows_built == 4  # the records were not kept
