"""The reference Jacobian lens equals TransformerLens 4.3's ``JacobianLens.fit``; files interchange.

The oracle is the installed transformer-lens (the ``test`` extra): a
``TransformerBridge`` wraps the same tiny Hugging Face Llama (``hf_model=``),
``JacobianLens.fit`` fits it on the same prompts, and our engine's fit
(``jacobian.lens_fit.reference_lens_rows``, averaged over the prompts
the reference does not skip) must equal it per layer within 1e-4 relative.
State 0 (the embedding output), which TransformerLens does not fit, is checked
against a dense autograd Jacobian through the whole sequence. Lens files go
both ways: ours load in TransformerLens (and pass its ``validate_model``), its
load here; a lens of another model is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lm_coupling.errors import ConfigurationError
from lm_coupling.jacobian.lens_fit import (
    model_identity,
    reference_lens_rows,
    unembedding_fingerprint,
)
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.builtin.jacobian_lens_file import load_lens, save_lens

PROMPTS = (
    "Question: Which property of a mineral can be determined just by looking at it? Answer: "
    "luster. The sun is a star.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether?",
    "A man is sitting on a roof.",  # shorter than 18 tokens: the reference skips it
)


@pytest.fixture(scope="module")
def bridge(tmp_path_factory, tokenizer):
    """TransformerLens's bridge over a tiny Llama, and that Llama."""
    from importlib.util import find_spec

    from transformers import AutoTokenizer

    if find_spec("transformer_lens") is None:
        pytest.skip("transformer-lens is not installed (setup.cfg extra `reference`)")

    from fixtures.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(folder)  # TransformerLens rebuilds the tokenizer from its path
    model = build_tiny_model("llama", len(tokenizer), seed=3, dtype=torch.float32, init_std=0.2)
    model.config._name_or_path = "tiny-llama"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 3)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its own deprecation notes, not ours
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers(
            "tiny-llama", hf_model=model, tokenizer=AutoTokenizer.from_pretrained(folder),
            device="cpu",
        )  # fmt: skip
    assert bridge.original_model is model
    return bridge, model


@pytest.fixture(scope="module")
def fits(bridge):
    """TransformerLens's lens and ours, on the same prompts (its tokens: BOS first)."""
    from transformer_lens.tools.analysis import JacobianLens

    tl_bridge, model = bridge
    with pytest.warns(UserWarning, match="skipping prompt"):
        theirs = JacobianLens.fit(tl_bridge, list(PROMPTS), corpus="t", show_progress=False)
    parts = locate_model_parts(model)
    terms = [reference_lens_rows(model, parts, tl_bridge.to_tokens(p)[0]) for p in PROMPTS]
    assert terms[2] is None and theirs.n_prompts == 2  # the same prompt skipped
    ours = torch.stack([t for t in terms if t is not None]).mean(dim=0)
    return theirs, ours, parts


def test_reference_fit_equals_transformer_lens_per_layer(fits):
    theirs, ours, parts = fits
    L = parts.n_layers
    assert theirs.source_layers == list(range(L - 1))
    for layer in theirs.source_layers:
        expected = theirs.jacobians[layer]
        error = float((ours[layer + 1] - expected).norm() / expected.norm())
        assert error < 1e-4, (layer, error)
    torch.testing.assert_close(ours[L], torch.eye(parts.d_model))


def test_state_zero_equals_dense_autograd_jacobian(bridge, fits):
    tl_bridge, model = bridge
    _, _, parts = fits
    ids = tl_bridge.to_tokens(PROMPTS[0])[0]
    T = ids.shape[0]
    V = list(range(16, T - 1))
    embeds = model.get_input_embeddings()(ids[None]).detach()
    last = parts.blocks[-1]

    def final(e):  # x^L of every position, as a function of x^0 (a Llama adds nothing to it)
        out = {}
        handle = last.register_forward_hook(lambda m, a, o: out.setdefault("x", o))
        try:
            model(inputs_embeds=e, use_cache=False)
        finally:
            handle.remove()
        x = out["x"]
        return (x[0] if isinstance(x, tuple) else x)[0]

    full = torch.autograd.functional.jacobian(final, embeds, vectorize=True)[:, :, 0]  # [T,d,T,d]
    expected = sum(full[tp, :, t] for t in V for tp in V if tp >= t) / len(V)
    got = reference_lens_rows(model, parts, ids)[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_our_lens_file_loads_in_transformer_lens(bridge, fits, tmp_path):
    from transformer_lens.tools.analysis import JacobianLens

    tl_bridge, model = bridge
    _, ours, parts = fits
    path = save_lens(tmp_path / "ours.pt", ours, 2, "t", model_identity(model, parts))
    loaded = JacobianLens.load(str(path)).validate_model(tl_bridge)
    assert loaded.n_prompts == 2 and loaded.source_layers == list(range(parts.n_layers - 1))
    for layer in loaded.source_layers:
        torch.testing.assert_close(loaded.jacobians[layer], ours[layer + 1])
    readout = loaded.readout(tl_bridge, PROMPTS[0], return_full_logits=True)
    assert torch.isfinite(readout.lens_logits[0]).all()


def test_transformer_lens_file_loads_here_without_state_zero(fits, tmp_path):
    theirs, _, parts = fits
    path = tmp_path / "theirs.pt"
    theirs.save(str(path), dtype=torch.float32)
    record = load_lens(path, parts.n_layers, parts.d_model, unembedding_fingerprint(parts))
    J = record["jacobians"]
    assert record["n_documents"] == 2 and record["task"] == "t"
    assert torch.isnan(J[0]).all()  # not fitted by TransformerLens
    for layer in theirs.source_layers:
        torch.testing.assert_close(J[layer + 1], theirs.jacobians[layer])
    torch.testing.assert_close(J[parts.n_layers], torch.eye(parts.d_model))


def test_a_lens_of_another_model_is_refused(fits, tmp_path, tiny_model):
    theirs, ours, parts = fits
    L, d = parts.n_layers, parts.d_model
    ours_file = save_lens(tmp_path / "o.pt", ours, 2, "t", {"unembedding_sha256": "ab" * 32})
    with pytest.raises(ConfigurationError, match="another unembedding"):
        load_lens(ours_file, L, d, unembedding_fingerprint(parts))
    theirs_file = tmp_path / "t.pt"
    theirs.save(str(theirs_file))
    with pytest.raises(ConfigurationError, match="d = 16"):
        load_lens(theirs_file, L, 16)
    with pytest.raises(ConfigurationError, match="target layer"):
        load_lens(theirs_file, L + 2, d)
    other = locate_model_parts(tiny_model("llama", seed=9))
    assert unembedding_fingerprint(other) != unembedding_fingerprint(parts)


def test_the_runner_fits_the_reference_by_default_and_skips_short_prompts(bridge, fits):
    """``jlens_fit`` through the library runner: its summaries are the reference's terms."""
    from lm_coupling.geometry import GeometryRunner
    from lm_coupling.selection import make_selection

    tl_bridge, model = bridge
    theirs, _, parts = fits
    runner = GeometryRunner(model, make_selection("jlens_fit", None))
    docs = runner.compute_sampled_batch([tl_bridge.to_tokens(p)[0] for p in PROMPTS])
    terms = [torch.as_tensor(doc.summaries["jlens_fit"]) for doc in docs]
    assert [int(torch.as_tensor(doc.summaries["jlens_skipped"])) for doc in docs] == [0, 0, 1]
    assert torch.isnan(terms[2]).all()
    lens = torch.stack(terms[:2]).mean(dim=0)
    for layer in theirs.source_layers:
        expected = theirs.jacobians[layer]
        assert float((lens[layer + 1] - expected).norm() / expected.norm()) < 1e-4
    last = GeometryRunner(model, make_selection("jlens_fit", "jlens_estimator=last_position"))
    (doc,) = last.compute_sampled_batch([tl_bridge.to_tokens(PROMPTS[2])[0]])
    assert torch.isfinite(torch.as_tensor(doc.summaries["jlens_fit"])).all()  # n alone: no skip


def test_reading_a_lens_without_state_zero_uses_the_states_it_covers(bridge, fits, tmp_path):
    """A TransformerLens lens has no state 0: its read is over states 1..L, state 0 NaN."""
    from lm_coupling.capture.lens import JacobianLens
    from lm_coupling.plugins.builtin.jacobian_lens import read_through

    tl_bridge, model = bridge
    theirs, ours, parts = fits
    path = tmp_path / "theirs.pt"
    theirs.save(str(path), dtype=torch.float32)
    J = load_lens(path, parts.n_layers, parts.d_model)["jacobians"]
    ids = tl_bridge.to_tokens(PROMPTS[1])[0]
    states = []
    handles = [parts.blocks[0].register_forward_pre_hook(
        lambda m, a, k: states.append((a[0] if a else k["hidden_states"])[0, -1]), with_kwargs=True
    )] + [b.register_forward_hook(lambda m, a, o: states.append(
        (o[0] if isinstance(o, tuple) else o)[0, -1])) for b in parts.blocks]  # fmt: skip
    with torch.no_grad():
        model(ids[None])
    for h in handles:
        h.remove()
    rows = torch.stack(states)[None]  # [1, L+1, d]
    names = ["jlens_entropy", "jlens_tv_to_target", "jlens_fixation_depth"]
    target = torch.tensor([int(ids[-1])])
    partial = read_through(JacobianLens(J, parts), rows, target, names)
    full = read_through(JacobianLens(torch.nan_to_num(J, nan=0.0) + 0, parts), rows, target, names)
    profile = partial["profiles"]["jlens_entropy"][0]
    assert torch.isnan(profile[0]) and torch.isfinite(profile[1:]).all()
    torch.testing.assert_close(profile[1:], full["profiles"]["jlens_entropy"][0][1:])
    assert float(partial["values"]["jlens_entropy"][0]) == pytest.approx(float(profile[1:].mean()))
    assert float(partial["values"]["jlens_fixation_depth"][0]) >= 1 / parts.n_layers


def test_a_later_first_state_fits_the_same_rows(bridge):
    """Rooting the graph at x^s (as TransformerLens's ``source_layers``) keeps states >= s."""
    tl_bridge, model = bridge
    parts = locate_model_parts(model)
    ids = tl_bridge.to_tokens(PROMPTS[0])[0]
    full = reference_lens_rows(model, parts, ids, dim_batch=5)
    for first in (1, parts.n_layers - 1, parts.n_layers):
        later = reference_lens_rows(model, parts, ids, dim_batch=5, first_state=first)
        assert torch.isnan(later[:first]).all()
        torch.testing.assert_close(later[first:], full[first:], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="first_state"):
        reference_lens_rows(model, parts, ids, first_state=parts.n_layers + 1)
