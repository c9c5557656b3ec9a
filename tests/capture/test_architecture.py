"""Locating blocks, final norm and unembedding: every tiny architecture, overrides, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from fixtures.tiny import ARCHITECTURES, build_tiny_model
from torch import nn

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.model import architecture
from lm_coupling.model.architecture import (
    ModelParts,
    block_output_hidden,
    locate_model_parts,
    register_override,
)

PROMPT = "The sun is a star. Water boils"


@pytest.fixture
def restore_overrides():
    """Undo any register_override a test makes (the table is global)."""
    saved = copy.deepcopy(architecture._OVERRIDES)
    yield
    architecture._OVERRIDES.clear()
    architecture._OVERRIDES.update(saved)


def _last_block_output(model, parts, input_ids, **kwargs):
    """Run the model; return (x^L from a hook on the last block, the model output)."""
    kept = {}

    def hook(module, args, output):
        kept["x"] = block_output_hidden(output).detach()

    handle = parts.blocks[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(input_ids, output_hidden_states=True, **kwargs)
    finally:
        handle.remove()
    return kept["x"], out


def _assert_lens_is_model_output(model, parts, input_ids, atol=1e-5):
    x_last, out = _last_block_output(model, parts, input_ids)
    logits = parts.unembed_fp32(parts.final_norm_fp32(x_last))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(
        logits.softmax(-1), out.logits.float().softmax(-1), atol=atol, rtol=0
    )
    return x_last, out


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_architecture_is_located(model_type, tiny_model, tokenizer):
    model = tiny_model(model_type)
    parts = locate_model_parts(model)
    assert parts.model_type == model_type
    assert (parts.n_layers, parts.d_model, parts.vocab_size) == (3, 32, len(tokenizer))
    assert parts.unembed_weight.shape == (len(tokenizer), 32)
    assert parts.final_norm is not None
    module_ids = {id(m) for m in model.modules()}
    assert all(id(block) in module_ids for block in parts.blocks)
    assert len({id(block) for block in parts.blocks}) == 3
    assert parts.embedding is model.get_input_embeddings()
    assert (parts.unembed_bias is not None) == (model_type == "phi")


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_last_lens_layer_is_the_model_distribution(model_type, tiny_model, tokenizer):
    model = tiny_model(model_type)
    parts = locate_model_parts(model)
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    x_last, out = _assert_lens_is_model_output(model, parts, ids)
    # x^L is taken before the final norm; HF's last hidden state is after it.
    assert (x_last - out.hidden_states[-1]).abs().max() > 1e-3
    torch.testing.assert_close(parts.final_norm_fp32(x_last), out.hidden_states[-1])


def test_logit_softcapping_is_reproduced(tokenizer):
    config = transformers.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, final_logit_softcapping=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    parts = locate_model_parts(model)
    assert parts.logit_softcap == 0.5
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    x_last, out = _assert_lens_is_model_output(model, parts, ids)
    assert out.logits.abs().max() <= 0.5  # the cap is active: uncapped logits would differ
    uncapped = nn.functional.linear(parts.final_norm_fp32(x_last), parts.unembed_weight)
    assert (uncapped - out.logits).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parts_compute_in_float32(dtype, tokenizer):
    model = build_tiny_model("llama", len(tokenizer), dtype=dtype)
    parts = locate_model_parts(model)
    x = torch.randn(2, 5, 32, dtype=dtype)
    normed = parts.final_norm_fp32(x)
    logits = parts.unembed_fp32(normed)
    assert normed.dtype == logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # The model keeps its dtype; the float32 copy of the norm is made once.
    assert model.model.norm.weight.dtype == dtype
    assert parts._norm_in(torch.float32) is parts._norm_in(torch.float32)
    reference_norm = copy.deepcopy(model.model.norm).float()
    torch.testing.assert_close(normed, reference_norm(x.float()), atol=1e-6, rtol=1e-6)
    reference = x.float() @ parts.unembed_weight.float().T
    torch.testing.assert_close(parts.unembed_fp32(x), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unembedding_in_chunks_or_whole_equals_the_product(dtype, tokenizer, monkeypatch):
    """A bfloat16 weight is converted chunk by chunk, a float32 one used whole: same logits."""
    model = build_tiny_model("llama", len(tokenizer), dtype=dtype)
    parts = locate_model_parts(model)
    monkeypatch.setattr(architecture, "_UNEMBED_CHUNK", 7)  # many chunks of the vocabulary
    x = torch.randn(3, 32)
    logits = parts.unembed_fp32(x)
    whole = nn.functional.linear(x, parts.unembed_weight.float())
    assert logits.shape == (3, len(tokenizer)) and logits.dtype == torch.float32
    if dtype == torch.float32:
        assert torch.equal(logits, whole)  # one product, nothing joined
    else:
        torch.testing.assert_close(logits, whole, atol=1e-6, rtol=1e-6)


def test_float64_stays_float64(tiny_model):
    parts = locate_model_parts(tiny_model("gpt2", dtype=torch.float64))
    x = torch.randn(3, 32, dtype=torch.float64)
    assert parts.unembed_fp32(parts.final_norm_fp32(x)).dtype == torch.float64


def test_model_without_final_norm(tokenizer, restore_overrides):
    model = build_tiny_model("gpt2", len(tokenizer))
    model.transformer.ln_f = nn.Identity()
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    parts = locate_model_parts(model)
    assert isinstance(parts.final_norm, nn.Identity)
    _assert_lens_is_model_output(model, parts, ids)
    register_override("gpt2", final_norm=())
    parts = locate_model_parts(model)
    assert parts.final_norm is None
    x = torch.randn(4, 32)
    assert torch.equal(parts.final_norm_fp32(x), x)
    x_last, out = _assert_lens_is_model_output(model, parts, ids)
    torch.testing.assert_close(x_last, out.hidden_states[-1])


def test_override_replaces_the_generic_rule(tiny_model, restore_overrides):
    model = tiny_model("llama")
    register_override(
        "llama", blocks="model.layers.1", final_norm="model.layers.0.input_layernorm",
        unembed="model.embed_tokens", embedding="lm_head",
    )  # fmt: skip
    # "model.layers.1" is a block, not a list of blocks: the override is checked.
    with pytest.raises(UnsupportedModelError, match="override path 'model.layers.1'"):
        locate_model_parts(model)
    register_override("llama", blocks="model.layers", final_norm="model.layers.0.input_layernorm",
                      unembed="model.embed_tokens", embedding="lm_head")  # fmt: skip
    parts = locate_model_parts(model)
    assert parts.blocks == list(model.model.layers)
    assert parts.final_norm is model.model.layers[0].input_layernorm
    assert parts.unembed_weight is model.model.embed_tokens.weight
    assert parts.embedding is model.lm_head


def test_override_with_bad_unembed_path(tiny_model, restore_overrides):
    register_override("gpt2", unembed="transformer.no_such_head")
    with pytest.raises(UnsupportedModelError, match="no_such_head"):
        locate_model_parts(tiny_model("gpt2"))


def test_register_override_rejects_non_paths():
    with pytest.raises(TypeError, match="dotted path"):
        register_override("gpt2", blocks=["transformer.h"])
    with pytest.raises(TypeError, match="final_norm"):
        register_override("gpt2", final_norm=[1])


def _bert_config():
    return transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip


@pytest.mark.parametrize("cls", [transformers.BertForMaskedLM, transformers.BertModel])
def test_non_causal_model_is_rejected(cls):
    model = cls(_bert_config())
    with pytest.raises(UnsupportedModelError) as info:
        locate_model_parts(model)
    message = str(info.value)
    assert "model_type='bert'" in message
    assert "Looked for" in message and "found" in message
    assert "register_override('bert'" in message


def test_encoder_decoder_model_is_rejected():
    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2
    )
    model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        locate_model_parts(model)


def test_block_output_hidden():
    x = torch.randn(2, 3, 4)
    assert block_output_hidden(x) is x
    assert block_output_hidden((x, None)) is x
    with pytest.raises(TypeError, match="tensor or a tuple"):
        block_output_hidden(None)
    with pytest.raises(TypeError, match="tensor or a tuple"):
        block_output_hidden(())


def test_model_parts_sizes_from_fields():
    parts = ModelParts(
        model_type="toy", blocks=[nn.Linear(4, 4), nn.Linear(4, 4)], final_norm=None,
        unembed_weight=torch.randn(7, 4), unembed_bias=torch.randn(7), embedding=nn.Embedding(7, 4),
    )  # fmt: skip
    assert (parts.n_layers, parts.d_model, parts.vocab_size) == (2, 4, 7)
    x = torch.randn(3, 4)
    torch.testing.assert_close(
        parts.unembed_fp32(x), x @ parts.unembed_weight.T + parts.unembed_bias
    )


def test_override_sets_logit_scale_and_soft_cap(tiny_model, tokenizer, restore_overrides):
    model = tiny_model("gpt2")
    register_override("gpt2", logit_scale=0.5, logit_softcap=2.0)
    parts = locate_model_parts(model)
    assert (parts.logit_scale, parts.logit_softcap) == (0.5, 2.0)
    x = torch.randn(5, 32)
    z = nn.functional.linear(x, parts.unembed_weight) * 0.5
    torch.testing.assert_close(parts.unembed_fp32(x), 2.0 * torch.tanh(z / 2.0))
    register_override("gpt2", logit_softcap=0)  # 0: no soft-cap, the scale from the config
    parts = locate_model_parts(model)
    assert (parts.logit_scale, parts.logit_softcap) == (1.0, None)
    torch.testing.assert_close(parts.unembed_fp32(x), nn.functional.linear(x, parts.unembed_weight))
