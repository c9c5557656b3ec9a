"""Pooled reduction: lm-eval's batches reduced together give each batch's own values.

Two in-process runs through `lm_coupling.evaluate` on a log-likelihood task
and a generation task (right and left padding), batch size 2: one with the
default pool, one with ``POOL_ROWS = 1`` (every batch reduced alone, as
before pooling). An observer plugin records the size of every batch the
plugins compute, so the test can see that the pool did join batches.
"""

from __future__ import annotations

import math

import pytest
from harness_cli import plugin_registered

import lm_coupling
from lm_coupling import hookimpl
from lm_coupling.harness import batch_pool

pytestmark = pytest.mark.slow

TASKS = ["lmc_arc_easy_offline", "lmc_gsm8k_offline"]
METRICS = "lss,expodistance,equidistance,logit_lens_entropy,tv_to_target"


class BatchSizes:
    """An observer (declares no metric): the rows of every batch the plugins compute."""

    def __init__(self):
        self.sizes: list[int] = []

    @hookimpl
    def lmc_compute_batch(self, states):
        self.sizes.append(states.size)


def _writing_block_1_output_in_place(patch: pytest.MonkeyPatch) -> None:
    """Make block 2 write its input, x^1, in place (same values: only its version moves)."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaDecoderLayer.forward

    def writes_its_input(self, hidden_states, *args, **kwargs):
        if self.self_attn.layer_idx == 1:
            hidden_states.mul_(1.0)
        return forward(self, hidden_states, *args, **kwargs)

    patch.setattr(modeling_llama.LlamaDecoderLayer, "forward", writes_its_input)


def _run(
    harness_setup, output, pool_rows: int | None, in_place: bool = False
) -> tuple[dict, list[int]]:
    observer = BatchSizes()
    with pytest.MonkeyPatch.context() as patch:
        if pool_rows is not None:
            patch.setattr(batch_pool, "POOL_ROWS", pool_rows)
        if in_place:
            _writing_block_1_output_in_place(patch)
        with plugin_registered(observer, "test.batch_sizes"):
            results = lm_coupling.evaluate(
                model_args={"pretrained": str(harness_setup.models["llama"])},
                tasks=TASKS,
                metrics=METRICS,
                batch_size=2,
                device="cpu",
                num_fewshot=0,
                gen_kwargs={"max_gen_toks": 8},
                log_samples=True,
                metadata={"lmc_data_dir": str(harness_setup.data_dir)},
                output_path=str(output),
            )
    return results, observer.sizes


@pytest.fixture(scope="module")
def pooled_and_alone(harness_setup, tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    return {
        "pooled": _run(harness_setup, root / "pooled", None),
        "alone": _run(harness_setup, root / "alone", 1),
        # The first recording sees x^1 change under its reference and is refused;
        # the batch is recorded again, copying each state in its hook, as every later one.
        "written_in_place": _run(harness_setup, root / "in_place", None, in_place=True),
    }


def test_the_pool_joins_batches(pooled_and_alone):
    _, pooled = pooled_and_alone["pooled"]
    _, alone = pooled_and_alone["alone"]
    _, written = pooled_and_alone["written_in_place"]
    assert sum(pooled) == sum(alone) == sum(written) >= 10  # every measured row, once each
    assert max(alone) <= 2 < max(pooled)  # batch size 2 alone; several batches pooled
    assert len(pooled) < len(alone)


def _measured(results: dict, task: str) -> dict[int, dict]:
    """The logged rows that carry geometry, by document (a generation task logs one row
    per filter; the geometry is on the first)."""
    return {row["doc_id"]: row for row in results["samples"][task] if "lss" in row}


@pytest.mark.parametrize("task", TASKS)
def test_pooled_values_equal_each_batch_reduced_alone(pooled_and_alone, task):
    pooled = _measured(pooled_and_alone["pooled"][0], task)
    alone = _measured(pooled_and_alone["alone"][0], task)
    written = _measured(pooled_and_alone["written_in_place"][0], task)
    assert sorted(pooled) == sorted(alone) == sorted(written) == [0, 1, 2, 3, 4]
    for doc_id, row in pooled.items():
        for metric in METRICS.split(","):
            value = row[metric]
            assert math.isfinite(value), (task, doc_id, metric)
            assert value == pytest.approx(alone[doc_id][metric], rel=1e-6, abs=1e-9), metric
            assert value == pytest.approx(written[doc_id][metric], rel=1e-6, abs=1e-9), metric
    for results, _ in pooled_and_alone.values():
        capture = results["config"]["lm_coupling"]["capture"][task]
        assert capture == {"in_batch": 5, "alone": 0, "cached": 0, "failed": 0}
