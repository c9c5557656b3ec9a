"""Modules torch.func cannot transform: Bloom's GELU stand-in, and the error naming the module."""

from __future__ import annotations

import pytest
import torch
from fixtures.transformers_range import require_fixed
from test_architectures_coupling import PROMPTS, build
from transformers.models.bloom.modeling_bloom import BloomGelu, GeLUFunction

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.harness import preflight
from lm_coupling.jacobian.calls import engine_mode
from lm_coupling.model import differentiable
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.model.differentiable import differentiable_substitutes
from lm_coupling.selection import make_selection

BLOOM_GELU = "transformers.models.bloom.modeling_bloom.BloomGelu"


@pytest.fixture(scope="module")
def bloom():
    return build("bloom", "eager")


def test_the_stand_in_is_bloom_gelu_and_only_inside_engine_mode(bloom):
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    gelus = [m for m in bloom.modules() if isinstance(m, BloomGelu)]
    assert len(gelus) == 4
    with engine_mode(bloom):
        assert all("forward" in m.__dict__ for m in gelus)
        inside = gelus[0](x)
        # torch.func goes through the stand-in (GeLUFunction alone raises here).
        jvp = torch.func.jvp(gelus[0], (x,), (torch.ones_like(x),))[1]
    assert not any("forward" in m.__dict__ for m in gelus)
    torch.testing.assert_close(inside, GeLUFunction.apply(x), rtol=0, atol=0)
    # Its derivative is the one Bloom's own backward computes (autograd, outside the engine).
    x_grad = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(gelus[0](x_grad).sum(), x_grad)
    torch.testing.assert_close(jvp, grad, rtol=1e-12, atol=1e-12)


def test_substitutes_touch_only_the_given_model(bloom):
    other = build("bloom", "eager")
    with differentiable_substitutes(bloom) as names:
        assert names == [f"transformer.h.{i}.mlp.gelu_impl" for i in range(4)]
        assert not any("forward" in m.__dict__ for m in other.modules())


def test_without_a_stand_in_the_run_stops_naming_the_module(bloom, monkeypatch):
    require_fixed("bloom gelu in eval")  # before it, an eval-mode Bloom needs no stand-in
    parts = locate_model_parts(bloom)
    selection = make_selection("coupling")
    preflight.check_differentiable(bloom, parts, PROMPTS[0], selection)  # the stand-in works
    monkeypatch.delitem(differentiable.SUBSTITUTES, BLOOM_GELU)
    with pytest.raises(UnsupportedModelError) as info:
        preflight.check_differentiable(bloom, parts, PROMPTS[0], selection)
    message = str(info.value)
    assert f"block 0: mlp.gelu_impl ({BLOOM_GELU})" in message
    assert "block 3: mlp.gelu_impl" in message
    assert "can still run: lss," in message
    # Without a Jacobian metric nothing is checked.
    preflight.check_differentiable(bloom, parts, PROMPTS[0], make_selection("lss"))


def test_a_module_writing_its_weights_in_place_stops_the_run_naming_it(bloom, monkeypatch):
    """transformers 4.56's Gemma-3n clamps its AltUp weights in place at every call (eval too):
    torch.func refuses the write, so preflight names the module and the operation."""
    dense = bloom.transformer.h[1].mlp.dense_h_to_4h
    linear = type(dense).forward

    def clamping(x):  # the values stay the same: only the in-place write is new
        dense.weight.data.clamp_(-1e6, 1e6)
        return linear(dense, x)

    parts = locate_model_parts(bloom)
    selection = make_selection("coupling")
    monkeypatch.setattr(dense, "forward", clamping, raising=False)
    with pytest.raises(UnsupportedModelError) as info:
        preflight.check_differentiable(bloom, parts, PROMPTS[0], selection)
    message = str(info.value)
    assert "block 1: mlp.dense_h_to_4h (torch.nn.modules.linear.Linear): an in-place " in message
    assert "aten::clamp_" in message and "block 0" not in message and "block 2" not in message
    assert "can still run: lss," in message
