"""The Jacobian lens: closed forms on linear blocks, and dense autograd on tiny models."""

from __future__ import annotations

import pytest
import torch
from fixtures.jacobians import autograd_total_jacobian, states_at_last

from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.metrics.jacobian_lens import jacobian_products, transport
from lm_coupling.model.architecture import locate_model_parts

PROMPTS = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Question: which gas do plants take in? Answer:",
    "One two three four five six",
)


def test_linear_blocks_give_the_product_of_their_matrices():
    gen = torch.Generator().manual_seed(0)
    L, d = 4, 6
    A = 0.3 * torch.randn(L, d, d, generator=gen, dtype=torch.float64)
    # Block m maps x -> x + A_m x; its residual-branch Jacobian, by autograd, is A_m.
    blocks = torch.stack(
        [
            torch.autograd.functional.jacobian(lambda x, a=a: a @ x, torch.zeros(d, dtype=a.dtype))
            for a in A
        ]
    )
    # Linear: every document has the same J_l, so the fit (their mean) is one document's.
    J = jacobian_products(blocks[None].expand(3, -1, -1, -1)).mean(0)
    eye = torch.eye(d, dtype=torch.float64)
    for layer in range(L + 1):
        expected = eye.clone()
        for m in range(L - 1, layer - 1, -1):  # (I + A_L) ... (I + A_{l+1})
            expected = expected @ (eye + A[m])
        torch.testing.assert_close(J[layer], expected, rtol=0, atol=1e-13)

    def whole(x, start):
        for a in A[start:]:
            x = x + a @ x
        return x

    x0 = torch.randn(d, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        J[1], torch.autograd.functional.jacobian(lambda x: whole(x, 1), x0), rtol=0, atol=1e-13
    )
    torch.testing.assert_close(J[L], eye)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\[\.\.\., L, d, d\]"):
        jacobian_products(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="states must have shape"):
        transport(torch.zeros(3, 4, 4), torch.zeros(1, 2, 4))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fit_equals_average_of_dense_autograd_jacobians(tiny_model, tokenizer, arch):
    model = tiny_model(arch, init_std=0.2)
    parts = locate_model_parts(model)
    engine = JacobianEngine(model, parts, k_max=2)
    L, d = parts.n_layers, parts.d_model
    fit = torch.zeros(L + 1, d, d)
    reference = torch.zeros(L + 1, d, d)
    for text in PROMPTS:
        ids = torch.tensor(tokenizer(text)["input_ids"])
        fit += jacobian_products(engine.dense_jacobians(ids))
        states, _ = states_at_last(model, parts, ids)
        for layer in range(L):
            reference[layer] += autograd_total_jacobian(model, parts, ids, layer, states[layer])
        reference[L] += torch.eye(d)
    reference /= len(PROMPTS)
    J = fit / len(PROMPTS)
    assert (J[0] - torch.eye(d)).abs().max() > 1e-2  # not trivially the identity
    torch.testing.assert_close(J, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_last_layer_jlens_is_the_model_output(tiny_model, tokenizer, arch):
    model = tiny_model(arch, init_std=0.2)
    parts = locate_model_parts(model)
    engine = JacobianEngine(model, parts, k_max=2)
    ids = torch.tensor(tokenizer(PROMPTS[1])["input_ids"])
    fitted = jacobian_products(engine.dense_jacobians(ids))  # the fit on this one document
    states, logits = states_at_last(model, parts, ids)
    moved = transport(fitted, states[None])  # [1, L+1, d]
    lens_logits = parts.unembed_fp32(parts.final_norm_fp32(moved))[0]
    torch.testing.assert_close(
        torch.softmax(lens_logits[-1], -1), torch.softmax(logits, -1), rtol=1e-5, atol=1e-6
    )
    # Fitted on this one document, J_l x^l_n is the first-order image of x^l_n, not x^L_n:
    assert not torch.allclose(lens_logits[0], lens_logits[-1], atol=1e-3)
