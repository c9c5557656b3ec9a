"""The session's bookkeeping without a run: capture counts, their merge, K as used."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lm_coupling.errors import GeometryWarning
from lm_coupling.geometry import DocumentGeometry
from lm_coupling.harness.plan import DocumentPlan
from lm_coupling.harness.session import GeometrySession
from lm_coupling.harness.task_records import TaskRecords
from lm_coupling.plugins.specs import used_k
from lm_coupling.selection import make_selection


def _session(metric_args: str | None = None, **parts) -> GeometrySession:
    selection = make_selection("lss,coupling,alignment_ratio", metric_args)
    return GeometrySession(selection, model_shape={"d_model": 32}, **parts)


def _record(session: GeometrySession, doc_id: int, source: str, **values: float) -> None:
    key = (f"context {doc_id}", " answer")
    sampled = frozenset({"coupling", "alignment_ratio"})
    plan = DocumentPlan("task", doc_id, key, "loglikelihood", sampled)
    session.plans.plans_by_key[key].append(plan)
    session.measurements.store(key, DocumentGeometry(values=dict(values)), source)
    geometry = session.measurements.measured[key]
    session.document_values(plan, geometry)
    session.document_values(plan, geometry)  # a second filter


def test_documents_measured_alone_without_use_cache_warn_once_per_task():
    session = _session()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _record(session, 0, "in_batch", lss=1.5, coupling=0.5, alignment_ratio=1.0)
        _record(session, 1, "alone", lss=1.6, coupling=0.4, alignment_ratio=1.1)
        _record(session, 2, "alone", lss=1.7, coupling=0.3, alignment_ratio=1.2)
        report = session.records.capture_report()
        session.records.capture_report()
    assert report["task"]["capture"] == {"in_batch": 1, "alone": 2, "cached": 0, "failed": 0}
    assert report["task"]["n_measured"] == {"lss": 3, "coupling": 3, "alignment_ratio": 3}
    (warning,) = [w for w in caught if issubclass(w.category, GeometryWarning)]
    assert "task 'task': 2 of 3 documents" in str(warning.message)
    assert "measured alone" in str(warning.message)


def test_with_use_cache_alone_is_expected_and_silent(tmp_path):
    from lm_coupling.harness.cache import GeometryCache

    session = _session(cache=GeometryCache(tmp_path / "cache_geometry_rank0.db", {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _record(session, 0, "alone", lss=1.5, coupling=0.5, alignment_ratio=1.0)
        assert session.records.capture_report()["task"]["capture"]["alone"] == 1


def test_records_of_two_ranks_merge_with_their_counts():
    first, second = TaskRecords(), TaskRecords()
    for doc_id in (0, 2):
        first.add(doc_id, DocumentGeometry({"lss": 1.0}, {"norm": np.array([1.0, 2.0 * doc_id])}))
    first.capture["in_batch"] = 2
    second.add(1, DocumentGeometry({"lss": float("nan")}, {"norm": np.array([4.0, 5.0])}))
    second.capture["failed"] = 1
    second.failures = [{"doc_id": 1, "error": "x"}]
    session = _session()
    session.records.merge([{"task": first}, {"task": second}])
    merged = session.records.tasks["task"]
    assert merged.profiled_ids == [0, 2, 1] and merged.failures == second.failures
    assert merged.capture == {"in_batch": 2, "alone": 0, "cached": 0, "failed": 1}
    assert merged.n_measured(["lss"]) == {"lss": 2} and merged.n_documents == 3
    # The running summaries merge to what all three profiles give at once.
    profiles = np.array([[1.0, 0.0], [1.0, 4.0], [4.0, 5.0]])
    summary = merged.profiles["norm"].summary()
    np.testing.assert_allclose(summary["mean"], profiles.mean(axis=0))
    stderr = profiles.std(axis=0, ddof=1) / np.sqrt(3)
    np.testing.assert_allclose(summary["stderr"], stderr)
    assert summary["n"] == [3, 3]


def test_k_is_recorded_as_used_and_as_requested():
    session = _session("k=1000,alignment_k=0.5")
    assert session.options_used()["k"] == 31 and session.options_used()["alignment_k"] == 16
    assert session.options_changed() == {"k": 1000, "alignment_k": 0.5}
    assert _session().options_changed() == {}


@pytest.mark.parametrize(
    ("k", "d_model", "expected"),
    [(10, 32, 10), (31, 32, 31), (32, 32, 31), (1000, 32, 31), (1, 2, 1), (1000, 1, 1),
     (0.1, 768, 76), (0.1, 32, 3), (0.01, 32, 1), (0.5, 2, 1), (0.999, 32, 31)],
)  # fmt: skip
def test_used_k_is_the_k_the_coupling_plugin_computes(k, d_model, expected):
    assert used_k(k, d_model) == expected


def test_running_profile_equals_the_whole_stack_across_ranks():
    from lm_coupling.harness.streaming import RunningProfile

    rng = np.random.default_rng(0)
    stack = rng.normal(size=(775, 5))
    stack[rng.random(stack.shape) < 0.1] = np.nan
    first, second = RunningProfile(), RunningProfile()
    for row in stack[:515]:
        first.add(row)
    for row in stack[515:]:
        second.add(row)
    first.merge(second)
    summary = first.summary()
    n = np.isfinite(stack).sum(axis=0)
    np.testing.assert_allclose(summary["mean"], np.nanmean(stack, axis=0))
    np.testing.assert_allclose(summary["stderr"], np.nanstd(stack, axis=0, ddof=1) / np.sqrt(n))
    assert summary["n"] == n.tolist()


def test_a_profile_of_another_shape_is_left_out_and_named_across_ranks():
    """Streamed summaries still report a document whose profile has another shape (issue 23)."""
    from lm_coupling.harness.outputs import profile_summaries

    first, second = TaskRecords(), TaskRecords()
    first.add(0, DocumentGeometry({}, {"norm": np.array([1.0, 2.0])}))
    first.add(5, DocumentGeometry({}, {"norm": np.array([9.0, 9.0, 9.0])}))
    first.add(1, DocumentGeometry({}, {"norm": np.array([3.0, 4.0])}))
    second.add(7, DocumentGeometry({}, {"norm": np.array([9.0, 9.0, 9.0])}))
    second.add(2, DocumentGeometry({}, {"norm": np.array([5.0, 6.0])}))
    second.add(3, DocumentGeometry({}, {"norm": np.array([7.0, 8.0])}))
    session = _session()
    session.records.merge([{"task": first}, {"task": second}])
    failures: list[dict] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summaries = profile_summaries("task", session.records.tasks["task"], session, failures)
    np.testing.assert_allclose(summaries["norm"]["mean"], [4.0, 5.0])  # the 4 of shape (2,)
    assert summaries["norm"]["n"] == [4, 4]
    owner = next(s for s in session.selection.specs.values() if "norm" in s.profiles)
    assert [f["doc_id"] for f in failures] == [5, 7]
    assert {f["plugin"] for f in failures} == {owner.plugin}
    assert all("'norm' has shape (3,)" in f["error"] for f in failures)
    messages = [str(w.message) for w in caught if issubclass(w.category, GeometryWarning)]
    assert len(messages) == 1 and owner.plugin in messages[0] and "5, 7" in messages[0]


def test_profiles_of_one_shape_keep_one_run_of_positions():
    """Memory stays flat in N: one shape is one ``[start, stop)`` run, however many documents."""
    records = TaskRecords()
    for doc_id in range(300):
        records.add(doc_id, DocumentGeometry({}, {"norm": np.zeros(3)}))
    assert records.profiles["norm"].runs == {(3,): [[0, 300]]}
    assert records.profiles["norm"].odd(records.profiled_ids) == []
