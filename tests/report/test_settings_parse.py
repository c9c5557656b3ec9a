"""Reading a task's setting from lm-eval's results JSON (the keys lm-eval 0.4 writes)."""

from __future__ import annotations

import pytest

from lm_coupling.catalogue import Catalogue
from lm_coupling.report.loading import k_setting_name
from lm_coupling.report.settings import (
    TaskSetting,
    differing_options,
    options_text,
    task_settings,
)


def _results(limit=None, effective=30):
    return {
        "config": {"limit": limit},
        "n-shot": {"arc": 25, "mmlu_a": 5, "mmlu_b": 5, "mmlu": 5},
        "configs": {
            "arc": {"num_fewshot": 25},
            "mmlu_a": {"num_fewshot": 5},
            "mmlu_b": {"num_fewshot": 5},
            "gsm8k": {"num_fewshot": 2},  # not in n-shot: read from configs
        },
        "n-samples": {
            "arc": {"original": 30, "effective": effective},
            "mmlu_a": {"original": 10, "effective": min(10, effective)},
            "mmlu_b": {"original": 10, "effective": min(10, effective)},
            "gsm8k": {"original": 8, "effective": min(8, effective)},
        },
        "group_subtasks": {"mmlu": ["mmlu_a", "mmlu_b"]},
    }


def test_complete_run():
    found = task_settings(_results(), ["arc", "mmlu", "gsm8k", "unknown"])
    assert found["arc"] == TaskSetting(25, None) and found["arc"].label() == "25-shot"
    assert found["mmlu"] == TaskSetting(5, None)
    assert found["gsm8k"] == TaskSetting(2, None)
    assert found["unknown"].label() == "shots unknown"


def test_limit_is_the_documents_evaluated_and_only_when_it_cut():
    found = task_settings(_results(limit=4.0, effective=4), ["arc", "mmlu", "gsm8k"])
    assert found["arc"].label() == "25-shot, limit 4"
    assert found["mmlu"] == TaskSetting(5, 4.0)  # a group is limited when a subtask is
    # --limit 40 on tasks of 8-30 documents changes nothing: no limit.
    assert task_settings(_results(limit=40.0), ["arc"])["arc"] == TaskSetting(25, None)


def test_limit_without_sample_counts_falls_back_to_config():
    data = _results(limit=3.0)
    del data["n-samples"]
    assert task_settings(data, ["arc"])["arc"] == TaskSetting(25, 3.0)


def test_options_text_and_differences():
    assert options_text({"k": 47, "norm": "l1"}, {"k": 100}) == "k=47 (asked 100), norm=l1"
    runs = [
        {"k": 10, "norm": "l1", "coupling_docs": 25, "jacobian_method": "auto"},
        {"k": 10, "norm": "l2", "coupling_docs": 5, "jacobian_method": "dense"},
    ]
    installed = Catalogue.installed()
    ignored = installed.sample_options() | installed.method_options()
    assert {"jacobian_method", "jacobian_tol", "jacobian_seed"} <= installed.method_options()
    assert not {"k", "norm", "coupling_docs"} & installed.method_options()
    assert differing_options(runs, ignored) == {"norm": ["l1", "l2"]}  # sample size, route ignored


@pytest.mark.parametrize(
    ("options", "requested", "name"),
    [
        ({"k": 47}, {"k": 100}, "coupling_k100"),  # the K asked, not the K used
        ({"k": 6}, {"k": 0.1}, "coupling_k0.1"),
        ({"k": 10}, {}, "coupling_k10"),
        ({"k": 10}, None, "coupling_k10"),
    ],
)
def test_k_column_is_named_after_the_k_asked(options, requested, name):
    assert k_setting_name("coupling", options, requested) == name
