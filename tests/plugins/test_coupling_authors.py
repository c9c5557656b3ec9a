"""The ICLR 2025 authors' six mis-coupling columns equal a transcription of their route.

The transcription, written here from their released code's formulas
(sugolov/coupling ``main.py``, ``jacobian.py``, ``metrics.py``): one forward
pass with ``output_hidden_states``; per block, d vector-Jacobian products of
``h_{l}[-1]`` against ``h_{l-1}``, read at the last token, minus the identity
(``h_L`` is transformers' post-norm state, so the last block's Jacobian goes
through the final norm); a full ``torch.linalg.svd``; ``M = U_j[:, :K]^T J_i
Vh_j[:K].T``; ``|| |M| - diag(S_i[:K]) ||_F`` over ``trace(S_i)`` and over
``||S_i[:K]||_2``. The plugin (engine block Jacobians at n with a frozen
prefix, the final norm's Jacobian composed for the last block) must equal it
within 1e-5, on tiny Llama and GPT-2 models.
"""

from __future__ import annotations

import pytest
import torch

from lm_coupling.geometry import GeometryRunner
from lm_coupling.plugins.builtin.coupling_authors import NAMES
from lm_coupling.selection import make_selection

TEXT = "Question: which gas do plants take in from the air? Answer: carbon dioxide, mostly."


def _authors_route(model, ids: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
    """A transcription of the authors' route (formulas of their released code)."""
    with torch.enable_grad():
        out = model(ids[None], output_hidden_states=True)
        hs = out.hidden_states
        L, d = len(hs) - 1, hs[0].shape[-1]
        jacobians = []
        for layer in range(L):
            y = hs[layer + 1][0, -1]
            rows = [
                torch.autograd.grad(y, hs[layer], e, retain_graph=True)[0][0, -1]
                for e in torch.eye(d, dtype=y.dtype)
            ]
            jacobians.append(torch.stack(rows) - torch.eye(d, dtype=y.dtype))
    svds = [torch.linalg.svd(J) for J in jacobians]
    result = {}
    for k in (10, 30, 50):
        for norm in ("trace", "norm"):
            m = torch.zeros(L, L, dtype=torch.float64)
            for i in range(L):
                S_i = torch.diag(svds[i][1][:k])
                for j in range(L):
                    U, V = svds[j][0][:, :k], svds[j][2][:k, :].T
                    diff = torch.linalg.norm(torch.abs(U.T @ jacobians[i] @ V) - S_i)
                    scale = torch.trace(S_i) if norm == "trace" else torch.norm(svds[i][1][:k])
                    m[i, j] = diff / scale
            result[(k, norm)] = m
    return result


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_six_columns_equal_the_authors_route(tiny_model, tokenizer, model_type):
    model = tiny_model(model_type, dtype=torch.float64, init_std=0.2)
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    expected = _authors_route(model, ids)
    runner = GeometryRunner(model, make_selection(",".join(NAMES.values()), None))
    (doc,) = runner.compute_sampled_batch([ids], errors="raise")
    for key, name in NAMES.items():
        got = torch.as_tensor(doc.profiles[name], dtype=torch.float64)
        torch.testing.assert_close(got, expected[key], rtol=1e-5, atol=1e-7)
        assert doc.values[name] == pytest.approx(float(expected[key].mean()), rel=1e-5)


def test_the_last_block_goes_through_the_final_norm(tiny_model, tokenizer):
    """Without the norm the last row differs: the composition is what makes them equal."""
    from lm_coupling.jacobian.authors import authors_jacobians
    from lm_coupling.jacobian.engine import JacobianEngine

    model = tiny_model("llama", dtype=torch.float64, init_std=0.2)
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    runner = GeometryRunner(model, make_selection(NAMES[(10, "trace")], None))
    (theirs,) = authors_jacobians(runner, [ids])
    ours = JacobianEngine(model, runner.parts, k_max=1).dense_jacobians(ids)
    torch.testing.assert_close(theirs[:-1], ours[:-1].cpu())
    assert float((theirs[-1] - ours[-1].cpu()).abs().max()) > 1e-3
