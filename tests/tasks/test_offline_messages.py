"""Offline tasks say where their documents come from, and name a bad file."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from lm_eval.tasks import TaskManager

TASKS_DIR = Path(__file__).resolve().parents[2] / "lm_coupling" / "tasks"
BUNDLED = TASKS_DIR.parent / "demo" / "sample_tasks"


@pytest.fixture(scope="module")
def our_tasks():
    """lm-eval's TaskManager over lm-coupling's tasks only (no stock index: fast)."""
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def test_empty_data_file_is_named(our_tasks, monkeypatch, tmp_path):
    folder = tmp_path / "arc_easy"
    folder.mkdir()
    (folder / "test.jsonl").write_text("\n", encoding="utf-8")
    (folder / "train.jsonl").write_text(
        (BUNDLED / "arc_easy" / "train.jsonl").read_text(encoding="utf-8"), encoding="utf-8"
    )
    monkeypatch.setenv("LM_COUPLING_DATA_DIR", str(tmp_path))
    with pytest.raises(ValueError) as info:
        our_tasks.load("lmc_arc_easy_offline")
    message = str(info.value)
    assert f"{folder / 'test.jsonl'} has no rows" in message
    assert "the test split of the offline arc_easy task" in message


def test_bundled_samples_are_announced_once_per_benchmark(our_tasks, monkeypatch, caplog):
    from lm_coupling.tasks import offline_data

    monkeypatch.delenv("LM_COUPLING_DATA_DIR", raising=False)
    # Announcements are once per process, shared by every copy of offline_data.py that
    # lm-eval imports by path (the installed package's and this checkout's tasks folder):
    # forget those of earlier tests in this process.
    task_log = logging.getLogger("lm_coupling.tasks")
    monkeypatch.setattr(task_log, offline_data.ANNOUNCED_ATTRIBUTE, set(), raising=False)
    with caplog.at_level(logging.WARNING, logger="lm_coupling.tasks"):
        loaded = our_tasks.load(["lmc_arc_easy_offline", "lmc_mmlu_sample"])
    assert loaded["tasks"]
    announced = [r.getMessage() for r in caplog.records if r.name == "lm_coupling.tasks"]
    arc = [m for m in announced if "offline arc_easy task" in m]
    mmlu = [m for m in announced if "offline mmlu task" in m]
    assert len(arc) == 1 and len(mmlu) == 1, announced
    assert f"bundled sample documents in {BUNDLED / 'arc_easy'}" in arc[0]
    assert "LM_COUPLING_DATA_DIR" in arc[0]


def test_data_folder_given_is_not_announced(our_tasks, monkeypatch, caplog):
    monkeypatch.setenv("LM_COUPLING_DATA_DIR", str(BUNDLED))
    with caplog.at_level(logging.WARNING, logger="lm_coupling.tasks"):
        our_tasks.load("lmc_arc_challenge_offline")
    assert not [r for r in caplog.records if r.name == "lm_coupling.tasks"]


def test_an_announcement_is_once_per_process_across_copies_of_the_module(
    tmp_path, monkeypatch, caplog
):
    """lm-eval imports offline_data.py by path, once per tasks folder: the copies share it."""
    import importlib.util
    import shutil

    from lm_coupling.tasks import offline_data

    def load_copy(path: Path):
        spec = importlib.util.spec_from_file_location(f"lmc_copy_{path.parent.name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    copies = []
    for name in ("checkout", "installed"):
        (tmp_path / name).mkdir()
        copies.append(load_copy(Path(shutil.copy(offline_data.__file__, tmp_path / name))))
    task_log = logging.getLogger("lm_coupling.tasks")
    monkeypatch.setattr(task_log, offline_data.ANNOUNCED_ATTRIBUTE, set(), raising=False)
    with caplog.at_level(logging.WARNING, logger="lm_coupling.tasks"):
        for module in (*copies, offline_data):
            module._announce_bundled("arc_easy", BUNDLED / "arc_easy")
    announced = [r.getMessage() for r in caplog.records if r.name == "lm_coupling.tasks"]
    assert len(announced) == 1 and "offline arc_easy task" in announced[0], announced
