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
