"""Settings never mix silently: shots, --limit and metric options (real runs and declared rows)."""

from __future__ import annotations

import argparse
import json
import shutil

import pandas as pd
import pytest
from make_results import EXTRA_TASK, TASK, model_rows, write_row

from lm_coupling.report import SettingsWarning, build_report, write_leaderboard
from lm_coupling.report.cli import add_report_arguments, run_report

# The session fixtures run the real lm_eval / lm-coupling command lines.
pytestmark = pytest.mark.slow
SCORE = f"score:{TASK}:acc_norm"
STAMP = "2024-03-01T00-00-00.000000"


def _results(folder, model):
    """(path, JSON) of each results file of ``model`` under ``folder``, oldest first."""
    paths = sorted(folder.rglob("results_*.json"))
    pairs = [(p, json.loads(p.read_text())) for p in paths]
    return sorted(
        [(p, d) for p, d in pairs if d["config"]["model_args"]["pretrained"].endswith(model)],
        key=lambda pair: pair[0].name,
    )


def test_a_rerun_in_another_setting_never_mixes_with_the_first(settings_runs, tmp_path):
    (full_path, full), (limited_path, limited) = _results(settings_runs, "tiny-a")
    assert full["n-shot"][TASK] == 0 and full["config"]["limit"] is None
    assert limited["n-shot"][TASK] == 2 and limited["config"]["limit"] == 4
    with pytest.warns(SettingsWarning) as record:
        result = build_report(settings_runs, out_dir=tmp_path / "report")
    messages = [str(w.message) for w in record]
    conflict = next(m for m in messages if "was run in different settings" in m)
    assert "2-shot, limit 4" in conflict and str(limited_path) in conflict
    assert "0-shot" in conflict and str(full_path) in conflict and "coupling_k100" in conflict
    assert any("different settings on different rows" in m for m in messages)
    board = result.leaderboard.set_index("model")
    row = board.loc["models/tiny-a"]
    # Score and geometry of one row come from one setting: the newer run's, without geometry.
    assert row[SCORE] == pytest.approx(limited["results"][TASK]["acc_norm,none"])
    assert pd.isna(row["coupling_k100"]) and pd.isna(row["lss"])
    assert row["settings"] == f"2-shot, limit 4: {TASK}" and row["limited"] == TASK
    other = board.loc["models/tiny-b"]
    assert other["settings"] == f"0-shot: {TASK}" and other["limited"] == ""
    prov = result.provenance.set_index("file")
    assert prov.loc[str(full_path), "status"] == "other setting"
    assert prov.loc[str(limited_path), "status"] == "used"
    # ARC-like task at 0 and 2 shots: not the Open LLM v1 setting (25-shot).
    assert "arc" not in board.columns and (board["n_benchmarks"] == 0).all()
    summary = result.summary.read_text()
    assert "## What each row was measured with" in summary
    assert "2-shot, limit 4" in summary
    assert f"outside the Open LLM v1 setting: {TASK} 0/2-shot on 2 row(s) (v1: 25-shot" in summary
    assert summary.index("was run in different settings") < summary.index("## Leaderboard")


def test_k_column_names_the_k_asked_and_gives_the_k_used(settings_runs, tmp_path):
    folder = tmp_path / "runs"
    for path, _ in _results(settings_runs, "tiny-a")[:1] + _results(settings_runs, "tiny-b"):
        target = folder / path.parent.name
        target.mkdir(parents=True, exist_ok=True)
        for item in path.parent.glob(f"*{path.stem.removeprefix('results_')}*"):
            shutil.copy(item, target / item.name)
    result = build_report(folder, out_dir=tmp_path / "report")  # one setting: no warning
    board = result.leaderboard.set_index("model")
    assert "coupling_k100" in board.columns
    assert board["coupling_k100__k_used"].astype(str).tolist() == ["31", "47"]  # d_model - 1
    assert board.loc["models/tiny-b", "metric_options"].count("k=47 (asked 100)") == 1
    summary = result.summary.read_text()
    assert "coupling_k100: K asked 100, used 31, 47" in summary


def test_leaderboard_refresh_warns_and_writes_integers(settings_runs, tmp_path):
    folder = tmp_path / "runs"
    shutil.copytree(settings_runs, folder)
    with pytest.warns(SettingsWarning) as record:
        path = write_leaderboard(folder)
    assert any("was run in different settings" in str(w.message) for w in record)
    board = pd.read_csv(path)
    assert board["n_layers"].tolist() == [2, 3] and board["n_layers"].dtype.kind == "i"
    header, *rows = path.read_text().splitlines()
    columns = header.split(",")
    assert {r.split(",")[columns.index("d_model")] for r in rows} == {"32", "48"}


def test_cli_prints_the_settings_warning(settings_runs, tmp_path, capsys):
    parser = add_report_arguments(argparse.ArgumentParser())
    args = parser.parse_args([str(settings_runs), "--out", str(tmp_path / "out")])
    assert run_report(args) == 0
    printed = capsys.readouterr()
    assert "was run in different settings" in printed.out + printed.err


def _declared(tmp_path, real_runs, shots_by_model):
    rows = model_rows(real_runs, len(shots_by_model))
    for i, (row, shots) in enumerate(zip(rows, shots_by_model, strict=True)):
        write_row(tmp_path, row["run"], dict(row, shots=shots), f"2024-03-0{i + 1}T00-00-00.000000")
    return rows


def test_open_llm_columns_only_from_their_setting(real_runs, tmp_path):
    _declared(tmp_path, real_runs, [{TASK: 25}, {TASK: 2}, {TASK: 25}])
    with pytest.warns(SettingsWarning, match="different settings on different rows"):
        result = build_report(tmp_path)
    board = result.leaderboard.set_index("model")
    assert board["arc"].notna().tolist() == [True, False, True]
    assert board[SCORE].notna().tolist() == [False, True, False]
    assert board["n_benchmarks"].tolist() == [1, 0, 1]
    sources = result.score_sources
    assert set(sources["benchmark"]) == {"arc"} and len(sources) == 2
    assert f"{TASK} 2-shot on 1 row(s) (v1: 25-shot, column 'arc')" in result.summary.read_text()


def test_a_row_that_combines_metric_options_says_so(real_runs, tmp_path):
    row = model_rows(real_runs, 1)[0]
    write_row(tmp_path / "a", row["run"], dict(row, options={"k": 4}), "2024-03-01T00-00-00.000000")
    other = dict(row, options={"k": 4, "norm": "l2"})
    second = write_row(tmp_path / "b", row["run"], other, "2024-03-02T00-00-00.000000")
    for path in list(second.iterdir()):  # the second run measured another task
        text = path.read_text().replace(TASK, "my_other_task")
        path.unlink()
        path.with_name(path.name.replace(TASK, "my_other_task")).write_text(text)
    json_path = next(second.glob("results_*.json"))
    data = json.loads(json_path.read_text())
    data["config"]["lm_coupling"]["options"]["norm"] = "l2"
    first = json.loads(next((tmp_path / "a").rglob("results_*.json")).read_text())
    first["config"]["lm_coupling"]["options"]["norm"] = "l1"
    next((tmp_path / "a").rglob("results_*.json")).write_text(json.dumps(first))
    json_path.write_text(json.dumps(data))
    with pytest.warns(SettingsWarning, match="combines runs with different metric options"):
        result = build_report(tmp_path)
    mixed = result.leaderboard.loc[0, "mixed_settings"]
    assert "coupling_k4: norm=l1/l2" in mixed and "lss: norm=l1/l2" in mixed
    assert "|" in result.leaderboard.loc[0, "metric_options"]  # two runs' options


def test_timings_table_and_summary(real_runs, tmp_path):
    rows = model_rows(real_runs, 2)
    timings = [
        dict(
            n_documents=24,
            seconds_per_document=dict(
                forward_capture=0.01, jacobian_products=0.5, factorisation=0.25, metrics=0.002
            ),
            per_layer=dict(jacobian_products=[0.2, 0.3], factorisation=[0.1, 0.15]),
        ),
        None,  # an older geometry file without the section: no row
    ]
    for i, (row, timing) in enumerate(zip(rows, timings, strict=True)):
        write_row(
            tmp_path, row["run"], dict(row, timings=timing), f"2024-03-0{i + 1}T00-00-00.000000"
        )
    result = build_report(tmp_path)
    table = pd.read_csv(result.out_dir / "timings.csv")
    assert list(table.columns) == [
        "model",
        "revision",
        "dtype",
        "task",
        "group",
        "seconds_per_document",
        "n_documents",
    ]
    assert set(table["model"]) == {"models/tiny-a"} and set(table["task"]) == {TASK}
    per_group = table.set_index("group")["seconds_per_document"].to_dict()
    assert per_group == timings[0]["seconds_per_document"]
    assert (table["n_documents"] == 24).all()
    summary = result.summary.read_text()
    assert "## Time spent on geometry" in summary
    # Jacobian work per sampled document (0.5 + 0.25 s) x coupling_docs is left for the user:
    # make_results records no coupling_docs, so no per-task figure is claimed.
    section = summary.split("## Time spent on geometry")[1]
    line = next(x for x in section.splitlines() if x.startswith("| models/tiny-a"))
    assert "| 0.01 | 0.5 | 0.25 | 0.002 |" in line


def test_timings_jacobian_total_and_counts_per_part(real_runs, tmp_path):
    row = model_rows(real_runs, 1)[0]
    timing = dict(
        n_documents=24,
        n_documents_per_part=dict(forward_capture=24, jacobian=4),
        seconds_per_document=dict(forward_capture=0.01, jacobian=3.0),
    )
    options = {"k": 4, "coupling_docs": 4}
    write_row(tmp_path, row["run"], dict(row, timings=timing, options=options), STAMP)
    result = build_report(tmp_path)
    counts = result.timings.set_index("group")["n_documents"].to_dict()
    assert counts == {"forward_capture": 24, "jacobian": 4}
    assert "12 s at coupling_docs=4" in result.summary.read_text()  # 3.0 s x 4 documents


def test_timings_per_task_cost_uses_coupling_docs(real_runs, tmp_path):
    row = model_rows(real_runs, 1)[0]
    timing = dict(
        n_documents=4, seconds_per_document=dict(jacobian_products=2.0, factorisation=1.0)
    )
    options = {"k": 4, "coupling_docs": 25}
    write_row(
        tmp_path,
        row["run"],
        dict(row, timings=timing, options=options),
        "2024-03-01T00-00-00.000000",
    )
    summary = build_report(tmp_path).summary.read_text()
    assert "75 s at coupling_docs=25" in summary  # (2.0 + 1.0) s x 25 documents


def test_extra_task_keeps_its_own_setting(real_runs, tmp_path):
    rows = model_rows(real_runs, 4)
    write_row(tmp_path, rows[3]["run"], rows[3], "2024-03-01T00-00-00.000000")
    board = build_report(tmp_path).leaderboard
    assert board.loc[0, "settings"] == f"10-shot: {EXTRA_TASK}; 25-shot: {TASK}"
    assert board.loc[0, "n_benchmarks"] == 2
