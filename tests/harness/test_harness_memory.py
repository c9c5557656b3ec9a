"""What geometry keeps per document is bounded and small: flat in N.

Two real `lm_coupling.evaluate` runs of one synthetic multiple-choice task, at
N = 12 and N = 48 documents, with trajectory, lens and coupling metrics: the
session's retained state (its task records and measurements, pickled) grows
by at most a few dozen bytes per document (the scored doc ids), while every
value of the geometry file is still there. Keeping each document's geometry
(its profiles) costs well over a kilobyte per document.

The peak: lm-eval scores only after every request has run, so every
measurement waits for its score. What waits is read at lm-eval's first
scored document (the largest it gets): its values and timings, a few numbers
per metric, not its ``(L+1)``-long profiles, which are already in the task's
running summaries.
"""

from __future__ import annotations

import pickle

import pytest
from fixtures.inline_tasks import write_multiple_choice_task

from lm_coupling.harness.evaluate import evaluate_record

pytestmark = pytest.mark.slow

TASK = "lmc_test_memory_mc"
LOADER = """
import datasets

def load(**kwargs):
    rows = [
        {"question": f"Item {i}: pick a word", "choices": ["a", "the", "is"], "label": i % 3}
        for i in range(kwargs["n"])
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
"""
SIZES = (12, 48)
BYTES_PER_DOCUMENT = 64


PEAK_BYTES_PER_DOCUMENT = 160
"""Pickled bytes of one waiting measurement: its values, timings, names and containers
(about 115 here; with its profiles, as before they were folded in when measured, 367)."""


def _run(harness_setup, tmp_path_factory, n: int):
    tasks_dir = tmp_path_factory.mktemp(f"memory_tasks_{n}")
    write_multiple_choice_task(tasks_dir, TASK, {"n": n}, module="memory_data", loader=LOADER)
    return evaluate_record(
        model_args={"pretrained": str(harness_setup.models["gpt2"])},
        tasks=[TASK],
        metrics="lss,expodistance,equidistance,logit_lens_entropy,tv_to_target,coupling",
        metric_args={"coupling_docs": 4, "k": 2},
        batch_size=8,
        device="cpu",
        output_path=str(tmp_path_factory.mktemp(f"memory_{n}") / "results"),
        include_path=str(tasks_dir),
    )


def _retained(record) -> int:
    session = record.session
    return len(pickle.dumps((dict(session.records.tasks), session.measurements.measured)))


def test_retained_geometry_is_flat_in_n(harness_setup, tmp_path_factory):
    small, large = (_run(harness_setup, tmp_path_factory, n) for n in SIZES)
    growth = (_retained(large) - _retained(small)) / (SIZES[1] - SIZES[0])
    assert growth <= BYTES_PER_DOCUMENT, f"{growth:.0f} bytes kept per document"
    for record, n in ((small, SIZES[0]), (large, SIZES[1])):
        geometry = record.geometry[TASK]
        assert geometry["n_documents"] == n
        assert geometry["n_measured"]["lss"] == n and geometry["n_measured"]["coupling"] == 4
        assert geometry["profiles"]["norm"]["n"][0] == n
        assert geometry["coupling"]["n_sampled"] == 4
        assert record.session.measurements.measured == {}  # every measurement released once scored


def test_what_waits_for_lm_evals_scoring_is_a_few_numbers_per_document(
    harness_setup, tmp_path_factory, monkeypatch
):
    from lm_coupling.harness.measurements import MeasurementStore

    score = MeasurementStore.geometry_for
    waiting: dict[int, int] = {}
    with_profiles: dict[int, int] = {}
    indexed: dict[int, int] = {}

    def first_score_records_what_waits(store, plan, measure_alone):
        if id(store) not in waiting:  # lm-eval's first scored document: every request has run
            measured = list(store.measured.values())
            waiting[id(store)] = len(pickle.dumps(measured))
            with_profiles[id(store)] = sum(bool(g.profiles) for g in measured)
            # Planning's index of the requests by document is not kept for scoring.
            indexed[id(store)] = sum(len(i) for i in store.plans._task_instances.values())
        return score(store, plan, measure_alone)

    monkeypatch.setattr(MeasurementStore, "geometry_for", first_score_records_what_waits)
    small, large = (_run(harness_setup, tmp_path_factory, n) for n in SIZES)
    peak = [waiting[id(record.session.measurements)] for record in (small, large)]
    growth = (peak[1] - peak[0]) / (SIZES[1] - SIZES[0])
    assert growth <= PEAK_BYTES_PER_DOCUMENT, f"{growth:.0f} bytes wait per document"
    # Only the coupled documents (coupling_docs = 4) wait with their profiles.
    assert [with_profiles[id(r.session.measurements)] for r in (small, large)] == [4, 4]
    assert [indexed[id(r.session.measurements)] for r in (small, large)] == [0, 0]
    norm = large.geometry[TASK]["profiles"]["norm"]
    assert (
        norm["n"][0] == SIZES[1] and len(norm["mean"]) == large.session.model_shape["n_layers"] + 1
    )
