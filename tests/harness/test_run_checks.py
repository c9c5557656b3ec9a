"""The end-of-run account and the count-warning filter, on lm-eval's real code."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lm_coupling.harness.run_summary import leaf_tasks, measured_counts, summary_lines

TASK = "lmc_arc_easy_offline"
GEOMETRY_FILE = Path("results/m/geometry_lmc_arc_easy_offline_T.json")


def _document(**extra):
    return {
        "task": TASK,
        "metrics": ["lss", "logit_lens_entropy", "coupling"],
        "n_documents": 5,
        **extra,
    }


def test_counts_come_from_n_measured():
    document = _document(n_measured={"lss": 5, "logit_lens_entropy": 4, "coupling": 2})
    assert measured_counts(document) == {
        "lss": 5,
        "logit_lens_entropy": 4,
        "coupling": 2,
    }
    (line,) = summary_lines([TASK], {TASK: (GEOMETRY_FILE, document)}, ["coupling"])
    assert not line.error
    assert line.text == (
        f"{TASK}: lss 5/5, logit_lens_entropy 4/5, coupling 2/5 (sampled) -> {GEOMETRY_FILE}"
    )


def test_a_metric_on_no_document_is_an_error_line():
    document = _document(n_measured={"lss": 5, "logit_lens_entropy": 5, "coupling": 0})
    (line,) = summary_lines([TASK], {TASK: (GEOMETRY_FILE, document)}, ["coupling"])
    assert line.error
    assert "coupling 0/5 (sampled); computed on 0 documents: coupling" in line.text


def test_a_task_without_geometry_is_an_error_line():
    document = _document(n_measured={"lss": 5, "logit_lens_entropy": 5, "coupling": 2})
    lines = summary_lines(["other", TASK], {TASK: (GEOMETRY_FILE, document)}, [], ["lss"])
    assert [line.task for line in lines] == ["other", TASK]
    assert (
        lines[0].error
        and lines[0].text == "other: no document measured: lss computed on 0 documents"
    )
    assert not lines[1].error


def test_leaf_tasks_drop_groups():
    results = {
        "results": {"arc": {}, "arc_easy": {}, "arc_challenge": {}},
        "group_subtasks": {"arc": ["arc_easy", "arc_challenge"], "arc_easy": []},
    }
    assert leaf_tasks(results) == ["arc_challenge", "arc_easy"]


# -- lm-eval's "Metrics were not scored on the same number of documents" warning -------------


@pytest.fixture(scope="module")
def real_task():
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.run import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return manager.load(TASK)["tasks"][TASK]


def _count_warnings(task, raw: dict, caplog) -> list[str]:
    """Aggregate ``raw`` with lm-eval's own code inside a geometry run; the warnings left."""
    from lm_eval.evaluator_utils import _compute_task_aggregations

    from lm_coupling.harness.quiet import quiet_lm_eval

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lm_eval.evaluator_utils"):
        with quiet_lm_eval(["lss", "coupling"]):
            _compute_task_aggregations(task, raw, bootstrap_iters=0)
    return [r.getMessage() for r in caplog.records if "not scored on the same" in r.getMessage()]


def test_geometry_sample_counts_are_silenced(real_task, caplog):
    raw = {
        ("acc", "none"): [1, 0, 1, 1],
        ("acc_norm", "none"): [1, 1, 1, 0],
        ("lss", "none"): [0.1, 0.2, 0.3, 0.4],
        ("coupling", "none"): [0.5, 0.6],
    }
    assert _count_warnings(real_task, raw, caplog) == []


def test_benchmark_count_mismatch_is_kept(real_task, caplog):
    raw = {
        ("acc", "none"): [1, 0, 1],
        ("acc_norm", "none"): [1, 1, 1, 0],
        ("lss", "none"): [0.1, 0.2, 0.3, 0.4],
        ("coupling", "none"): [0.5, 0.6],
    }
    (message,) = _count_warnings(real_task, raw, caplog)
    assert "acc,none=3" in message and "acc_norm,none=4" in message


def test_geometry_on_more_documents_than_the_benchmark_is_kept(real_task, caplog):
    raw = {("acc", "none"): [1, 0], ("lss", "none"): [0.1, 0.2, 0.3]}
    assert len(_count_warnings(real_task, raw, caplog)) == 1


def test_without_a_geometry_run_the_warning_is_stock(real_task, caplog):
    from lm_eval.evaluator_utils import _compute_task_aggregations

    raw = {("acc", "none"): [1, 0, 1, 1], ("coupling", "none"): [0.5]}
    with caplog.at_level(logging.WARNING, logger="lm_eval.evaluator_utils"):
        _compute_task_aggregations(real_task, raw, bootstrap_iters=0)
    assert any("not scored on the same" in r.getMessage() for r in caplog.records)
