"""Failures inside a captured batch: NaN, one warning, and the benchmark's scores intact.

One in-process run through `lm_coupling.evaluate` (batch size 1) with two
injected faults: a plugin metric (``fault_probe``) whose plugin raises on
every batch that holds one chosen document (the forward pass succeeded; the
batch is retried row by row, so only that document's ``fault_probe`` is NaN,
and the built-ins keep their values there), and an out-of-memory error raised
inside the third captured forward pass (the whole capture failed: the
benchmark batch must be run again, outside the exception handler, once the
failed capture's tensors are freed).
"""

from __future__ import annotations

import math
import sys
import weakref

import pytest
import torch
from harness_cli import plugin_registered

import lm_coupling
from lm_coupling import hookimpl
from lm_coupling.errors import GeometryWarning
from lm_coupling.plugins import MetricSpec

pytestmark = pytest.mark.slow

TASK = "lmc_arc_easy_offline"


class Faults:
    """Raises in the plugin on one document and OOM in the 3rd captured forward."""

    @hookimpl
    def lmc_declare_metrics(self):
        return [MetricSpec("fault_probe", "0 on every document", frozenset({"hidden_states"}))]

    @hookimpl
    def lmc_layer_reducer(self):
        return None

    def __init__(self, model):
        self.model = model
        self.victim: int | None = None  # the document whose batches the plugin fails
        self.captured_forwards = 0
        self.failed_hidden: weakref.ref | None = None
        self.after_oom: tuple | None = None
        model.transformer.h[-1].register_forward_pre_hook(self.pre_hook, with_kwargs=True)

    @hookimpl
    def lmc_compute_batch(self, states):
        doc_ids = [ref.doc_id for row in states.documents for ref in row]
        if self.victim is None:  # the last document of the first batch computed
            self.victim = doc_ids[-1]
        if self.victim in doc_ids:
            raise RuntimeError("injected failure")
        return {"values": {"fault_probe": torch.zeros(states.size)}}

    def pre_hook(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if not _captured(module):  # lm-coupling's capture hooks are off
            if self.failed_hidden is not None and self.after_oom is None:
                self.after_oom = (sys.exc_info()[0], self.failed_hidden() is None)
            return None
        self.captured_forwards += 1
        if self.captured_forwards == 3:
            self.failed_hidden = weakref.ref(hidden)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return None


def _captured(block) -> bool:
    """Whether lm-coupling's capture hooks are on this block.

    They are registered for one captured forward call and removed after it
    (bound to their layer with ``functools.partial``).
    """
    return any(
        getattr(getattr(hook, "func", hook), "__module__", "").startswith("lm_coupling.capture")
        for hook in block._forward_hooks.values()
    )


@pytest.fixture(scope="module")
def failing_run(harness_setup, tmp_path_factory):

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(harness_setup.models["gpt2"])
    model = AutoModelForCausalLM.from_pretrained(path)  # in memory: the faults hook its block
    faults = Faults(model)
    with plugin_registered(faults, "test.faults") as caught:
        results = lm_coupling.evaluate(
            model=model,
            tokenizer=AutoTokenizer.from_pretrained(path),
            tasks=[TASK],
            metrics="lss,logit_lens_entropy,fault_probe",
            batch_size=1,
            device="cpu",
            output_path=str(tmp_path_factory.mktemp("failing") / "results"),
            num_fewshot=2,
            log_samples=True,
            metadata={"lmc_data_dir": str(harness_setup.data_dir)},
        )
    geometry_warnings = [w for w in caught if issubclass(w.category, GeometryWarning)]
    return results, faults, geometry_warnings


def test_failures_are_nan_with_one_warning_each(failing_run):
    results, _, geometry_warnings = failing_run
    samples = {row["doc_id"]: row for row in results["samples"][TASK]}
    assert len(samples) == 5
    failed = [doc_id for doc_id, row in samples.items() if "lss" not in row]
    assert len(failed) == 1  # the out-of-memory capture
    messages = [str(w.message) for w in geometry_warnings]
    named = [m for m in messages if f"task {TASK!r} document {failed[0]}:" in m]
    assert len(named) == 1, named
    assert any("out of memory (injected)" in m for m in messages)
    # The plugin's failure is its own: its metric is NaN on that document, named in
    # one warning; the built-ins keep their values there.
    probe_failed = [d for d, row in samples.items() if "fault_probe" not in row and d not in failed]
    assert len(probe_failed) == 1
    (plugin_warning,) = [m for m in messages if "injected failure" in m]
    assert "plugin 'test.faults'" in plugin_warning and "fault_probe" in plugin_warning
    assert f"document {probe_failed[0]}" in plugin_warning
    for doc_id, row in samples.items():
        has_geometry = {"lss", "logit_lens_entropy"} <= set(row)
        assert has_geometry is (doc_id not in failed), doc_id
    kept = [row["lss"] for row in samples.values() if "lss" in row]
    assert results["results"][TASK]["lss,none"] == pytest.approx(sum(kept) / 4, abs=1e-12)
    assert all(math.isfinite(v) for v in kept)
    capture = results["config"]["lm_coupling"]["capture"][TASK]
    assert capture == {"in_batch": 4, "alone": 0, "cached": 0, "failed": 1}
    n_measured = results["config"]["lm_coupling"]["n_measured"][TASK]
    assert n_measured["lss"] == 4 and n_measured["fault_probe"] == 3


def test_oom_batch_is_retried_outside_the_handler(failing_run):
    _, faults, _ = failing_run
    assert faults.failed_hidden is not None, "the OOM was never injected"
    exception_type, freed = faults.after_oom
    # The retry ran with no exception being handled, and the failed forward's
    # hidden states (held by the traceback's frames) were already freed.
    assert exception_type is None
    assert freed


def _requests(arguments) -> list[tuple]:
    """lm-eval's request arguments, in-process (tuples) or as logged (``gen_args_i``)."""
    if isinstance(arguments, dict):
        ordered = sorted(arguments.items(), key=lambda item: int(item[0].rsplit("_", 1)[-1]))
        return [tuple(args[f"arg_{i}"] for i in range(len(args))) for _, args in ordered]
    return [tuple(args) for args in arguments]


def test_failures_keep_the_benchmark_scores(failing_run, stock_run):
    results, _, _ = failing_run
    stock_docs = stock_run.docs(TASK)
    for row in results["samples"][TASK]:
        stock = stock_docs[row["doc_id"]]
        assert _requests(row["arguments"]) == _requests(stock["arguments"])
        assert row["acc"] == stock["acc"] and row["acc_norm"] == stock["acc_norm"]
    for key in ("acc,none", "acc_norm,none"):
        assert results["results"][TASK][key] == stock_run.results["results"][TASK][key]
