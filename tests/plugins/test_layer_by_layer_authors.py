"""``preset=skean2025``: Layer by Layer's measures equal a transcription of the authors' functions.

The transcription, written here from the formulas of their released code
(OFSkean/information_flow ``metric_functions.py``): ``normalize`` (centre a
prompt's tokens, scale each to unit norm) on every state of
``output_hidden_states`` (position 0 included; the last one after the final
norm), ``compute_entropy`` (``Z^T Z`` when N > D else ``Z Z^T``, clamped at
zero, divided by its trace, repitl's alpha = 1 entropy: ``-sum p ln p`` of the
positive eigenvalues normalised to sum 1), ``compute_curvature`` (mean over
consecutive steps of ``arccos(|v_{k+1}^T v_k| / (|v_{k+1}| |v_k|))``, 0 for a
zero-length step), and the dataset entropy of the prompts' mean-pooled
normalised tokens. The plugin under the preset must equal it within 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling.geometry import GeometryRunner
from lm_coupling.plugins.builtin import layer_by_layer as plugin
from lm_coupling.selection import make_selection

PROMPTS = (
    "Question: which gas do plants take in from the air? Answer:",
    "The the the sun is a star. Water boils at one hundred degrees. Plants need light to grow "
    "and water boils.",  # longer than d = 32 tokens: the d x d branch; repeated tokens
    "Natalia sold clips to 48 of her friends in April",
)


def _normalize(R):
    R = R - R.mean(dim=0)
    return R / torch.norm(R, p=2, dim=1, keepdim=True)


def _entropy(hidden):  # [L, N, D] -> [L]
    L, N, D = hidden.shape
    cov = hidden.transpose(1, 2) @ hidden if N > D else hidden @ hidden.transpose(1, 2)
    cov = torch.clamp(cov, min=0)
    out = []
    for layer in cov:
        layer = layer.double() / torch.trace(layer.double())
        ev = torch.linalg.eigh(layer)[0]
        ev = ev[ev > 0]
        ev = ev / ev.sum()
        out.append(float(-(ev * torch.log(ev)).sum()))
    return out


def _curvature(hidden):  # [L, N, D] -> [L]
    out = []
    for layer in hidden.double():
        total, count = 0.0, 0
        for k in range(1, layer.shape[0] - 1):
            a, b = layer[k + 1] - layer[k], layer[k] - layer[k - 1]
            na, nb = torch.norm(a), torch.norm(b)
            if na == 0 or nb == 0:
                angle = 0.0
            else:
                angle = float(torch.arccos(torch.clamp(torch.abs(a @ b) / (na * nb), -1, 1)))
            total += angle
            count += 1
        out.append(total / count if count else 0.0)
    return out


def _states(model, ids):
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    return torch.stack([_normalize(x[0].double()) for x in hs])  # [L+1, N, D]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_skean2025_equals_the_authors_functions(tiny_model, tokenizer, model_type):
    model = tiny_model(model_type, dtype=torch.float64, init_std=0.2)
    names = "prompt_entropy,curvature,dataset_entropy"
    selection = make_selection(names, "preset=skean2025")
    runner = GeometryRunner(model, selection)
    docs, pooled = [], []
    for text in PROMPTS:
        ids = torch.tensor(tokenizer(text)["input_ids"])
        hidden = _states(model, ids)
        doc = runner.measure_prompt(ids)
        docs.append(doc)
        pooled.append(hidden.mean(dim=1))
        expected_entropy, expected_curvature = _entropy(hidden), _curvature(hidden)
        got_entropy = torch.as_tensor(doc.profiles["prompt_entropy"], dtype=torch.float64)
        got_curvature = torch.as_tensor(doc.profiles["curvature"], dtype=torch.float64)
        expected_entropy = torch.tensor(expected_entropy, dtype=torch.float64)
        torch.testing.assert_close(got_entropy, expected_entropy, atol=1e-6, rtol=0)
        torch.testing.assert_close(
            got_curvature, torch.tensor(expected_curvature, dtype=torch.float64), atol=1e-6, rtol=0
        )
    section = plugin.lmc_aggregate_task(
        selected=["dataset_entropy"], options=selection.options, documents=docs,
        doc_ids=list(range(len(docs))),
    )["dataset_entropy"]  # fmt: skip
    expected = _entropy(torch.stack(pooled, dim=1))  # [L+1, N, D]
    assert section["clamp"] is True and section["tokens"] == "all"
    torch.testing.assert_close(
        torch.tensor(section["profile"], dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )


def test_each_convention_moves_the_numbers(tiny_model, tokenizer):
    """The preset's conventions are each in effect: dropping one changes the profile."""
    model = tiny_model("llama", dtype=torch.float64, init_std=0.2)
    ids = torch.tensor(tokenizer(PROMPTS[1])["input_ids"])

    def profile(args):
        doc = GeometryRunner(model, make_selection("prompt_entropy", args)).measure_prompt(ids)
        return torch.as_tensor(doc.profiles["prompt_entropy"], dtype=torch.float64)

    full = profile("preset=skean2025")
    for change in ("lbl_tokens=context", "lbl_clamp=false", "lbl_last_state=pre_norm"):
        other = profile(f"preset=skean2025,{change}")
        assert float((other - full).abs().max()) > 1e-6, change
    last_only = profile("preset=skean2025,lbl_last_state=pre_norm")
    torch.testing.assert_close(last_only[:-1], full[:-1])  # the final norm acts on x^L only
    assert math.isfinite(float(full.sum()))
