"""GeometryRunner against states and Jacobians captured independently of capture/.

The reference route here uses only Hugging Face's own outputs and plain torch
hooks: ``output_hidden_states`` for x^0..x^{L-1} (block inputs), a forward hook
on the last block for x^L (before the final norm), the model's own logits, and
central finite differences for the block Jacobians. The math is the public
functions of ``lm_coupling.metrics``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lm_coupling.geometry import GeometryRunner
from lm_coupling.metrics.coupling import (
    coupling_matrices_dense,
    coupling_score,
    miscoupling,
    top_k_svd,
)
from lm_coupling.metrics.trajectory import equidistance, expodistance, line_shape_score
from lm_coupling.plugins.manager import get_registry, new_plugin_manager
from lm_coupling.plugins.specs import used_k
from lm_coupling.selection import make_selection

ARCHITECTURES = ("gpt2", "llama", "gpt_neox")
TRAJECTORY = ("lss", "expodistance", "equidistance")
PROMPT = "Question: Which property of a mineral can be seen? Answer:"
TARGET = 7

# Where each architecture keeps its blocks and final norm (independent of capture/).
_BLOCKS = {
    "gpt2": lambda m: m.transformer.h,
    "llama": lambda m: m.model.layers,
    "gpt_neox": lambda m: m.gpt_neox.layers,
}
_FINAL_NORM = {
    "gpt2": lambda m: m.transformer.ln_f,
    "llama": lambda m: m.model.norm,
    "gpt_neox": lambda m: m.gpt_neox.final_layer_norm,
}


@pytest.fixture(scope="module")
def plugin_manager():
    """Built-in metrics only: the values must not depend on installed plugins."""
    return new_plugin_manager(load_entry_points=False)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    assert ids.numel() >= 8
    return ids


def _runner(model, plugin_manager, metrics="all", metric_args=None):
    selection = make_selection(metrics, metric_args, registry=get_registry(plugin_manager))
    return GeometryRunner(model, selection, plugin_manager)


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def reference_forward(model, input_ids):
    """States ``[T, L+1, d]`` (model dtype) and the logits ``[T, V]`` of one prompt."""
    captured = []
    block = _BLOCKS[model.config.model_type](model)[-1]
    handle = block.register_forward_hook(lambda mod, args, out: captured.append(_hidden(out)))
    try:
        with torch.no_grad():
            out = model(input_ids[None], output_hidden_states=True)
    finally:
        handle.remove()
    n_layers = model.config.num_hidden_layers
    states = [*out.hidden_states[:n_layers], captured[0]]
    return torch.stack(states, dim=2)[0], out.logits[0]


def reference_trajectory(states, mask):
    """Per-document trajectory metrics from dense states ``[T, L+1, d]`` over ``mask``."""
    x = states.double() if states.dtype == torch.float64 else states.float()
    steps = (x[:, 1:] - x[:, :-1]).norm(dim=-1)
    per_token = {
        "lss": line_shape_score(x),
        "expodistance": expodistance(x.norm(dim=-1)),
        "equidistance": equidistance(steps),
    }
    return {name: values[mask].mean() for name, values in per_token.items()}


def _tolerance(dtype):
    return {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 1e-6}


def _as_tensor(value, like):
    return torch.tensor(value, dtype=like.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_trajectory_metrics_match_dense_reference(
    tiny_model, plugin_manager, prompt_ids, model_type, dtype
):
    model = tiny_model(model_type, dtype=dtype)
    doc = _runner(model, plugin_manager, "lss,expodistance,equidistance").measure_prompt(prompt_ids)
    states, _ = reference_forward(model, prompt_ids)
    mask = torch.arange(prompt_ids.numel()) >= 1  # context tokens 1..n
    expected = reference_trajectory(states, mask)
    for name in TRAJECTORY:
        assert math.isfinite(doc.values[name]), name
        got = _as_tensor(doc.values[name], expected[name])
        torch.testing.assert_close(got, expected[name], **_tolerance(dtype), msg=name)
    norm = torch.as_tensor(doc.profiles["norm"])
    expected_norm = states[1:].double().norm(dim=-1).mean(dim=0)
    torch.testing.assert_close(norm, expected_norm, **_tolerance(dtype))


def _entropy(logits):
    """``H(softmax(logits)) / ln V`` over the last axis (``entr(p) = -p ln p``, 0 at p = 0)."""
    return torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1) / math.log(logits.shape[-1])


def _lens_reference(model, states, logits, target):
    """Entropy and 1 - P^l(target) at n for l = 0..L, by the model's own norm and head."""
    final_norm = _FINAL_NORM[model.config.model_type](model)
    with torch.no_grad():
        lens_logits = model.get_output_embeddings()(final_norm(states[-1]))  # [L+1, V]
    entropy = _entropy(lens_logits.double())
    tv = 1 - torch.softmax(lens_logits.double(), dim=-1)[:, target]
    own = logits[-1].double()
    return entropy, tv, _entropy(own), 1 - torch.softmax(own, dim=-1)[target]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_lens_metrics_match_the_model_output(
    tiny_model, plugin_manager, prompt_ids, model_type, dtype
):
    model = tiny_model(model_type, dtype=dtype)
    runner = _runner(model, plugin_manager, "logit_lens_entropy,tv_to_target")
    doc = runner.measure_prompt(prompt_ids, target_token=TARGET)
    states, logits = reference_forward(model, prompt_ids)
    entropy, tv, own_entropy, own_tv = _lens_reference(model, states, logits, TARGET)
    profile_entropy = torch.as_tensor(doc.profiles["logit_lens_entropy"])
    profile_tv = torch.as_tensor(doc.profiles["tv_to_target"])
    tol = _tolerance(dtype) if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    # The lens's last layer is the model's own next-token distribution.
    torch.testing.assert_close(profile_entropy[-1], own_entropy, **tol)
    torch.testing.assert_close(profile_tv[-1], own_tv, **tol)
    torch.testing.assert_close(profile_entropy, entropy, **tol)
    torch.testing.assert_close(profile_tv, tv, **tol)
    torch.testing.assert_close(
        _as_tensor(doc.values["logit_lens_entropy"], entropy), entropy.mean(), **tol
    )
    torch.testing.assert_close(_as_tensor(doc.values["tv_to_target"], tv), tv.mean(), **tol)
    assert 0 <= doc.values["logit_lens_entropy"] <= 1


class _Stop(Exception):
    """Ends a forward pass once the block under study has run."""


def _perturbed_residuals(model, block, input_ids, directions):
    """``block(X + delta_i e_n)_n - (x_n + delta_i)`` for each row delta_i of ``directions``."""
    n, record = input_ids.numel() - 1, {}

    def perturb(module, args, kwargs):
        key = "hidden_states" if not args else None
        hidden = (kwargs[key] if key else args[0]).clone()
        hidden[:, n] += directions.to(hidden.dtype)
        record["input"] = hidden[:, n]
        if key:
            return args, {**kwargs, key: hidden}
        return (hidden, *args[1:]), kwargs

    def read(module, args, output):
        record["residual"] = _hidden(output)[:, n] - record["input"]
        raise _Stop

    handles = [
        block.register_forward_pre_hook(perturb, with_kwargs=True),
        block.register_forward_hook(read),
    ]
    try:
        with torch.no_grad(), pytest.raises(_Stop):
            model(input_ids[None].repeat(directions.shape[0], 1))
    finally:
        for handle in handles:
            handle.remove()
    return record["residual"]


def finite_difference_jacobians(model, input_ids, step=1e-3):
    """``J^l = d(block_l(X)_n - x^{l-1}_n)/d x^{l-1}_n`` ``[L, d, d]`` by finite differences.

    Block l runs on the full sequence inside the model's own forward; a
    pre-hook perturbs x^{l-1}_n (all 4d perturbations as one batch), every
    other position stays fixed. Fourth-order central differences
    ``(8(f(h) - f(-h)) - (f(2h) - f(-2h))) / 12h``: even a float64 Llama or
    GPT-NeoX rounds to float32 inside transformers (RMSNorm, eager softmax),
    so the step must stay well above float32 resolution.
    """
    d = model.config.hidden_size
    eye = torch.eye(d, dtype=torch.float64) * step
    directions = torch.cat([eye, -eye, 2 * eye, -2 * eye])  # [4d, d]
    jacobians = []
    for block in _BLOCKS[model.config.model_type](model):
        residual = _perturbed_residuals(model, block, input_ids, directions)
        plus, minus, plus2, minus2 = residual.double().split(d)  # row i: f(x +- h e_i)
        jacobians.append(((8 * (plus - minus) - (plus2 - minus2)) / (12 * step)).T)
    return torch.stack(jacobians)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_coupling_matches_finite_difference_jacobians(
    tiny_model, plugin_manager, prompt_ids, model_type
):
    model = tiny_model(model_type, dtype=torch.float64)
    runner = _runner(model, plugin_manager, "coupling", "k=6")
    doc = runner.measure_prompt(prompt_ids)
    J = finite_difference_jacobians(model, prompt_ids)
    k = used_k(6, model.config.hidden_size)
    U, S, V = top_k_svd(J, k)
    expected = coupling_score(miscoupling(coupling_matrices_dense(J, U, V), S))
    assert math.isfinite(doc.values["coupling"])
    torch.testing.assert_close(
        _as_tensor(doc.values["coupling"], expected), expected, rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        torch.as_tensor(doc.profiles["singular_values"])[:, :k], S, rtol=1e-5, atol=1e-6
    )
    assert doc.jacobian_methods == ["gram"] * model.config.num_hidden_layers


def test_single_token_prompt_gives_nan_trajectory(tiny_model, plugin_manager, prompt_ids):
    model = tiny_model("gpt2")
    runner = _runner(model, plugin_manager, "all", "alignment_k=4")
    doc = runner.measure_prompt(prompt_ids[:1], target_token=TARGET)
    for name in TRAJECTORY:
        assert math.isnan(doc.values[name]), name
    # Position 0 alone still has a lens and Jacobians at n = 0.
    for name in ("logit_lens_entropy", "tv_to_target", "fixation_depth", "coupling"):
        assert math.isfinite(doc.values[name]), name


def test_runs_are_deterministic(tiny_model, plugin_manager, prompt_ids):
    metrics = "lss,expodistance,equidistance,logit_lens_entropy,tv_to_target,coupling"
    runner = _runner(tiny_model("llama"), plugin_manager, metrics)
    first = runner.measure_prompt(prompt_ids, target_token=TARGET)
    second = runner.measure_prompt(prompt_ids, target_token=TARGET)
    assert set(first.values) == set(metrics.split(","))
    assert first.values == second.values
    assert first.profiles.keys() == second.profiles.keys()
    for name, profile in first.profiles.items():
        np.testing.assert_array_equal(profile, second.profiles[name], err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_is_measured_in_float32(tiny_model, plugin_manager, prompt_ids, dtype):
    model = tiny_model("gpt2", dtype=dtype)
    runner = _runner(model, plugin_manager, "all", "alignment_k=4")
    doc = runner.measure_prompt(prompt_ids, target_token=TARGET)
    assert set(doc.values) == set(runner.selection.metrics)
    for name, value in doc.values.items():
        assert isinstance(value, float) and math.isfinite(value), name
    # The same half-precision states, summarised in float32 by the reference.
    states, _ = reference_forward(model, prompt_ids)
    assert states.dtype == dtype
    expected = reference_trajectory(states.float(), torch.arange(prompt_ids.numel()) >= 1)
    for name in TRAJECTORY:
        got = _as_tensor(doc.values[name], expected[name])
        torch.testing.assert_close(got, expected[name], rtol=2e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_tokens_last_is_the_value_at_n(tiny_model, plugin_manager, prompt_ids, model_type):
    model = tiny_model(model_type, dtype=torch.float64)
    metrics = "lss,expodistance,equidistance"
    every = _runner(model, plugin_manager, metrics).measure_prompt(prompt_ids)
    last = _runner(model, plugin_manager, metrics, "tokens=last").measure_prompt(prompt_ids)
    states, _ = reference_forward(model, prompt_ids)
    n = prompt_ids.numel() - 1
    expected = reference_trajectory(states, torch.arange(n + 1) == n)
    for name in TRAJECTORY:
        assert last.values[name] != every.values[name], name
        got = _as_tensor(last.values[name], expected[name])
        torch.testing.assert_close(got, expected[name], rtol=1e-9, atol=1e-12, msg=name)
