"""A third-party metric gets block Jacobian factors through ``lmc_jacobian_request``.

No harness, capture or output module knows a built-in plugin by name: a
plugin defined here asks for its own K and reads the factors the engine
computed, exactly as the built-in coupling plugin does.
"""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling import hookimpl
from lm_coupling.errors import ConfigurationError
from lm_coupling.geometry import GeometryRunner
from lm_coupling.jacobian.engine import naive_block_jacobians
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.manager import MetricRegistry, new_plugin_manager
from lm_coupling.plugins.specs import JacobianRequest, MetricSpec
from lm_coupling.selection import make_selection


class TopSingularValues:
    """``top3``: the mean over blocks of the sum of the top-3 singular values of J^l."""

    def __init__(self, answer: bool = True, method: str = "dense"):
        self.answer, self.method = answer, method

    @hookimpl
    def lmc_declare_metrics(self):
        return [
            MetricSpec(
                "top3",
                "sum of the top-3 singular values of each block Jacobian, mean over blocks",
                frozenset({"jacobian"}),
                sampled=True,
            )
        ]

    @hookimpl
    def lmc_jacobian_request(self, selected, d_model):
        if "top3" not in selected or not self.answer:
            return None
        return JacobianRequest(k=3, method=self.method)

    @hookimpl
    def lmc_compute_batch(self, selected, states):
        if "top3" not in selected or not states.jacobians:
            return None
        values = [
            f.S[:, :3].sum(dim=1).mean() if f is not None else torch.tensor(math.nan)
            for f in states.jacobians
        ]
        return {"values": {"top3": torch.stack(values).double()}}


def _runner(model, plugin, metrics="top3", metric_args=None):
    pm = new_plugin_manager(load_entry_points=False)
    pm.register(plugin, name="test.top3")
    selection = make_selection(metrics, metric_args, MetricRegistry(pm))
    return GeometryRunner(model, selection, plugin_manager=pm)


def test_a_plugin_defined_here_gets_the_factors_it_asked_for(tiny_model):
    model = tiny_model("gpt2", dtype=torch.float64)
    runner = _runner(model, TopSingularValues())
    ids = torch.arange(3, 15)
    (doc,) = runner.compute_sampled_batch([ids])
    assert runner.engine.k_max == 3  # its own K, not coupling's default 10
    J = naive_block_jacobians(model, locate_model_parts(model), ids)
    expected = torch.linalg.svdvals(J)[:, :3].sum(dim=1).mean().item()
    assert doc.values["top3"] == pytest.approx(expected, rel=1e-8)


def test_requests_are_united_with_the_built_in_coupling(tiny_model):
    model = tiny_model("gpt2", dtype=torch.float64)
    runner = _runner(model, TopSingularValues(), metrics="top3,coupling,coupling_swapped")
    # The largest K, the swapped matrix, and the named route over coupling's "auto".
    assert runner.jacobian_request() == JacobianRequest(k=10, swapped=True, method="dense")


def test_a_jacobian_metric_without_a_request_is_a_clear_error(tiny_model):
    runner = _runner(tiny_model("gpt2"), TopSingularValues(answer=False))
    with pytest.raises(ConfigurationError, match="lmc_jacobian_request"):
        runner.compute_sampled_batch([torch.arange(3, 9)])


def test_disagreeing_routes_are_refused(tiny_model):
    plugin = TopSingularValues(method="krylov")
    runner = _runner(tiny_model("gpt2"), plugin, "top3,coupling", "jacobian_method=dense")
    with pytest.raises(ConfigurationError, match="different routes"):
        runner.jacobian_request()


def test_engine_options_reach_the_engine_settings(tiny_model):
    from lm_coupling.plugins.manager import get_registry

    selection = make_selection(
        "coupling", "jacobian_seed=3,jacobian_chunk_size=16,jacobian_tol=1e-7", get_registry()
    )
    runner = GeometryRunner(tiny_model("gpt2"), selection)
    config = runner.engine.config
    assert (config.seed, config.chunk_size, config.tol) == (3, 16, 1e-7)
    assert config.keep_bytes is None and config.check is True  # defaults: the engine chooses


def test_a_bad_engine_option_stops_before_anything_runs():
    from lm_coupling.plugins.manager import get_registry

    with pytest.raises(ConfigurationError, match="jacobian_chunk_size"):
        make_selection("coupling", "jacobian_chunk_size=-4", get_registry())
