"""SmolLM2-135M against the reference code: the J-lens, the authors' coupling, Layer by Layer.

- (a) The reference Jacobian lens (``jacobian.lens_fit.reference_lens_rows``)
  equals transformer-lens 4.3.0's ``JacobianLens.fit`` on the same prompts
  and the same float32 model within 1e-4 relative per layer. The estimator
  costs about ``d * T`` one-token backward passes per prompt through the
  blocks after the earliest fitted layer, whatever ``dim_batch`` is
  (docs/metrics.md, "The Jacobian lens's cost"): at d = 576 and the default
  128 tokens that is minutes per prompt on a CI core. So both fits take
  12-token prompts (``skip_first_positions=2``: 9 source positions) and the
  last four layers (TransformerLens's ``source_layers``, our ``first_state``):
  the backward passes run through 4 of the 30 blocks, and ``dim_batch=16``
  keeps the replicated forward pass small (36 backward passes). Every layer, and the
  route rooted at the embedding output, is compared on the tiny Llama
  (tests/capture/test_jacobian_lens_fit.py).
- (b) ``preset=iclr2025``'s six columns equal a transcription of the ICLR 2025
  authors' route written here (sugolov/coupling: d vector-Jacobian products
  of ``output_hidden_states`` at the last token, minus the identity, a full
  SVD, ``|| |U_j^T J_i V_j| - S_i ||_F`` over the trace and the 2-norm)
  within 1e-5 on two real documents (one ARC-Easy, one WinoGrande), in
  float64. The products run over transformers' cache of the prefix
  (`_authors_jacobians`): the same derivative, one token per product.
- (c) Under ``preset=skean2025`` the Layer by Layer measures equal a
  transcription of the authors' functions (OFSkean/information_flow
  ``normalize``, ``compute_entropy`` with repitl's alpha = 1 von Neumann
  entropy, ``compute_curvature``) within 1e-6 on the same documents.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from fixtures.benchmarks import EVAL_SPLITS

from lm_coupling.geometry import GeometryRunner
from lm_coupling.jacobian.lens_fit import reference_lens_rows
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.builtin.coupling_authors import NAMES
from lm_coupling.selection import make_selection

JLENS = {"max_seq_len": 12, "skip_first_positions": 2, "dim_batch": 16}
KS = (10, 30, 50)  # the authors' num_sing_vecs
SOURCE_LAYERS = list(range(25, 29))  # block outputs 25..28 = states 26..29 (L = 30)


def _documents(folder) -> list[str]:
    """The first ARC-Easy item (question and gold answer) and the first WinoGrande sentence."""
    arc_split, wino_split = EVAL_SPLITS["arc_easy"], EVAL_SPLITS["winogrande"]
    arc = json.loads((folder / "arc_easy" / f"{arc_split}.jsonl").read_text().splitlines()[0])
    answer = arc["choices"]["text"][arc["choices"]["label"].index(arc["answerKey"])]
    wino = json.loads((folder / "winogrande" / f"{wino_split}.jsonl").read_text().splitlines()[0])
    option = wino["option1"] if wino["answer"] == "1" else wino["option2"]
    return [
        f"Question: {arc['question']}\nAnswer: {answer}",
        wino["sentence"].replace("_", option),
    ]


@pytest.fixture(scope="module")
def documents(real_items) -> list[str]:
    return _documents(real_items[0])


@pytest.fixture(scope="module")
def float32_model(smollm2):
    """SmolLM2 as transformers dequantises the GGUF (float32), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    return model.eval(), tokenizer


# (a) the reference Jacobian lens ------------------------------------------------------------


def test_reference_lens_equals_transformer_lens_fit(float32_model, documents, tmp_path):
    from importlib.util import find_spec

    if find_spec("transformer_lens") is None:
        pytest.skip("transformer-lens is not installed (setup.cfg extra `reference`)")
    from transformers import AutoTokenizer

    model, tokenizer = float32_model
    tokenizer.save_pretrained(tmp_path)  # TransformerLens rebuilds the tokenizer from a path
    model.config._name_or_path = "smollm2-135m"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its own deprecation notes, not ours
        from transformer_lens.model_bridge import TransformerBridge
        from transformer_lens.tools.analysis import JacobianLens

        bridge = TransformerBridge.boot_transformers(
            "smollm2-135m", hf_model=model, tokenizer=AutoTokenizer.from_pretrained(tmp_path),
            device="cpu",
        )  # fmt: skip
        theirs = JacobianLens.fit(
            bridge, documents, corpus="t", show_progress=False, source_layers=SOURCE_LAYERS,
            **JLENS,
        )  # fmt: skip
    parts = locate_model_parts(model)
    assert parts.n_layers == 30
    tokens = [bridge.to_tokens(text)[0] for text in documents]
    assert all(t.shape[0] >= JLENS["max_seq_len"] for t in tokens)  # every prompt at full length
    first = SOURCE_LAYERS[0] + 1
    ours = torch.stack(
        [reference_lens_rows(model, parts, t, first_state=first, **JLENS) for t in tokens]
    ).mean(0)
    assert theirs.n_prompts == 2 and theirs.source_layers == SOURCE_LAYERS
    errors = []
    for layer in theirs.source_layers:
        expected = theirs.jacobians[layer]
        errors.append(float((ours[layer + 1] - expected).norm() / expected.norm()))
    print(f"J-lens vs JacobianLens.fit: worst relative error per layer {max(errors):.2e}")
    assert max(errors) < 1e-4, errors
    torch.testing.assert_close(ours[parts.n_layers], torch.eye(parts.d_model))


# (b) the ICLR 2025 authors' coupling ---------------------------------------------------------


def _authors_jacobians(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """d VJPs per block of ``h_{l+1}[-1]`` against ``h_l[-1]`` (output_hidden_states), minus I.

    The authors differentiate through the whole sequence's forward pass; by
    causality the prefix's states do not depend on the last token's, so the
    same derivative comes from the last token's forward pass alone over
    transformers' own cache of the prefix (``cache``), at the cost
    of one token instead of T per product. (The whole-sequence form is the
    transcription of tests/plugins/test_coupling_authors.py on the tiny models.)
    """
    with torch.no_grad():
        prefix = model(ids[None, :-1], use_cache=True)
    with torch.enable_grad():
        hs = model(
            ids[None, -1:], cache=prefix.cache, use_cache=True,
            output_hidden_states=True,
        ).hidden_states  # fmt: skip
        d = hs[0].shape[-1]
        eye = torch.eye(d, dtype=hs[0].dtype)
        out = []
        for layer in range(len(hs) - 1):
            y = hs[layer + 1][0, -1]
            (grad,) = torch.autograd.grad(
                y, hs[layer], eye, retain_graph=True, is_grads_batched=True
            )
            out.append(grad[:, 0, -1] - eye)
    return out


def _authors_columns(jacobians: list[torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """The authors' metrics.py formulas from a full SVD of every block.

    ``U_j[:, :K]^T J_i Vh_j[:K].T`` is the leading K x K corner of the K = 50
    product, so each pair's product is formed once and cut for K = 10 and 30.
    """
    svds = [torch.linalg.svd(J) for J in jacobians]
    L, top = len(jacobians), max(KS)
    V = torch.cat([Vh[:top].T for _, _, Vh in svds], dim=1)  # [d, L * 50]
    M = [
        [svds[j][0][:, :top].T @ JV for j, JV in enumerate((J @ V).split(top, dim=1))]
        for J in jacobians
    ]
    result = {}
    for k in KS:
        for norm in ("trace", "norm"):
            m = torch.zeros(L, L, dtype=torch.float64)
            for i in range(L):
                S_i = torch.diag(svds[i][1][:k])
                scale = torch.trace(S_i) if norm == "trace" else torch.norm(svds[i][1][:k])
                for j in range(L):
                    m[i, j] = torch.linalg.norm(torch.abs(M[i][j][:k, :k]) - S_i) / scale
            result[(k, norm)] = m
    return result


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_iclr2025_columns_equal_the_authors_route(reference_model, documents):
    model, tokenizer = reference_model
    runner = GeometryRunner(model, make_selection(",".join(NAMES.values()), "preset=iclr2025"))
    worst = worst_abs = 0.0
    for text in documents:
        ids = _ids(tokenizer, text)
        expected = _authors_columns(_authors_jacobians(model, ids))
        (doc,) = runner.compute_sampled_batch([ids], errors="raise")
        for key, name in NAMES.items():
            got = torch.as_tensor(doc.profiles[name], dtype=torch.float64)
            off = ~torch.eye(got.shape[0], dtype=torch.bool)  # the diagonal is 0 up to round-off
            rel = (got - expected[key]).abs()[off] / expected[key].abs()[off]
            worst = max(worst, float(rel.max()))
            worst_abs = max(worst_abs, float((got - expected[key]).abs().max()))
            torch.testing.assert_close(got, expected[key], rtol=1e-5, atol=1e-7)
            assert doc.values[name] == pytest.approx(float(expected[key].mean()), rel=1e-5)
    print(
        f"iclr2025 columns vs the authors' route: worst relative error off the diagonal "
        f"{worst:.2e}, worst absolute difference {worst_abs:.2e}"
    )


# (c) Layer by Layer as its authors compute it ------------------------------------------------


def _normalize(R: torch.Tensor) -> torch.Tensor:
    R = R - R.mean(dim=0)
    return R / torch.norm(R, p=2, dim=1, keepdim=True)


def _entropy(hidden: torch.Tensor) -> list[float]:
    """compute_entropy: Gram (smaller side) clamped at 0, over its trace; alpha = 1 entropy."""
    _, N, D = hidden.shape
    cov = hidden.transpose(1, 2) @ hidden if N > D else hidden @ hidden.transpose(1, 2)
    cov = torch.clamp(cov, min=0)
    out = []
    for layer in cov:
        layer = layer / torch.trace(layer)
        ev = torch.linalg.eigvalsh(layer)
        ev = ev[ev > 0]
        ev = ev / ev.sum()
        out.append(float(-(ev * torch.log(ev)).sum()))
    return out


def _curvature(hidden: torch.Tensor) -> list[float]:
    """compute_curvature: mean over steps of arccos(|cos|) of consecutive token differences."""
    out = []
    for layer in hidden:
        angles = []
        for k in range(1, layer.shape[0] - 1):
            a, b = layer[k + 1] - layer[k], layer[k] - layer[k - 1]
            na, nb = torch.norm(a), torch.norm(b)
            cos = torch.abs(a @ b) / (na * nb) if na > 0 and nb > 0 else None
            angles.append(0.0 if cos is None else float(torch.arccos(torch.clamp(cos, -1, 1))))
        out.append(sum(angles) / len(angles) if angles else 0.0)
    return out


def test_skean2025_equals_the_authors_functions(reference_model, documents):
    from lm_coupling.plugins.builtin import layer_by_layer as plugin

    model, tokenizer = reference_model
    selection = make_selection("prompt_entropy,curvature,dataset_entropy", "preset=skean2025")
    runner = GeometryRunner(model, selection)
    docs, pooled, worst = [], [], 0.0
    for text in documents:
        ids = _ids(tokenizer, text)
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True, use_cache=False).hidden_states
        hidden = torch.stack([_normalize(x[0].double()) for x in hs])  # [L+1, N, D]
        pooled.append(hidden.mean(dim=1))
        doc = runner.measure_prompt(ids)
        docs.append(doc)
        for name, expected in (
            ("prompt_entropy", _entropy(hidden)),
            ("curvature", _curvature(hidden)),
        ):
            got = torch.as_tensor(doc.profiles[name], dtype=torch.float64)
            want = torch.tensor(expected, dtype=torch.float64)
            worst = max(worst, float((got - want).abs().max()))
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    section = plugin.lmc_aggregate_task(
        selected=["dataset_entropy"], options=selection.options, documents=docs,
        doc_ids=list(range(len(docs))),
    )["dataset_entropy"]  # fmt: skip
    want = torch.tensor(_entropy(torch.stack(pooled, dim=1)), dtype=torch.float64)
    got = torch.tensor(section["profile"], dtype=torch.float64)
    worst = max(worst, float((got - want).abs().max()))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert all(math.isfinite(v) for v in section["profile"])
    print(f"skean2025 vs the authors' functions: worst absolute difference {worst:.2e}")
