"""The capture's hot path: per-batch work, no per-document host reads.

A benchmark batch is measured as a batch: the rows it measures are chosen once
(`StateCollector.capture(rows=...)`: a multiple-choice batch's other rows are
the same documents' other answers), the logit lens of every state is read in
one call per batch (the stacked route of the built-in lens reducer), and the
values reach the host once per batch and metric, never once per document.
Each is checked against an independent computation: the full batch, the
per-state lens, and the number of host reads at two batch sizes.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.host_reads import HostReads
from fixtures.prompts import PROMPTS, TRAJ_LENS, right_padded

from lm_coupling.capture.collector import StateCollector
from lm_coupling.capture.lens import LogitLens
from lm_coupling.geometry import GeometryRunner
from lm_coupling.metrics.lens import lens_summary
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.builtin.lens import LensReducer
from lm_coupling.plugins.builtin.trajectory import TrajectoryReducer
from lm_coupling.plugins.manager import get_registry, new_plugin_manager
from lm_coupling.selection import make_selection


class _Keep:
    """Keeps every view's lens logits (the per-state route)."""

    def __init__(self, batch):
        self.logits = []

    def update(self, view):
        self.logits.append(view.logits)

    def finalize(self):
        return torch.stack(self.logits, dim=1)  # [B, L+1, V]


def _reducers():
    return {
        "trajectory": lambda batch: TrajectoryReducer(batch, True, "all"),
        "lens": LensReducer,
    }


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_measured_rows_are_the_full_batchs_rows(model_type, tiny_model, tokenizer):
    model = tiny_model(model_type)
    parts = locate_model_parts(model)
    batch, last, target = right_padded(tokenizer, PROMPTS[:4])
    collector = StateCollector(model, parts, lens=LogitLens(parts))
    first = torch.zeros_like(last)
    with torch.no_grad(), collector.capture(last, first, target, _reducers()) as full:
        model(batch)
    rows = torch.tensor([0, 2, 3])
    docs = [[("t", 0)], [("t", 2)], [("t", 3)]]
    with (
        torch.no_grad(),
        collector.capture(last[rows], first[rows], target[rows], _reducers(), docs, rows) as part,
    ):
        model(batch)
    assert part.errors == {} and part.states.size == 3 and part.info.size == 3
    assert part.states.documents[1][0].doc_id == 2
    for name in ("trajectory", "lens"):
        for field, value in vars(full.reduced[name]).items():
            want = value[rows]
            torch.testing.assert_close(
                getattr(part.reduced[name], field), want, equal_nan=True, atol=1e-6, rtol=1e-5
            )


def test_rows_must_be_increasing_rows_of_the_batch(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)
    batch, last, target = right_padded(tokenizer, PROMPTS[:3])
    collector = StateCollector(model, parts, lens=LogitLens(parts))
    first = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="increasing"):
        with collector.capture(last[:2], first, target[:2], {}, None, [2, 0]):
            pass
    with pytest.raises(ValueError, match="batch size 3"):
        with (
            torch.no_grad(),
            collector.capture(last[:2], first, target[:2], _reducers(), None, [0, 5]),
        ):
            model(batch)


@pytest.mark.parametrize("lens_kind", ["logit", "plugged"])
def test_the_stacked_lens_equals_the_lens_of_each_state(lens_kind, tiny_model, tokenizer):
    model = tiny_model("llama")
    parts = locate_model_parts(model)

    class Shifted(LogitLens):  # another lens: the stacked route calls it once per state
        name = "shifted"

        def logits(self, layer, hidden):
            return super().logits(layer, hidden + 0.1 * layer)

    lens = LogitLens(parts) if lens_kind == "logit" else Shifted(parts)
    batch, last, target = right_padded(tokenizer, PROMPTS[:3])
    target[1] = -1  # a document without a target
    collector = StateCollector(model, parts, lens=lens)
    reducers = {"lens": LensReducer, "keep": _Keep}
    with torch.no_grad(), collector.capture(last, torch.zeros_like(last), target, reducers) as h:
        model(batch)
    assert h.errors == {} and h.lens_errors == {}
    per_state = h.reduced["keep"]  # read by layer, as any plugin's reducer reads it
    want = lens_summary(per_state, target)
    got = h.reduced["lens"]
    for value, expected in zip((got.entropy, got.target_prob, got.top1), want, strict=True):
        torch.testing.assert_close(value, expected, equal_nan=True, atol=1e-6, rtol=1e-5)
    assert torch.isnan(got.target_prob[1]).all() and torch.isfinite(got.target_prob[0]).all()


def test_a_failing_lens_leaves_the_stacked_reader_without_values(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)

    class Failing(LogitLens):
        name = "failing"

        def logits(self, layer, hidden):
            raise RuntimeError("lens boom")

    batch, last, target = right_padded(tokenizer, PROMPTS[:2])
    collector = StateCollector(model, parts, lens=Failing(parts))
    with torch.no_grad(), collector.capture(last, torch.zeros_like(last), target, _reducers()) as h:
        model(batch)
    assert "lens boom" in h.lens_errors["failing"]
    assert h.reduced["lens"] is None and h.reduced["trajectory"] is not None


def _host_reads(runner, model, tokenizer, prompts) -> tuple[int, list]:
    batch, last, target = right_padded(tokenizer, prompts)
    docs = [[("t", i)] for i in range(len(prompts))]
    with torch.no_grad(), HostReads() as reads:
        with runner.capture(last, torch.zeros_like(last), target, docs) as handle:
            model(batch)
        documents = runner.compute(handle)
    return reads.count, documents


def test_host_reads_per_batch_do_not_grow_with_its_documents(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    manager = new_plugin_manager(load_entry_points=False)
    selection = make_selection(TRAJ_LENS, None, registry=get_registry(manager))
    runner = GeometryRunner(model, selection, manager)
    _host_reads(runner, model, tokenizer, PROMPTS[:2])  # first calls (lazy set-up) untimed
    small, docs_small = _host_reads(runner, model, tokenizer, PROMPTS[:2])
    large, docs_large = _host_reads(runner, model, tokenizer, PROMPTS[:6])
    assert small == large, f"{small} host reads for 2 documents, {large} for 6"
    # At most one read per batch for each value and profile returned, and a few checks.
    returned = len(docs_large[0].values) + len(docs_large[0].profiles)
    assert large <= returned + 4, f"{large} host reads per batch for {returned} outputs"
    for name, value in docs_small[0].values.items():  # the same documents, the same values
        assert value == pytest.approx(docs_large[0].values[name], rel=1e-5, abs=1e-7)
