"""A task-level metric's value reaches lm-eval's results once per task, under its first filter."""

from __future__ import annotations

import math
import types

from lm_coupling.harness.outputs import add_task_level_values, task_level_value
from lm_coupling.plugins.specs import MetricSpec

NEEDS = frozenset({"hidden_states"})


def _session():
    specs = {
        "per_task": MetricSpec("per_task", "one per task", NEEDS, task_level=True),
        "per_doc": MetricSpec("per_doc", "one per document", NEEDS, higher_is_better=True),
    }
    return types.SimpleNamespace(selection=types.SimpleNamespace(specs=specs))


def test_the_value_goes_under_the_task_s_first_filter_with_no_stderr():
    results = {
        "results": {
            "gsm": {"alias": "gsm", "exact_match,strict-match": 0.1,
                    "exact_match_stderr,strict-match": 0.01, "exact_match,flexible": 0.2},
            "arc": {"alias": "arc", "acc,none": 0.5},
            "missing": {"acc,none": 0.3},
        },
        "higher_is_better": {"arc": {"acc": True}},
    }  # fmt: skip
    documents = {
        "gsm": {"per_task": {"value": 1.5, "n": 4}},
        "arc": {"per_task": {"value": 0.25, "n": 9}, "per_doc": {"value": 9.0}},
        "missing": {"per_task": {"value": math.nan, "n": 0}},  # undefined: left out, not NaN
    }
    add_task_level_values(results, documents, _session())
    gsm, arc = results["results"]["gsm"], results["results"]["arc"]
    assert gsm["per_task,strict-match"] == 1.5
    assert gsm["per_task_stderr,strict-match"] == "N/A"
    assert "per_task,flexible" not in gsm  # once per task
    assert arc["per_task,none"] == 0.25 and arc["per_task_stderr,none"] == "N/A"
    assert "per_doc,none" not in arc  # per-document metrics are lm-eval's own business
    assert results["higher_is_better"]["arc"] == {"acc": True, "per_task": None}
    assert not any(k.startswith("per_task") for k in results["results"]["missing"])


def test_only_a_finite_number_is_a_value():
    assert task_level_value({"m": {"value": 2}}, "m") == 2.0
    for section in ({"value": math.inf}, {"value": True}, {"value": "1"}, {}, None, [1]):
        assert task_level_value({"m": section}, "m") is None
