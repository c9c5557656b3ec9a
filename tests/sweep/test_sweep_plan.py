"""Resume planning: which (model, task) a rerun skips, from the files in the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_coupling.sweep.plan import entry_identity, plan_sweep
from lm_coupling.sweep.spec import ModelEntry, parse_models
from lm_coupling.sweep.status import STATUS_DIR, ModelStatus, read_records, record

TS = "2026-01-02T03-04-05.678901"
METRICS = ["coupling", "lss"]


def write_run(out: Path, model_args: str, tasks: dict, metrics=METRICS, geometry=None) -> Path:
    """An lm-eval results file as the harness writes it, with geometry files for ``geometry``."""
    folder = out / model_args.split(",")[0].split("=")[1].replace("/", "__")
    folder.mkdir(parents=True, exist_ok=True)
    groups = {t: subs for t, subs in tasks.items() if subs}
    results = {t: {"acc,none": 0.5} for t, subs in tasks.items() for t in [t, *subs]}
    data = {
        "results": results,
        "group_subtasks": groups,
        "config": {"model_args": model_args, "lm_coupling": {"metrics": metrics}},
    }
    path = folder / f"results_{TS}.json"
    path.write_text(json.dumps(data))
    leaves = [s for t, subs in tasks.items() for s in (subs or [t])]
    for leaf in leaves if geometry is None else geometry:
        doc = {"schema": "lm_coupling.geometry/1", "task": leaf, "n_documents": 2}
        (folder / f"geometry_{leaf}_{TS}.json").write_text(json.dumps(doc))
    return path


def missing(out: Path, models: str, tasks, metrics=METRICS) -> dict[str, tuple]:
    return {p.entry.label: p.tasks for p in plan_sweep(parse_models(models), tasks, metrics, out)}


def test_complete_tasks_are_skipped_and_the_rest_planned(tmp_path):
    write_run(tmp_path, "pretrained=org/m,revision=step1,dtype=float32", {"a": [], "b": []})
    plan = missing(tmp_path, "org/m@step{0,1}", ["a", "b", "c"])
    assert plan == {"org/m@step0": ("a", "b", "c"), "org/m@step1": ("c",)}
    # Without --metrics only the results file counts.
    assert missing(tmp_path, "org/m@step1", ["a", "b"], None) == {"org/m@step1": ()}


def test_local_checkpoint_is_matched_by_the_reports_identity(tmp_path):
    write_run(tmp_path, "pretrained=/runs/tiny/step4", {"a": []})
    assert entry_identity(ModelEntry("/runs/tiny/step4")) == ("/runs/tiny", "step4")
    assert missing(tmp_path, "/runs/tiny/step{2,4}", ["a"]) == {
        "/runs/tiny/step2": ("a",),
        "/runs/tiny/step4": (),
    }


def test_missing_or_empty_geometry_makes_a_task_incomplete(tmp_path):
    path = write_run(tmp_path, "pretrained=m", {"a": [], "b": []}, geometry=["a"])
    assert missing(tmp_path, "m", ["a", "b"]) == {"m": ("b",)}
    geometry = path.with_name(f"geometry_a_{TS}.json")
    geometry.write_text(json.dumps({"schema": "lm_coupling.geometry/1", "n_documents": 0}))
    assert missing(tmp_path, "m", ["a", "b"]) == {"m": ("a", "b")}
    geometry.write_text("{truncated")
    with pytest.warns(UserWarning, match="cannot be read .* run again"):
        assert missing(tmp_path, "m", ["a"]) == {"m": ("a",)}


def test_a_group_needs_the_geometry_of_every_subtask(tmp_path):
    write_run(tmp_path, "pretrained=m", {"grp": ["x", "y"]}, geometry=["x"])
    assert missing(tmp_path, "m", ["grp"]) == {"m": ("grp",)}
    write_run(tmp_path, "pretrained=m", {"grp": ["x", "y"]})
    assert missing(tmp_path, "m", ["grp"]) == {"m": ()}


def test_a_run_without_a_requested_metric_is_incomplete(tmp_path):
    write_run(tmp_path, "pretrained=m", {"a": []}, metrics=["lss"])
    assert missing(tmp_path, "m", ["a"], ["coupling", "lss"]) == {"m": ("a",)}
    assert missing(tmp_path, "m", ["a"], ["lss"]) == {"m": ()}
    assert missing(tmp_path, "m", ["a"], ["all"]) == {"m": ()}


def test_broken_results_files_are_left_out_with_a_warning(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / f"results_{TS}.json").write_text("{not json")
    with pytest.warns(UserWarning, match=r"results_.*cannot be read .* run again"):
        assert missing(tmp_path, "m", ["a"]) == {"m": ("a",)}


def test_an_unreadable_status_record_is_left_out_with_a_warning(tmp_path):
    record(tmp_path, ModelEntry("org/m", "step0"), ModelStatus("org/m", "step0", "done", "a", 1.0))
    broken = next((tmp_path / STATUS_DIR).glob("*.json")).with_name("broken.json")
    broken.write_text("{not json")
    with pytest.warns(UserWarning, match="model record .*broken.json cannot be read"):
        rows = read_records(tmp_path)
    assert [r.model for r in rows] == ["org/m"]


def test_status_records_survive_and_are_listed_in_the_csv(tmp_path):
    first, second = ModelEntry("org/m", "step0"), ModelEntry("/x/broken")
    record(tmp_path, first, ModelStatus("org/m", "step0", "done", "a", 1.5))
    record(tmp_path, second, ModelStatus("/x/broken", "", "failed", "a", 0.5, "OSError: bad"))
    record(tmp_path, first, ModelStatus("org/m", "step0", "done", "a", 2.5))  # overwrites its own
    rows = {(r.model, r.status, r.seconds, r.error) for r in read_records(tmp_path)}
    assert rows == {("org/m", "done", 2.5, ""), ("/x/broken", "failed", 0.5, "OSError: bad")}
    lines = (tmp_path / "sweep_status.csv").read_text().splitlines()
    assert lines[0].startswith("model,revision,status") and len(lines) == 3
