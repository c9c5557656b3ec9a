"""Coupling on models narrower than the default K (alignment_k = 30)."""

import math

import pytest
import torch

from lm_coupling.geometry import GeometryRunner
from lm_coupling.plugins.specs import used_k as clamped_k
from lm_coupling.selection import make_selection


@pytest.mark.parametrize(("k", "d", "expected"), [(10, 768, 10), (30, 16, 15), (0.1, 768, 76)])
def test_clamped_k_caps_integers_below_the_width(k, d, expected):
    assert clamped_k(k, d) == expected


def test_default_options_give_finite_coupling_on_a_16_wide_model(tiny_model, tokenizer):
    model = tiny_model("gpt2", d_model=16, n_heads=4)
    runner = GeometryRunner(model, make_selection("coupling,alignment_ratio"))
    ids = torch.tensor(tokenizer.encode("Question: which star is nearest? Answer:"))
    doc = runner.measure_prompt(ids)
    assert math.isfinite(doc.values["coupling"])
    assert math.isfinite(doc.values["alignment_ratio"])
    # K = 10 of 16 singular values: the stored spectrum holds K + 1 of them per layer.
    assert doc.profiles["singular_values"].shape == (3, 11)
