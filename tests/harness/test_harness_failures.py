"""A document whose geometry fails: NaN, one warning, and the benchmark's scores intact.

The failure is injected in-process (a plugin that raises on the second
captured batch, batch size 1) with lm-eval's own ``simple_evaluate`` inside
`lm_coupling.harness.cli.geometry_run`.
"""

from __future__ import annotations

import math
import warnings

import pytest

from lm_coupling import hookimpl
from lm_coupling.errors import GeometryWarning

pytestmark = pytest.mark.slow

TASK = "lmc_arc_easy_offline"


class FailSecondBatch:
    """Raises on the second captured forward pass (one document at batch size 1)."""

    def __init__(self):
        self.calls = 0

    @hookimpl
    def lmc_compute_batch(self, states):
        if states.trajectory is None:
            return None
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected failure")
        return None


@pytest.fixture(scope="module")
def failing_run(harness_setup):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.cli import TASKS_DIR, geometry_run
    from lm_coupling.harness.registry import register_with_lm_eval
    from lm_coupling.harness.session import GeometrySession
    from lm_coupling.plugins.manager import get_plugin_manager
    from lm_coupling.selection import make_selection

    session = GeometrySession(make_selection("lss,logit_lens_entropy"))
    register_with_lm_eval(session.selection.specs)
    pm = get_plugin_manager()
    pm.register(FailSecondBatch(), name="test.fail_second_batch")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with geometry_run(session):
                from lm_coupling.harness.model import CouplingHFLM

                model = CouplingHFLM(
                    pretrained=str(harness_setup.models["gpt2"]), batch_size=1, device="cpu"
                )
                manager = TaskManager(
                    include_path=str(TASKS_DIR),
                    include_defaults=False,
                    metadata={"lmc_data_dir": str(harness_setup.data_dir)},
                )
                results = simple_evaluate(
                    model=model, tasks=[TASK], num_fewshot=2, task_manager=manager,
                    log_samples=True,
                )  # fmt: skip
    finally:
        pm.unregister(name="test.fail_second_batch")
    geometry_warnings = [w for w in caught if issubclass(w.category, GeometryWarning)]
    return results, session, geometry_warnings


def test_one_failure_is_nan_with_one_warning(failing_run):
    results, session, geometry_warnings = failing_run
    (failure,) = session.records[TASK].failures
    assert "injected failure" in failure["error"]
    (warning,) = geometry_warnings
    message = str(warning.message)
    assert f"task {TASK!r} document {failure['doc_id']}" in message
    assert "injected failure" in message
    samples = {row["doc_id"]: row for row in results["samples"][TASK]}
    assert len(samples) == 5
    for doc_id, row in samples.items():
        has_geometry = {"lss", "logit_lens_entropy"} <= set(row)
        assert has_geometry is (doc_id != failure["doc_id"]), doc_id
    kept = [row["lss"] for row in samples.values() if "lss" in row]
    assert results["results"][TASK]["lss,none"] == pytest.approx(sum(kept) / 4, abs=1e-12)
    assert all(math.isfinite(v) for v in kept)


def _requests(arguments) -> list[tuple]:
    """lm-eval's request arguments, in-process (tuples) or as logged (``gen_args_i``)."""
    if isinstance(arguments, dict):
        ordered = sorted(arguments.items(), key=lambda item: int(item[0].rsplit("_", 1)[-1]))
        return [tuple(args[f"arg_{i}"] for i in range(len(args))) for _, args in ordered]
    return [tuple(args) for args in arguments]


def test_failure_keeps_the_benchmark_scores(failing_run, stock_run):
    results, _, _ = failing_run
    stock_docs = stock_run.docs(TASK)
    for row in results["samples"][TASK]:
        stock = stock_docs[row["doc_id"]]
        assert _requests(row["arguments"]) == _requests(stock["arguments"])
        assert row["acc"] == stock["acc"] and row["acc_norm"] == stock["acc_norm"]
    for key in ("acc,none", "acc_norm,none"):
        assert results["results"][TASK][key] == stock_run.results["results"][TASK][key]
