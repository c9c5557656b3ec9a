"""The folder index: a refresh parses only the files that changed, and reads the same table.

A results folder of real lm_eval runs with geometry (`make_results`) is
refreshed three times: with no index (every file parsed), with nothing changed
(none parsed), and after one more run (only its files). Each refresh's
leaderboard equals the one built from the files alone. Figure formats: PNG
alone by default, others on request, unknown ones refused.
"""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from make_results import make_results_dir

from lm_coupling.report.build import check_figure_formats
from lm_coupling.report.index import INDEX_NAME, FolderIndex
from lm_coupling.report.leaderboard import write_leaderboard
from lm_coupling.report.loading import ReportInputError, load_results


def _files(root) -> list:
    return sorted([*root.rglob("results_*.json"), *root.rglob("geometry_*.json")])


def _board_without_index(root, tmp_path):
    """The leaderboard as the report builds it, from the files themselves (no index)."""
    from lm_coupling.report.build import build_report

    board = build_report(root, out_dir=tmp_path / "report").leaderboard
    path = tmp_path / "board.csv"
    board.to_csv(path, index=False)
    return pd.read_csv(path)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_refresh_parses_only_what_changed(real_runs, tmp_path):
    root = make_results_dir(tmp_path / "results", real_runs, n_models=4)
    n_files = len(_files(root))

    first = FolderIndex(root)
    load_results(root, index=first)
    first.save()
    assert first.parsed == n_files and (root / INDEX_NAME).is_file()

    again = FolderIndex(root)
    load_results(root, index=again)
    assert again.parsed == 0

    # One more run: a copy of a row under another model name.
    source = sorted(p for p in root.iterdir() if p.is_dir())[0]
    new = root / "another__main"
    shutil.copytree(source, new)
    results = next(new.glob("results_*.json"))
    data = json.loads(results.read_text())
    data["config"]["model_args"]["pretrained"] += "-another"
    results.write_text(json.dumps(data))
    after = FolderIndex(root)
    loaded = load_results(root, index=after)
    after.save()
    assert after.parsed == len(list(new.glob("*.json")))
    assert len({run.identity for run in loaded.runs}) == 5

    board = pd.read_csv(write_leaderboard(root))
    pd.testing.assert_frame_equal(board, _board_without_index(root, tmp_path))

    # A vanished run leaves the index too; a corrupt index is rebuilt, not trusted.
    shutil.rmtree(new)
    (root / INDEX_NAME).write_text("{not json", encoding="utf-8")
    rebuilt = FolderIndex(root)
    load_results(root, index=rebuilt)
    rebuilt.save()
    assert rebuilt.parsed == n_files
    assert len(json.loads((root / INDEX_NAME).read_text())["files"]) == n_files


def test_figure_formats_default_to_png_and_refuse_unknown():
    assert check_figure_formats("png") == ("png",)
    assert check_figure_formats("PNG, svg,png") == ("png", "svg")
    with pytest.raises(ReportInputError, match="jpeg"):
        check_figure_formats("png,jpeg")
    with pytest.raises(ReportInputError):
        check_figure_formats("")


def _from_scratch(root) -> bytes:
    """``leaderboard.csv`` rebuilt with no index (every file parsed, every row built)."""
    index_path = root / INDEX_NAME
    kept = index_path.read_bytes() if index_path.exists() else None
    index_path.unlink(missing_ok=True)
    try:
        fresh = FolderIndex(root)
        data = write_leaderboard(root, index=fresh).read_bytes()
        rows = len(pd.read_csv(root / "leaderboard.csv"))
        assert list(fresh.rows.rebuilt.values()) == [rows, rows]  # settings, geometry
    finally:
        if kept is not None:
            index_path.write_bytes(kept)
    return data


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_incremental_refresh_rebuilds_one_row_and_writes_the_same_bytes(real_runs, tmp_path):
    source = make_results_dir(tmp_path / "source", real_runs, n_models=5)
    # Added in reverse name order, so each new row sorts before the rows already there.
    folders = sorted((p for p in source.iterdir() if p.is_dir()), reverse=True)
    root = tmp_path / "campaign"
    root.mkdir()
    for n, folder in enumerate(folders, start=1):
        shutil.copytree(folder, root / folder.name)
        index = FolderIndex(root)
        written = write_leaderboard(root, index=index).read_bytes()
        # The refresh's work does not grow with the folder: one row built per new run.
        assert list(index.rows.rebuilt.values()) == [1, 1], (n, index.rows.rebuilt)
        assert len(pd.read_csv(root / "leaderboard.csv")) == n
        assert written == _from_scratch(root)

    unchanged = FolderIndex(root)
    write_leaderboard(root, index=unchanged)
    assert unchanged.rows.rebuilt == {} and unchanged.parsed == 0

    # A results file rewritten in place (another metric option recorded) rebuilds its own
    # row only, and the row's settings columns follow the new file.
    results = sorted(root.rglob("results_*.json"))[0]
    data = json.loads(results.read_text())
    data["config"]["lm_coupling"]["options"]["norm"] = "l2"
    results.write_text(json.dumps(data))
    changed = FolderIndex(root)
    after = write_leaderboard(root, index=changed).read_bytes()
    assert list(changed.rows.rebuilt.values()) == [1, 1] and changed.parsed == 1
    assert after == _from_scratch(root)
    options = pd.read_csv(root / "leaderboard.csv")["metric_options"].fillna("")
    assert options.str.contains("norm=l2").sum() == 1

    # A geometry file rewritten in place (other document counts) rebuilds that row's
    # geometry part only.
    geometry = sorted(root.rglob("geometry_*.json"))[-1]
    data = json.loads(geometry.read_text())
    data["n_documents"] = int(data.get("n_documents") or 0) + 7
    data["n_measured"] = {key: 3 for key in data.get("n_measured") or {}}
    geometry.write_text(json.dumps(data))
    regeo = FolderIndex(root)
    written = write_leaderboard(root, index=regeo).read_bytes()
    assert list(regeo.rows.rebuilt) == [key for key in changed.rows.rebuilt if "geometry" in key]
    assert list(regeo.rows.rebuilt.values()) == [1] and written == _from_scratch(root) != after
    after = written

    # A vanished run: nothing is built, its row leaves the table and the stored rows.
    shutil.rmtree(root / folders[0].name)
    gone = FolderIndex(root)
    written = write_leaderboard(root, index=gone).read_bytes()
    assert gone.rows.rebuilt == {} and written == _from_scratch(root) != after
    stored = json.loads((root / INDEX_NAME).read_text())["rows"]["row_settings"]
    assert len(stored) == len(folders) - 1
