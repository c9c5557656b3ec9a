"""``--use_cache``: geometry of answers lm-eval read from its cache, and resumed runs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
from harness_cli import check_ok, require_startup_hook, run_cli

pytestmark = pytest.mark.slow

METRICS = ("lss", "logit_lens_entropy", "tv_to_target", "fixation_depth", "coupling")


def _rows(db: Path) -> int:
    with sqlite3.connect(db) as connection:
        return connection.execute("SELECT COUNT(*) FROM geometry").fetchone()[0]


@pytest.fixture(scope="module")
def cache_runs(harness_setup):
    """``--limit 2``, half the geometry cache deleted, then ``--limit 4`` twice."""
    require_startup_hook()
    cwd = harness_setup.root / "run_cache"
    cache = cwd / "cache" / "lm"
    base = [*harness_setup.args("gpt2", 4), "--metrics", "all", "--use_cache", str(cache)]
    first = check_ok(run_cli("lm_eval", [*base, "--limit", "2"], cwd))
    db = Path(f"{cache}_geometry_rank0.db")
    n_first = _rows(db)
    with sqlite3.connect(db) as connection:
        connection.execute("DELETE FROM geometry WHERE rowid % 2 = 0")
    resumed = check_ok(run_cli("lm_eval", [*base, "--limit", "4"], cwd))
    n_resumed = _rows(db)
    rerun = check_ok(run_cli("lm_eval", [*base, "--limit", "4"], cwd))
    return {
        "first": first,
        "resumed": resumed,
        "rerun": rerun,
        "rows": (n_first, n_resumed, _rows(db)),
    }


def _assert_same_geometry(run, reference, max_doc: int, tol: float) -> None:
    for task in run.samples:
        expected = reference.docs(task)
        docs = run.docs(task)
        assert sorted(docs) == [d for d in sorted(expected) if d < max_doc]
        for doc_id, row in docs.items():
            for name in METRICS:
                assert row[name] == pytest.approx(expected[doc_id][name], abs=tol), (task, name)
            assert row["metrics"] == expected[doc_id]["metrics"]


def test_cache_holds_one_row_per_document(cache_runs):
    n_first, n_resumed, n_rerun = cache_runs["rows"]
    n_docs = sum(len(cache_runs["resumed"].docs(task)) for task in cache_runs["resumed"].samples)
    assert n_first == sum(len(cache_runs["first"].docs(t)) for t in cache_runs["first"].samples)
    assert n_resumed == n_docs == n_rerun


def test_resumed_run_equals_an_uninterrupted_one(cache_runs, metrics_run):
    _assert_same_geometry(cache_runs["first"], metrics_run, 2, 1e-5)
    _assert_same_geometry(cache_runs["resumed"], metrics_run, 4, 1e-5)


def test_rerun_from_cache_equals_first_run(cache_runs):
    _assert_same_geometry(cache_runs["rerun"], cache_runs["resumed"], 4, 1e-6)
    for task, document in cache_runs["rerun"].geometry.items():
        other = cache_runs["resumed"].geometry[task]
        assert document["n_documents"] == other["n_documents"]
        for name, summary in document["profiles"].items():
            expected = np.asarray(other["profiles"][name]["mean"], dtype=float)
            np.testing.assert_allclose(
                np.asarray(summary["mean"], dtype=float), expected, atol=1e-6
            )


# -- the cache's identity and completeness, on real models (no lm-eval run) --


def _geometry(**values: float):
    from lm_coupling.geometry import DocumentGeometry

    return DocumentGeometry(values=dict(values))


def test_weights_fingerprint_changes_when_a_checkpoint_is_retrained_in_place(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from lm_coupling.harness.cache import weights_fingerprint

    path = tmp_path / "checkpoint"
    tiny_model("gpt2", seed=3).save_pretrained(path)
    first = weights_fingerprint(AutoModelForCausalLM.from_pretrained(path))
    assert weights_fingerprint(AutoModelForCausalLM.from_pretrained(path)) == first
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[-1, -1] += 1e-3  # one training step, say
    model.save_pretrained(path)
    assert weights_fingerprint(AutoModelForCausalLM.from_pretrained(path)) != first


def test_entries_of_another_identity_are_never_served(tmp_path):
    from lm_coupling.harness.cache import GeometryCache

    key = ("context", " answer")
    GeometryCache(tmp_path / "g.db", {"weights": "a"}).put(key, _geometry(lss=1.5))
    assert GeometryCache(tmp_path / "g.db", {"weights": "b"}).get(key) is None
    assert GeometryCache(tmp_path / "g.db", {"weights": "a"}).get(key).values == {"lss": 1.5}


def _session(tiny_model, tmp_path, timeout: float = 60.0):
    from lm_coupling.geometry import GeometryRunner
    from lm_coupling.harness.cache import GeometryCache
    from lm_coupling.harness.plan import DocumentPlan
    from lm_coupling.harness.session import GeometrySession
    from lm_coupling.selection import make_selection

    selection = make_selection("lss,coupling", "coupling_docs=all")
    session = GeometrySession(
        selection,
        runner=GeometryRunner(tiny_model("gpt2"), selection),
        cache=GeometryCache(tmp_path / "g.db", {"run": 1}, timeout=timeout),
    )
    key = ("context", " answer")
    plan = DocumentPlan("task", 0, key, "loglikelihood", frozenset({"coupling"}))
    session.plans.plans_by_key[key].append(plan)
    return session.measurements, key


def test_an_entry_lacking_a_metric_is_recomputed(tiny_model, tmp_path):
    store, key = _session(tiny_model, tmp_path)
    store.cache.put(key, _geometry(lss=1.5))  # written by a run that sampled no coupling
    assert store.lookup(key) is None
    store.cache.put(key, _geometry(lss=1.5, coupling=0.25))
    assert store.lookup(key).values == {"lss": 1.5, "coupling": 0.25}
    assert store.sources[key] == "cached"


def test_a_busy_shared_cache_never_turns_values_into_nan(tiny_model, tmp_path):
    import sqlite3
    import warnings

    from lm_coupling.errors import GeometryWarning

    store, key = _session(tiny_model, tmp_path, timeout=0.05)
    other_run = sqlite3.connect(tmp_path / "g.db", isolation_level=None)
    other_run.execute("BEGIN EXCLUSIVE")  # another run sharing the prefix is writing
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store.store(key, _geometry(lss=1.5, coupling=0.25), "in_batch")
            store.store(("other", " answer"), _geometry(lss=2.0), "in_batch")
    finally:
        other_run.execute("ROLLBACK")
        other_run.close()
    assert store.measured[key].values == {"lss": 1.5, "coupling": 0.25}
    assert key not in store.failed_keys and store.sources[key] == "in_batch"
    (warning,) = [w for w in caught if issubclass(w.category, GeometryWarning)]
    assert "could not be written" in str(warning.message)


def test_capture_counts_say_where_each_document_came_from(cache_runs):
    for document in cache_runs["first"].geometry.values():
        n_docs = document["n_documents"]
        assert document["capture"] == {"in_batch": n_docs, "alone": 0, "cached": 0, "failed": 0}
    for task, document in cache_runs["resumed"].geometry.items():
        capture, n_docs = document["capture"], document["n_documents"]
        # Documents 0-1 came from lm-eval's cache: their geometry from the geometry
        # cache, or (the deleted rows) measured alone; the new ones in the batch.
        assert capture["failed"] == 0 and sum(capture.values()) == n_docs, task
        assert capture["in_batch"] == n_docs - min(2, n_docs), task
    assert sum(d["capture"]["alone"] for d in cache_runs["resumed"].geometry.values()) > 0
    assert sum(d["capture"]["cached"] for d in cache_runs["resumed"].geometry.values()) > 0
    for document in cache_runs["rerun"].geometry.values():
        n_docs = document["n_documents"]
        assert document["capture"] == {"in_batch": 0, "alone": 0, "cached": n_docs, "failed": 0}
