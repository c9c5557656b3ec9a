"""Duplicate prompts share one measurement, through a real `lm_coupling.evaluate` run.

A multiple-choice task whose documents repeat one question: twice with the
same gold answer (one key) and once with another gold answer, whose
one-token continuation makes lm-eval run the three as one batch row. Every
document is captured in lm-eval's batch (no second forward pass "alone", no
warning), the trajectory and the Jacobian metrics are those of the one prompt,
and the lens target is each document's own: its ``tv_to_target`` equals the
prompt measured alone with that target.
"""

from __future__ import annotations

import math

import pytest
import torch
from fixtures.inline_tasks import write_multiple_choice_task

from lm_coupling.errors import GeometryWarning
from lm_coupling.harness.evaluate import evaluate_record
from lm_coupling.harness.lm_eval_adapter import encode_pair

pytestmark = pytest.mark.slow

TASK = "lmc_test_duplicate_prompts"
SKY = "What colour is the sky?"
ROWS = [
    {"question": SKY, "choices": ["a", "the"], "label": 1},
    {"question": SKY, "choices": ["a", "the"], "label": 0},  # same prompt, other gold
    {"question": SKY, "choices": ["a", "the"], "label": 1},  # same key as document 0
    {"question": "Which animal barks?", "choices": ["cat", "dog"], "label": 1},
]


@pytest.fixture(scope="module")
def duplicate_run(harness_setup, tmp_path_factory):
    tasks_dir = tmp_path_factory.mktemp("duplicate_tasks")
    write_multiple_choice_task(tasks_dir, TASK, {"rows": ROWS}, module="duplicate_data")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = evaluate_record(
            model_args={"pretrained": str(harness_setup.models["gpt2"])},
            tasks=[TASK],
            metrics="lss,logit_lens_entropy,tv_to_target,coupling",
            metric_args={"coupling_docs": "all", "k": 2},
            batch_size=4,
            device="cpu",
            output_path=str(tmp_path_factory.mktemp("duplicates") / "results"),
            include_path=str(tasks_dir),
            log_samples=True,
        )
    messages = [str(w.message) for w in caught if issubclass(w.category, GeometryWarning)]
    rows = {row["doc_id"]: row for row in record.results["samples"][TASK]}
    return record, rows, messages


@pytest.fixture(scope="module")
def alone_model(harness_setup):
    """A second `CouplingHFLM` of the same model with its own session (prompts measured alone)."""
    from lm_coupling.harness.run import build_model
    from lm_coupling.harness.run_config import RunConfig

    run = RunConfig.from_keywords(
        "hf",
        {"pretrained": str(harness_setup.models["gpt2"])},
        [TASK],
        "lss,logit_lens_entropy,tv_to_target",
        None,
        lm_eval_options={"batch_size": 1, "device": "cpu"},
    )
    lm = build_model(run)
    lm.open_session(run)
    return lm


def test_one_token_answers_make_one_row(duplicate_run, alone_model):
    for word in ("a", "the"):  # the premise: lm-eval runs the choices as one row
        assert len(encode_pair(alone_model, f"Question: {SKY}\nAnswer:", f" {word}")[1]) == 1


def test_duplicates_are_captured_in_the_batch(duplicate_run):
    record, _, messages = duplicate_run
    capture = record.results["config"]["lm_coupling"]["capture"][TASK]
    assert capture == {"in_batch": 4, "alone": 0, "cached": 0, "failed": 0}
    assert not [m for m in messages if "measured alone" in m or "tokeniz" in m], messages


def test_duplicates_share_the_prompt_and_keep_their_target(duplicate_run, alone_model):
    record, rows, _ = duplicate_run
    for name in ("lss", "logit_lens_entropy", "coupling"):
        assert rows[0][name] == rows[1][name] == rows[2][name], name
        assert rows[3][name] != rows[0][name], name
    assert rows[0]["tv_to_target"] == rows[2]["tv_to_target"]
    assert rows[0]["tv_to_target"] != rows[1]["tv_to_target"]
    # Independent: each prompt measured alone (its own forward pass) with its own target.
    session = record.session
    for doc_id in (0, 1):
        plan = session.plans.plan_for(TASK, doc_id)
        with torch.no_grad():
            alone = alone_model.measure_alone(plan)
        for name in ("lss", "tv_to_target"):
            assert math.isclose(alone.values[name], rows[doc_id][name], rel_tol=1e-4), name
