"""Fail early: models the engine cannot use, and read-outs that are not the model's own."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.harness import preflight
from lm_coupling.model import architecture, checks
from lm_coupling.model.architecture import locate_model_parts, register_override
from lm_coupling.selection import make_selection

ALL = make_selection("all")
TRAJECTORY = make_selection("lss,expodistance")
PROMPT = "The sun is a star. Water boils at one hundred degrees"


@pytest.fixture
def restore_overrides():
    """Undo any register_override a test makes (the table is global)."""
    saved = copy.deepcopy(architecture._OVERRIDES)
    yield
    architecture._OVERRIDES.clear()
    architecture._OVERRIDES.update(saved)


@pytest.fixture
def prompt_ids(tokenizer):
    return torch.tensor(tokenizer(PROMPT)["input_ids"])


def _from_config(config) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _bert(tokenizer, **extra) -> transformers.PreTrainedModel:
    return _from_config(
        transformers.BertConfig(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, **extra,
        )
    )  # fmt: skip


def _mamba(tokenizer) -> transformers.PreTrainedModel:
    config = transformers.MambaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, state_size=4
    )
    return _from_config(config)


def _gemma2(tokenizer, softcap: float = 0.5) -> transformers.PreTrainedModel:
    return _from_config(
        transformers.Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
            final_logit_softcapping=softcap, initializer_range=0.2,
        )
    )  # fmt: skip


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_decoders_pass_both_checks(model_type, tiny_model, prompt_ids):
    model = tiny_model(model_type)
    parts = locate_model_parts(model)
    probe = preflight.check_model(model, parts, ALL)
    assert probe.causal and probe.max_change == 0.0
    assert probe.cache_has_layers and probe.cache == "DynamicCache"
    assert checks.readout_problems(model, parts, prompt_ids) == []
    preflight.check_readout(model, parts, prompt_ids, ALL)


def test_bidirectional_bert_is_refused_for_every_metric(tokenizer):
    model = _bert(tokenizer)
    parts = locate_model_parts(model)  # the locator alone accepts it
    with pytest.raises(UnsupportedModelError) as info:
        preflight.check_model(model, parts, TRAJECTORY)
    message = str(info.value)
    assert "BertLMHeadModel (model_type='bert') is not a causal decoder" in message
    assert "none of its metrics can run" in message


def test_mamba_is_accepted_for_coupling_through_the_sequence_replay(tokenizer, prompt_ids):
    """A recurrent-state cache is no longer a refusal: the engine replays whole sequences."""
    model = _mamba(tokenizer)
    parts = locate_model_parts(model)
    probe = preflight.check_model(model, parts, ALL)
    assert probe.causal
    assert probe.replay[0] == "sequence"
    assert "keep a recurrent, scan or convolution state" in probe.replay[1]
    preflight.check_readout(model, parts, prompt_ids, ALL)
    preflight.check_differentiable(model, parts, prompt_ids, ALL)


def test_several_residual_streams_are_named_by_architecture(tokenizer):
    """Gemma-3n's AltUp streams are one flattened state; a view of its blocks that keeps
    them apart is refused under AltUp's name, not as hyper-connections."""
    config = transformers.Gemma3nTextConfig(
        vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer),
        hidden_size=32, intermediate_size=[64] * 2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_kv_shared_layers=0,
        hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 2, layer_types=["full_attention"] * 2,
    )  # fmt: skip
    model = _from_config(config)
    parts = locate_model_parts(model)
    probe = preflight.check_model(model, parts, TRAJECTORY)
    assert probe.hidden_shape == (1, checks.PROBE_TOKENS, 2 * 32) and parts.d_model == 64
    # the model's own layers, streams apart ([k, B, T, d]): no metric is defined on them
    apart = dataclasses.replace(parts, blocks=list(model.model.layers), hidden_size=32)
    with pytest.raises(UnsupportedModelError) as info:
        preflight.check_model(model, apart, TRAJECTORY)
    message = str(info.value)
    assert "AltUp streams and per-layer inputs (Gemma-3n)" in message
    assert "hyper-connection" not in message and "none of its metrics can run" in message


def test_a_type_error_inside_a_model_that_takes_use_cache_propagates(tiny_model):
    """Only a forward without a use_cache argument means "keeps no cache"; a bug is raised."""
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)

    def broken(module, args, kwargs):
        if kwargs.get("use_cache"):
            raise TypeError("a bug inside the model")

    handle = model.register_forward_pre_hook(broken, with_kwargs=True)
    try:
        with pytest.raises(TypeError, match="a bug inside the model"):
            checks.probe_model(model, parts)
    finally:
        handle.remove()
    assert checks.probe_model(model, parts).cache == "DynamicCache"


def test_wrong_final_norm_override_is_caught(tiny_model, prompt_ids, restore_overrides):
    model = tiny_model("llama")
    register_override("llama", final_norm=())  # the real model applies model.norm
    parts = locate_model_parts(model)
    (problem,) = checks.readout_problems(model, parts, prompt_ids)
    assert problem.startswith("unembed(final_norm(x^L)) differs from the model's logits")
    with pytest.raises(UnsupportedModelError) as info:
        preflight.check_readout(model, parts, prompt_ids, ALL)
    message = str(info.value)
    assert "LlamaForCausalLM (model_type='llama') is not the model's own function" in message
    assert "final norm none (identity)" in message
    assert "register_override('llama'" in message
    assert "can still run: lss, expodistance, equidistance" in message
    # Metrics that read no lens are not stopped by it.
    preflight.check_readout(model, parts, prompt_ids, TRAJECTORY)


def test_gemma2_soft_capping_is_part_of_the_read_out(tokenizer, prompt_ids, restore_overrides):
    model = _gemma2(tokenizer)
    assert checks.readout_problems(model, locate_model_parts(model), prompt_ids) == []
    register_override("gemma2", logit_softcap=0)  # an override that forgets the cap
    parts = locate_model_parts(model)
    assert parts.logit_softcap is None
    with pytest.raises(UnsupportedModelError, match="soft-cap None"):
        preflight.check_readout(model, parts, prompt_ids, ALL)


def test_logit_scale_override_is_applied(tiny_model, prompt_ids, restore_overrides):
    model = tiny_model("gpt2")
    register_override("gpt2", logit_scale=2.0)  # gpt2 has no logit scale
    parts = locate_model_parts(model)
    assert parts.logit_scale == 2.0
    assert checks.readout_problems(model, parts, prompt_ids)


def test_blocks_that_do_not_compose_are_caught(tiny_model, prompt_ids):
    model = tiny_model("llama", seed=3)
    parts = locate_model_parts(model)

    def adapter(module, args, kwargs):  # a module running between blocks 1 and 2
        hidden = args[0] if args else kwargs["hidden_states"]
        if args:
            return (hidden * 1.5, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden * 1.5}

    handle = parts.blocks[1].register_forward_pre_hook(adapter, with_kwargs=True)
    try:
        problems = checks.readout_problems(model, parts, prompt_ids)
        with pytest.raises(UnsupportedModelError, match="block 2 does not consume block 1"):
            preflight.check_readout(model, parts, prompt_ids, ALL)
        # Trajectory metrics alone do not need the blocks to compose.
        preflight.check_readout(model, parts, prompt_ids, TRAJECTORY)
    finally:
        handle.remove()
    assert problems == ["block 2 does not consume block 1's output (a module runs between "
                        "located blocks, or the block list is not the decoder's)"]  # fmt: skip


@pytest.mark.slow
def test_first_captured_batch_stops_a_real_run(tmp_path, tokenizer, restore_overrides):
    """Through lm-eval's own evaluator: the wrong read-out stops the run at its first batch."""
    from fixtures.tiny import save_tiny_model

    import lm_coupling

    path = save_tiny_model(tmp_path / "gpt2", "gpt2", tokenizer=tokenizer, init_std=0.2)
    register_override("gpt2", final_norm=())  # gpt2 applies transformer.ln_f
    out = tmp_path / "results"
    with pytest.raises(UnsupportedModelError) as info:
        lm_coupling.evaluate(
            model_args={"pretrained": str(path)},
            tasks=["lmc_arc_easy_offline"],
            metrics="logit_lens_entropy",
            batch_size=2,
            device="cpu",
            limit=2,
            output_path=str(out),
        )
    message = str(info.value)
    assert "GPT2LMHeadModel (model_type='gpt2') is not the model's own function" in message
    assert "register_override('gpt2'" in message
    assert not out.exists() or not list(out.rglob("*.json"))  # nothing written


def test_the_replay_is_chosen_only_when_a_metric_reads_jacobians(tokenizer):
    """Choosing the Jacobian engine's replay runs the model; without a Jacobian metric it is not."""
    model = _mamba(tokenizer)
    parts = locate_model_parts(model)
    assert preflight.check_model(model, parts, TRAJECTORY).replay is None
    assert preflight.check_model(model, parts, ALL).replay[0] == "sequence"
