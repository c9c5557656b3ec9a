"""Documents the geometry cannot take at face value, on a real in-process run.

Two small tasks written here: a multiple-choice task with a duplicated
document and a document whose gold answer cannot be read, and a
``loglikelihood_rolling`` (perplexity) task. Run once through
`lm_coupling.evaluate` with ``--batch_size auto``.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest
from harness_cli import plugin_registered

from lm_coupling import hookimpl
from lm_coupling.errors import GeometryWarning
from lm_coupling.harness.evaluate import evaluate_record

pytestmark = pytest.mark.slow

MC_TASK = "lmc_test_odd_mc"
ROLLING_TASK = "lmc_test_rolling"
SKY = "What colour is the sky on a clear day?"
ROWS = [  # labels as text, like the hub's; lm-eval reads a digit string as an index
    {"question": SKY, "choices": ["green", "blue"], "label": "1"},
    {"question": "How many legs has a spider?", "choices": ["eight", "six"], "label": "0"},
    {"question": SKY, "choices": ["green", "blue"], "label": "1"},
    {"question": "Which is a metal?", "choices": ["iron", "wood"], "label": "zebra"},
    {"question": "Which animal barks?", "choices": ["cat", "dog"], "label": "1"},
]
DUPLICATE, COPY, UNREADABLE = 0, 2, 3
TEXTS = [{"text": "The sky is blue and the grass is green."}, {"text": "Spiders have eight legs."}]

LOADER = """
import datasets

def load(**kwargs):
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(kwargs["rows"])})
"""


def _write_tasks(directory) -> None:
    (directory / "odd_data.py").write_text(LOADER, encoding="utf-8")
    mc = f"""
        task: {MC_TASK}
        custom_dataset: !function odd_data.load
        dataset_kwargs:
          rows: {json.dumps(ROWS)}
        output_type: multiple_choice
        test_split: test
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{label}}}}"
        metric_list:
          - metric: acc
        metadata:
          version: 1.0
    """
    rolling = f"""
        task: {ROLLING_TASK}
        custom_dataset: !function odd_data.load
        dataset_kwargs:
          rows: {json.dumps(TEXTS)}
        output_type: loglikelihood_rolling
        test_split: test
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list:
          - metric: word_perplexity
        metadata:
          version: 1.0
    """
    (directory / f"{MC_TASK}.yaml").write_text(textwrap.dedent(mc), encoding="utf-8")
    (directory / f"{ROLLING_TASK}.yaml").write_text(textwrap.dedent(rolling), encoding="utf-8")


class Observer:
    """Keeps the run's session and the batch sizes the capture saw."""

    def __init__(self):
        self.session = None
        self.batch_rows: list[int] = []

    @hookimpl
    def lmc_compute_batch(self, states):  # an observer: it declares no metric
        if not states.jacobians:  # a captured batch, not a sampled one
            self.batch_rows.append(states.size)


@pytest.fixture(scope="module")
def odd_run(harness_setup, tmp_path_factory):

    tasks_dir = tmp_path_factory.mktemp("odd_tasks")
    _write_tasks(tasks_dir)
    observer = Observer()
    with plugin_registered(observer, "test.observer") as caught:
        record = evaluate_record(
            model_args={"pretrained": str(harness_setup.models["gpt2"])},
            tasks=[MC_TASK, ROLLING_TASK],
            metrics="lss,tv_to_target",
            batch_size="auto",
            device="cpu",
            output_path=str(tmp_path_factory.mktemp("odd") / "results"),
            include_path=str(tasks_dir),
            log_samples=True,
        )
        observer.session = record.session
        results = {**record.results, "geometry": record.geometry}
        unplanned = observer.session.plans.plan_for(MC_TASK, 10_000)
    messages = [str(w.message) for w in caught if issubclass(w.category, GeometryWarning)]
    return results, observer, messages, unplanned


def _samples(results, task) -> dict[int, dict]:
    return {row["doc_id"]: row for row in results["samples"][task]}


def test_duplicate_documents_both_count(odd_run):
    results, observer, _, _ = odd_run
    samples = _samples(results, MC_TASK)
    assert len(samples) == len(ROWS) == results["n-samples"][MC_TASK]["effective"]
    assert samples[COPY]["lss"] == samples[DUPLICATE]["lss"]
    scored = observer.session.records.scored_ids
    assert sorted(doc_id for task, doc_id in scored if task == MC_TASK) == list(range(len(ROWS)))
    capture = results["config"]["lm_coupling"]["capture"][MC_TASK]
    assert capture == {"in_batch": len(ROWS) - 1, "alone": 0, "cached": 0, "failed": 1}


def test_unreadable_gold_is_nan_with_one_warning(odd_run):
    results, observer, messages, _ = odd_run
    samples = _samples(results, MC_TASK)
    assert "lss" not in samples[UNREADABLE] and "tv_to_target" not in samples[UNREADABLE]
    named = [m for m in messages if f"task {MC_TASK!r} document {UNREADABLE}:" in m]
    assert len(named) == 1 and "gold" in named[0], named
    failures = observer.session.records.tasks[MC_TASK].failures
    assert [f["doc_id"] for f in failures] == [UNREADABLE]
    for doc_id, row in samples.items():
        if doc_id != UNREADABLE:
            assert math.isfinite(row["lss"]) and math.isfinite(row["tv_to_target"])
    measured = results["config"]["lm_coupling"]["n_measured"][MC_TASK]
    assert measured == {"lss": len(ROWS) - 1, "tv_to_target": len(ROWS) - 1}


def test_rolling_task_says_it_has_no_geometry(odd_run):
    results, _, messages, _ = odd_run
    named = [m for m in messages if ROLLING_TASK in m]
    assert len(named) == 1 and "loglikelihood_rolling" in named[0]
    assert math.isfinite(results["results"][ROLLING_TASK]["word_perplexity,none"])
    assert "lss,none" not in results["results"][ROLLING_TASK]
    assert ROLLING_TASK not in results["config"]["lm_coupling"]["capture"]


def test_a_document_without_requests_is_named(odd_run):
    _, _, messages, unplanned = odd_run
    assert unplanned is None
    assert any(f"task {MC_TASK!r} document 10000: no request" in m for m in messages)


def test_auto_batch_size_search_runs_under_capture(odd_run):
    results, observer, _, _ = odd_run
    # lm-eval's search starts at max_batch_size (64) on a CPU; its probe
    # batches ran through the capture, so its memory counted.
    assert 64 in observer.batch_rows
    assert results["config"]["batch_size"] == "auto"
