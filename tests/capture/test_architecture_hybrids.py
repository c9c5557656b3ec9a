"""The locator on hybrid stacks and head transforms, and the replay the engine picks.

Each model is a tiny random model of the installed transformers (4 blocks, d = 64):
the locator must find blocks of several classes in one ``ModuleList`` (Jamba,
OLMo-hybrid), the decoder that holds them (ModernBERT-decoder), and read the lens
out through a head transform (BERT-style ``cls.predictions.transform``,
Electra's projection to the embedding width) and through final norms and logit
transforms under their own names (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, xLSTM,
Inkling; built by the census's tiny-config builder); the read-out must equal the
model's own logits. ``choose_replay`` must say why the cache replay cannot serve
a model whose cache keeps recurrent states or an indexer.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from fixtures.census import census
from fixtures.transformers_range import require_fixed, require_model_type
from torch import nn

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.jacobian.sequence import CACHE, SEQUENCE, choose_replay
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.model.checks import readout_problems

SIZES = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    intermediate_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
IDS = torch.tensor([5, 17, 42, 99, 3, 250, 77, 310, 11, 12])


def build(model_type: str, **config) -> nn.Module:
    require_model_type(model_type)
    cfg = transformers.AutoConfig.for_model(model_type, **{**SIZES, **config})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


HYBRID_STACKS = {
    "jamba": dict(
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
        mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False,
    ),
    "olmo_hybrid": dict(num_key_value_heads=2),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(HYBRID_STACKS))
def test_blocks_of_several_classes_are_located(model_type, one_thread):
    model = build(model_type, **HYBRID_STACKS[model_type])
    parts = locate_model_parts(model)
    assert parts.blocks == list(model.model.layers)
    assert len({type(b) for b in parts.blocks}) == 2
    assert readout_problems(model, parts, IDS) == []
    assert choose_replay(model)[0] == SEQUENCE


def test_no_module_list_message_names_the_decoder_it_searched():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.LlamaConfig(**SIZES)
            self.model = nn.Sequential(nn.Linear(64, 64))

    with pytest.raises(UnsupportedModelError, match="found no non-empty nn.ModuleList"):
        locate_model_parts(Flat())


def test_modernbert_decoder_blocks_are_under_its_model_not_its_projection(one_thread):
    model = build("modernbert-decoder")
    assert isinstance(model.get_decoder(), nn.Linear)  # why the locator may not trust it
    parts = locate_model_parts(model)
    assert parts.blocks == list(model.model.layers)
    assert readout_problems(model, parts, IDS) == []


@pytest.mark.parametrize(
    ("model_type", "width"), [("bert", None), ("electra", 128), ("rembert", 96)]
)
def test_head_transforms_are_read_out_through(model_type, width, one_thread):
    extra = {"is_decoder": True}
    if model_type == "electra":
        extra["embedding_size"] = width
    if model_type == "rembert":
        extra |= {"input_embedding_size": 32, "output_embedding_size": width}
    model = build(model_type, **extra)
    parts = locate_model_parts(model)
    if width is not None:
        assert parts.unembed_weight.shape[1] == width != parts.d_model
    assert isinstance(parts.final_norm, nn.Sequential)
    assert readout_problems(model, parts, IDS) == []


def test_a_peft_wrapped_model_is_not_read_out_through_itself(one_thread):
    """The container of a LoRA-wrapped model's lm_head is the causal LM, not a head."""
    peft = pytest.importorskip("peft")
    model = build("gpt2")
    config = peft.LoraConfig(r=2, target_modules=["c_attn"], lora_alpha=4, fan_in_fan_out=True)
    wrapped = peft.get_peft_model(model, config).eval()
    parts = locate_model_parts(wrapped)
    assert not isinstance(parts.final_norm, nn.Sequential)
    assert readout_problems(wrapped, parts, IDS) == []


@pytest.mark.parametrize(
    ("model_type", "config", "replay", "why"),
    [
        ("llama", {}, CACHE, ""),
        ("mamba", {"state_size": 8}, SEQUENCE, "recurrent, scan or convolution state"),
        (
            "lfm2",
            {"layer_types": ["conv", "full_attention"] * 2, "num_key_value_heads": 2},
            SEQUENCE,
            "layers [0, 2]",
        ),
        (
            "deepseek_v32",
            {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16},
            SEQUENCE,
            "sparse-attention indexer",
        ),
        ("openai-gpt", {}, SEQUENCE, "returns NoneType"),
    ],
)
def test_choose_replay_says_why_the_cache_cannot_serve(model_type, config, replay, why):
    if model_type == "lfm2":
        require_fixed("lfm2 own cache")
    model = build(model_type, **config)
    chosen, reason = choose_replay(model)
    assert chosen == replay and why in reason


def _model_norm(model):
    return model.roberta_prelayernorm.LayerNorm


def _encoder_norm(model):
    return model.roberta.encoder.LayerNorm


OWN_READOUTS = {
    "roberta-prelayernorm": ({"is_decoder": True}, _model_norm),
    "xlm-roberta-xl": ({"is_decoder": True}, _encoder_norm),
    "xlstm": ({}, lambda model: model.backbone.out_norm),
}


@pytest.mark.parametrize("model_type", list(OWN_READOUTS))
def test_final_norms_under_their_own_names_are_read_out(model_type, one_thread):
    """A final LayerNorm on the model or its encoder, xLSTM's out_norm and output soft-cap."""
    extra, norm = OWN_READOUTS[model_type]
    if model_type == "xlstm":
        require_fixed("xlstm chunks")
    model = census.build(model_type, **extra)
    parts = locate_model_parts(model)
    final = parts.final_norm
    modules = list(final) if isinstance(final, nn.Sequential) else [final]
    assert modules[0] is norm(model)
    if model_type == "xlstm":
        assert parts.logit_softcap == model.config.output_logit_soft_cap
    assert readout_problems(model, parts, IDS) == []


def test_inkling_reads_out_through_its_width_multiplier(one_thread):
    """Inkling's logits are ``lm_head(x / m)``: the lens's logit scale is 1 / m."""
    require_model_type("inkling_text")
    model = census.build("inkling_text")
    parts = locate_model_parts(model)
    assert parts.logit_scale == 1 / model.config.logits_mup_width_multiplier != 1
    assert readout_problems(model, parts, IDS) == []
