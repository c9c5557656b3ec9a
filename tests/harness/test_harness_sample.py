"""The coupling sample: seeded, random, stratified by the gold answer, the same for every model.

The drawing order is checked on its own (proportions in every prefix, seeds,
nesting), then through real `lm_coupling.evaluate` runs of a 24-document task
on two tiny models (gpt2, llama) and two batch sizes: every run measures
coupling on the same documents, the ones its geometry file records, also when
lm-eval's ``samples`` chooses the documents (lm-eval then numbers their
requests 0, 1, ... and reports them by the listed ids).
"""

from __future__ import annotations

from collections import Counter

import pytest
from fixtures.inline_tasks import write_multiple_choice_task

from lm_coupling.harness.evaluate import evaluate_record
from lm_coupling.harness.sample import drawing_order

TASK = "lmc_test_sample_mc"
# 24 documents, gold answers 0 (18 documents) and 1 (6): a first-N sample of 8 would be all 0s.
ROWS = [
    {"question": f"Which word is number {i}?", "choices": [f"w{i}", f"v{i}"], "label": int(i >= 18)}
    for i in range(24)
]
SIZE = 8
CHOSEN = [1, 2, 4, 7, 9, 11, 12, 14, 17, 18, 20, 23]  # 9 with gold 0, 3 with gold 1


def test_every_prefix_is_stratified_in_proportion():
    strata = ["a"] * 60 + ["b"] * 30 + ["c"] * 10
    order = drawing_order(list(range(100)), strata, seed=0, task_name="t")
    assert sorted(order) == list(range(100))
    for n in range(1, 101):
        counts = Counter(strata[d] for d in order[:n])
        for stratum, share in (("a", 0.6), ("b", 0.3), ("c", 0.1)):
            assert abs(counts[stratum] - n * share) < 1, (n, counts)


def test_the_order_is_seeded_and_random():
    ids = list(range(200))
    first = drawing_order(ids, None, seed=0, task_name="t")
    assert first == drawing_order(ids, None, seed=0, task_name="t")
    assert first[:25] != drawing_order(ids, None, seed=1, task_name="t")[:25]
    assert first[:25] != drawing_order(ids, None, seed=0, task_name="u")[:25]
    assert first[:25] != tuple(range(25))  # not the first documents by id
    assert max(first[:25]) > 100


def _write_task(directory) -> None:
    write_multiple_choice_task(directory, TASK, {"rows": ROWS}, module="sample_data")


@pytest.fixture(scope="module")
def sample_runs(harness_setup, tmp_path_factory):
    """``{(model, batch size, seed): (coupled doc ids from the samples, geometry sample)}``."""
    tasks_dir = tmp_path_factory.mktemp("sample_tasks")
    _write_task(tasks_dir)
    runs = {}
    for model, batch_size, seed, samples in (
        ("gpt2", 4, 0, None),
        ("llama", 1, 0, None),
        ("gpt2", 4, 7, None),
        ("gpt2", 3, 0, {TASK: CHOSEN}),
    ):
        record = evaluate_record(
            model_args={"pretrained": str(harness_setup.models[model])},
            tasks=[TASK],
            metrics="lss,coupling",
            metric_args={"coupling_docs": SIZE, "sample_seed": seed, "k": 2},
            batch_size=batch_size,
            device="cpu",
            output_path=str(tmp_path_factory.mktemp("sample") / "results"),
            include_path=str(tasks_dir),
            samples=samples,
            log_samples=True,
        )
        coupled = sorted(
            row["doc_id"] for row in record.results["samples"][TASK] if "coupling" in row
        )
        reported = sorted(row["doc_id"] for row in record.results["samples"][TASK])
        assert reported == (CHOSEN if samples else list(range(len(ROWS))))
        runs[model, batch_size, seed] = (coupled, record.geometry[TASK]["sample"])
    return runs


@pytest.mark.slow
def test_same_sample_for_every_model_and_batch_size(sample_runs):
    gpt2, gpt2_sample = sample_runs["gpt2", 4, 0]
    llama, llama_sample = sample_runs["llama", 1, 0]
    assert gpt2 == llama == gpt2_sample["doc_ids"]["coupling_docs"] == sorted(set(gpt2))
    assert len(gpt2) == SIZE
    assert gpt2_sample == llama_sample
    assert gpt2_sample["seed"] == 0 and gpt2_sample["population"] == len(ROWS)
    assert gpt2_sample["method"] == "seeded random, stratified by gold answer"


@pytest.mark.slow
def test_sample_is_stratified_by_gold_answer(sample_runs):
    coupled, _ = sample_runs["gpt2", 4, 0]
    labels = Counter(ROWS[d]["label"] for d in coupled)
    assert labels == {0: 6, 1: 2}  # 18:6 of 24 documents, in proportion


@pytest.mark.slow
def test_another_seed_draws_another_sample(sample_runs):
    first, _ = sample_runs["gpt2", 4, 0]
    other, record = sample_runs["gpt2", 4, 7]
    assert other != first and len(other) == SIZE and record["seed"] == 7
    assert Counter(ROWS[d]["label"] for d in other) == {0: 6, 1: 2}


@pytest.mark.slow
def test_the_recorded_sample_is_coupled_when_samples_choose_the_documents(sample_runs):
    coupled, record = sample_runs["gpt2", 3, 0]
    assert coupled == record["doc_ids"]["coupling_docs"] == sorted(set(coupled))
    assert len(coupled) == SIZE and set(coupled) <= set(CHOSEN)
    assert record["population"] == len(CHOSEN)
    assert Counter(ROWS[d]["label"] for d in coupled) == {0: 6, 1: 2}  # 9:3, in proportion
