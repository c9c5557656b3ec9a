"""Contract tests: every transformers internal that model/transformers_adapter.py relies on.

One test per use, on real tiny models of the installed transformers; each
failure message names the adapter function whose assumption broke, so a
transformers release that changes one is caught here and not deep in the engine.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.model import transformers_adapter as tfa
from lm_coupling.model.architecture import locate_model_parts

IDS = torch.tensor([5, 17, 3, 42, 8, 11])


def _broke(use: str, what: str) -> str:
    return f"transformers contract broken: {use} ({what}); update model/transformers_adapter.py"


def _small(model_type: str, **extra) -> transformers.PreTrainedModel:
    sizes = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    if model_type == "gpt2":
        sizes = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64)
    config = transformers.AutoConfig.for_model(model_type, **{**sizes, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_cache_keyword_is_the_forward_argument_that_fills_the_cache(model_type):
    model = _small(model_type)
    name = tfa.cache_keyword(model)
    assert name in ("cache", "past_key_values"), _broke("cache_keyword", name)
    cache = tfa.new_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            out = model(IDS[None], use_cache=True, **tfa.cache_kwargs(model, cache))
    layers = tfa.cache_layers(cache)
    assert layers is not None and len(layers) == 2, _broke(
        "cache_kwargs", f"the cache passed as {name}= was not filled"
    )
    assert tfa.output_cache(out) is cache, _broke("output_cache", "not the cache passed in")


def test_output_cache_reads_the_declared_field_without_a_deprecation():
    model = _small("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            out = model(IDS[None], use_cache=True)
    assert tfa.is_cache(tfa.output_cache(out)), _broke("output_cache / is_cache", type(out))


def test_cache_layers_hold_keys_and_values_per_position():
    model = _small("llama")
    cache = tfa.new_cache()
    with torch.no_grad():
        model(IDS[None], use_cache=True, **tfa.cache_kwargs(model, cache))
    for index, layer in enumerate(tfa.cache_layers(cache)):
        pair = tfa.layer_keys_values(layer)
        assert pair is not None, _broke("layer_keys_values", f"layer {index} has no .keys")
        keys, values = pair
        # llama: [B, H_kv, T, d_head] with H_kv = 4 heads of 32 / 4.
        assert tuple(keys.shape) == (1, 4, IDS.numel(), 8), _broke(
            "layer_keys_values", f"keys of shape {tuple(keys.shape)}"
        )
        assert values.shape == keys.shape, _broke("layer_keys_values", "values' shape")
        assert not tfa.layer_keeps_state(layer), _broke("layer_keeps_state", "attention layer")


def test_new_cache_from_a_config_lays_out_the_models_own_layers():
    model = _small("mistral", sliding_window=3, num_key_value_heads=2, head_dim=8)
    layers = tfa.model_cache_layers(model)
    assert len(layers) == 2, _broke("new_cache(config)", f"{len(layers)} layers, not 2")
    # A sliding-window model's own cache keeps at most the window; the engine's full cache all.
    own, full = tfa.new_cache(model.config), tfa.new_cache()
    with torch.no_grad():
        model(IDS[None], use_cache=True, **tfa.cache_kwargs(model, own))
        model(IDS[None], use_cache=True, **tfa.cache_kwargs(model, full))
    kept = tfa.layer_keys_values(tfa.cache_layers(own)[0])[0].shape[-2]
    every = tfa.layer_keys_values(tfa.cache_layers(full)[0])[0].shape[-2]
    assert every == IDS.numel(), _broke("new_cache()", f"full layers keep {every} rows")
    assert kept < every, _broke("new_cache(config)", "the sliding window is not laid out")


def test_a_recurrent_models_cache_layers_keep_a_state():
    config = transformers.MambaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = tfa.output_cache(model(IDS[None], use_cache=True))
    layers = tfa.cache_layers(cache)
    if layers is None:  # transformers < 5: Mamba returns its own cache, without layers
        assert _major() < 5 and cache is not None, _broke("cache_layers", type(cache).__name__)
        assert tfa.cache_keeps_state(cache), _broke("cache_keeps_state", type(cache).__name__)
        return
    assert not tfa.cache_keeps_state(cache), _broke("cache_keeps_state", "a cache with layers")
    assert layers and all(tfa.layer_keeps_state(layer) for layer in layers), _broke(
        "layer_keeps_state", f"Mamba's layers {[type(x).__name__ for x in layers]}"
    )


def _major() -> int:
    return int(transformers.__version__.split(".")[0])


def test_switching_the_attention_implementation_takes_effect_at_the_next_call():
    model = _small("llama")
    calls = []
    sdpa = tfa.global_attention("sdpa")
    assert callable(sdpa), _broke("global_attention", "no global 'sdpa' entry")

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    tfa.register_attention("lm_coupling_contract", counting)
    config = model.config
    saved, _ = tfa.saved_implementations(config)
    assert tfa.attention_implementation(config) == "eager", _broke(
        "attention_implementation", repr(tfa.attention_implementation(config))
    )
    with torch.no_grad():
        reference = model(IDS[None]).logits
        tfa.set_attention_implementation(config, "lm_coupling_contract")
        try:
            switched = model(IDS[None]).logits
        finally:
            tfa.set_attention_implementation(config, saved)
    assert len(calls) == 2, _broke(
        "set_attention_implementation / register_attention", f"{len(calls)} calls, not 2 layers"
    )
    assert tfa.attention_implementation(config) == "eager", _broke(
        "set_attention_implementation", "not restored"
    )
    torch.testing.assert_close(switched, reference, rtol=1e-5, atol=1e-5)


def test_the_experts_implementation_is_a_switchable_config_field():
    config = transformers.AutoConfig.for_model(
        "mixtral", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=64,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.eval()
    fused = tfa.experts_implementation(model.config)
    if fused is None:  # transformers < 5 has one experts implementation (the loop)
        assert _major() < 5, _broke("experts_implementation", "no experts implementation set")
        return
    assert isinstance(fused, str), _broke("experts_implementation", repr(fused))
    with torch.no_grad():
        reference = model(IDS[None]).logits
        tfa.set_experts_implementation(model.config, "eager")
        try:
            looped = model(IDS[None]).logits
            now = tfa.experts_implementation(model.config)
        finally:
            tfa.set_experts_implementation(model.config, fused)
    assert now == "eager", _broke("set_experts_implementation", repr(now))
    torch.testing.assert_close(looped, reference, rtol=1e-4, atol=1e-5)


def test_bloom_gelu_forward_is_the_tanh_gelu():
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    expected = torch.nn.functional.gelu(x, approximate="tanh")
    torch.testing.assert_close(tfa.bloom_gelu_forward()(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_a_coupling_run_prints_no_deprecation_from_the_packages_own_calls(model_type):
    """No ``FutureWarning`` (transformers' deprecated ``past_key_values``) from the engine."""
    model = _small(model_type)
    parts = locate_model_parts(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        factors = JacobianEngine(model, parts, k_max=2, method="dense").factors(IDS)
    assert torch.isfinite(factors.S).all()


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_choosing_the_replay_logs_no_deprecated_cache_name(model_type):
    """transformers 5.2x logs (``warning_once``, not a warning) when an output's cache is
    read under its old name; the engine's replay probe reads the declared field."""
    import logging

    from lm_coupling.jacobian.sequence import choose_replay

    clear = getattr(logging.Logger.warning_once, "cache_clear", None)  # transformers' "once"
    if clear is not None:
        clear()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        replay, why = choose_replay(_small(model_type))
    finally:
        logger.removeHandler(handler)
    assert replay == "cache", why
    deprecated = [r.getMessage() for r in records if "deprecated" in r.getMessage()]
    assert not deprecated, deprecated


def test_module_with_child_replaced_runs_the_parent_forward_with_the_new_child():
    torch.manual_seed(0)
    parent = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    x = torch.randn(2, 4)
    head = tfa.module_with_child_replaced(parent, "2", torch.nn.Identity())
    expected = torch.tanh(parent[0](x))
    torch.testing.assert_close(head(x), expected, msg=_broke("module_with_child_replaced", "x"))
    assert isinstance(parent[2], torch.nn.Linear), _broke(
        "module_with_child_replaced", "the original module changed"
    )


def test_forward_hooks_are_the_registered_hooks_in_order_with_their_kind():
    module = torch.nn.Linear(2, 2)

    def plain(*args):
        return None

    def keyed(*args):
        return None

    module.register_forward_pre_hook(plain)
    module.register_forward_pre_hook(keyed, with_kwargs=True)
    module.register_forward_hook(keyed, with_kwargs=True)
    module.register_forward_hook(plain)
    pre = tfa.forward_hooks(module, pre=True)
    post = tfa.forward_hooks(module, pre=False)
    assert pre == [(plain, False), (keyed, True)], _broke("forward_hooks", pre)
    assert post == [(keyed, True), (plain, False)], _broke("forward_hooks", post)


def test_loaded_from_is_the_path_of_from_pretrained_and_empty_for_a_built_model(tmp_path):
    model = _small("gpt2")
    assert tfa.loaded_from(model) == "", _broke("loaded_from", "a built model has a path")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert tfa.loaded_from(loaded) == str(tmp_path), _broke("loaded_from", tfa.loaded_from(loaded))


def test_attention_dispatched_by_name_is_whether_a_registered_name_runs():
    """llama looks its attention up by name (a registered function runs); Falcon branches."""
    llama = _small("llama")
    assert tfa.attention_dispatched_by_name(llama), _broke(
        "attention_dispatched_by_name", "llama's modeling source no longer reads as a lookup"
    )
    # What the answer promises: a function registered under a new name runs in its place.
    calls = []
    sdpa = tfa.global_attention("sdpa")

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    tfa.register_attention("lm_coupling_contract_lookup", counting)
    saved, _ = tfa.saved_implementations(llama.config)
    try:
        tfa.set_attention_implementation(llama.config, "lm_coupling_contract_lookup")
        with torch.no_grad():
            llama(IDS[None])
    finally:
        tfa.set_attention_implementation(llama.config, saved)
    assert len(calls) == 2, _broke("attention_dispatched_by_name", f"{len(calls)} lookups")
    falcon = _small("falcon", new_decoder_architecture=False, multi_query=True)
    assert not tfa.attention_dispatched_by_name(falcon), _broke(
        "attention_dispatched_by_name", "Falcon's own SDPA branch is no longer found in its source"
    )
