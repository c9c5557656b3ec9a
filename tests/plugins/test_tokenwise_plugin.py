"""Token-wise coupling metrics through GeometryRunner, against Jacobians computed apart."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lm_coupling.geometry import GeometryRunner
from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.metrics.tokenwise import (
    context_coupling_fixed_input,
    context_coupling_fixed_output,
    mean_offdiagonal,
    pairwise_coupling,
)
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.builtin.tokenwise import lmc_position_jacobian_keys, resolve_layers
from lm_coupling.plugins.manager import new_plugin_manager
from lm_coupling.selection import make_selection

NAMES = "tokenwise_self_coupling,tokenwise_context_fixed_input,tokenwise_context_fixed_output"
PROMPT = "Question: Which property of a mineral can be seen? Answer:"
P, K = 3, 4


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gpt2", dtype=torch.float64)


@pytest.fixture(scope="module")
def measured(model, tokenizer):
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    args = f"tokenwise_layers=0:-1,tokenwise_positions={P},tokenwise_k={K}"
    runner = GeometryRunner(model, make_selection(NAMES, args), new_plugin_manager(False))
    return ids, runner.measure_prompt(ids)


def test_self_coupling_at_n_matches_the_dense_block_jacobians(model, measured):
    ids, doc = measured
    parts = locate_model_parts(model)
    dense = JacobianEngine(model, parts, k_max=K, method="dense").dense_jacobians(ids)
    # Rows (block, t) block-major; t = n is the last of each block's P rows.
    matrix = doc.profiles["tokenwise_self_coupling"]
    assert matrix.shape == (2 * P, 2 * P)
    at_n = matrix[np.ix_([P - 1, 2 * P - 1], [P - 1, 2 * P - 1])]
    expected = pairwise_coupling(dense[[0, parts.n_layers - 1]], K).numpy()
    np.testing.assert_allclose(at_n, expected, atol=1e-6)
    off = ~np.eye(2 * P, dtype=bool)
    assert np.isfinite(matrix).all()
    assert doc.values["tokenwise_self_coupling"] == pytest.approx(matrix[off].mean())


def test_context_couplings_match_the_library_on_position_jacobians(model, measured):
    ids, doc = measured
    engine = JacobianEngine(model, locate_model_parts(model), k_max=K, method="dense")
    n, L = len(ids) - 1, locate_model_parts(model).n_layers
    for i, layer in enumerate((0, L - 1)):
        fixed_in = {(layer, n - P + 1, t): engine.position_jacobian(ids, layer, n - P + 1, t)
                    for t in range(n - P + 1, n + 1)}  # fmt: skip
        ts, c = context_coupling_fixed_input(fixed_in, layer, n - P + 1, K)
        assert ts == list(range(n - P + 1, n + 1))
        got = doc.profiles["tokenwise_context_fixed_input"][i]
        np.testing.assert_allclose(got, c.numpy(), atol=1e-6)
        fixed_out = {(layer, t, n): engine.position_jacobian(ids, layer, t, n)
                     for t in range(n - P + 1, n + 1)}  # fmt: skip
        _, c = context_coupling_fixed_output(fixed_out, layer, n, K)
        np.testing.assert_allclose(
            doc.profiles["tokenwise_context_fixed_output"][i], c.numpy(), atol=1e-6
        )
    for name in ("tokenwise_context_fixed_input", "tokenwise_context_fixed_output"):
        stack = doc.profiles[name]
        off = ~np.eye(P, dtype=bool)
        assert doc.values[name] == pytest.approx(stack[:, off].mean())
        np.testing.assert_allclose(np.diagonal(stack, axis1=1, axis2=2), 1.0, atol=1e-9)


def test_a_prompt_shorter_than_p_leaves_nan_rows_aligned_to_n(model, tokenizer):
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"][:2])
    args = "tokenwise_layers=all,tokenwise_positions=4,tokenwise_k=3"
    selection = make_selection("tokenwise_self_coupling", args)
    doc = GeometryRunner(model, selection, new_plugin_manager(False)).measure_prompt(ids)
    matrix = doc.profiles["tokenwise_self_coupling"]
    L = locate_model_parts(model).n_layers
    assert matrix.shape == (4 * L, 4 * L)
    present = [b * 4 + s for b in range(L) for s in (2, 3)]  # positions n-1 and n
    assert np.isfinite(matrix[np.ix_(present, present)]).all()
    missing = [b * 4 + s for b in range(L) for s in (0, 1)]
    assert np.isnan(matrix[missing]).all() and np.isnan(matrix[:, missing]).all()
    assert math.isfinite(doc.values["tokenwise_self_coupling"])


def test_requested_position_jacobians_are_bounded_by_layers_and_positions():
    options = {"tokenwise_positions": 4, "tokenwise_layers": (0, -1)}
    keys = lmc_position_jacobian_keys(NAMES.split(","), options, n_layers=6, n_tokens=20)
    assert len(keys) == 2 * (3 * 4 - 3)  # 3P - 3 per block
    assert {k[0] for k in keys} == {0, 5}
    assert all(16 <= t_in <= t_out <= 19 for _, t_in, t_out in keys)
    only_self = lmc_position_jacobian_keys(["tokenwise_self_coupling"], options, 6, 20)
    assert only_self == sorted((layer, t, t) for layer in (0, 5) for t in range(16, 20))
    assert lmc_position_jacobian_keys(["coupling"], options, 6, 20) is None


def test_layer_option_is_checked_against_the_model():
    assert resolve_layers((0, -1), 4) == [0, 3]
    assert resolve_layers(None, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="outside the model's 4 blocks"):
        resolve_layers((4,), 4)
    with pytest.raises(Exception, match="tokenwise_layers"):
        make_selection("tokenwise_self_coupling", "tokenwise_layers=0:x")


def test_mean_offdiagonal_closed_form_and_nan_handling():
    c = torch.tensor([[1.0, 0.2, float("nan")], [0.4, 1.0, 0.6], [0.8, float("nan"), 1.0]])
    assert mean_offdiagonal(c).item() == pytest.approx((0.2 + 0.4 + 0.6 + 0.8) / 4)
    assert math.isnan(mean_offdiagonal(torch.ones(1, 1)).item())


def test_tokenwise_metrics_are_opt_in_and_sampled_on_their_own_option():
    selection = make_selection("all")
    assert not any(name.startswith("tokenwise") for name in selection.metrics)
    spec = make_selection("tokenwise_self_coupling").specs["tokenwise_self_coupling"]
    assert spec.opt_in and spec.sampled and spec.sample_option == "tokenwise_docs"
    assert spec.matrices == ("tokenwise_self_coupling",) and spec.k_option == "tokenwise_k"
