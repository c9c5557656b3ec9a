"""The split attention over a frozen prefix against SDPA on the concatenation, and in the engine.

References: ``torch.nn.functional.scaled_dot_product_attention`` on
``cat(prefix, new)`` (values, and JVPs under ``vmap``); the engine's Jacobians
with the split attention against the papers' naive route and against the
same model in eager attention (where the split cannot apply).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from fixtures.tiny import tiny_config
from fixtures.transformers_range import require_fixed
from torch.nn.attention import SDPBackend, sdpa_kernel

from lm_coupling.jacobian.calls import engine_mode, record_last_token, run_prompts
from lm_coupling.jacobian.engine import JacobianEngine, naive_block_jacobians
from lm_coupling.jacobian.frozen_attention import SPLIT_ATTENTION, split_attention
from lm_coupling.jacobian.sequence import CACHE, choose_replay
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.builtin.coupling import pair_reduction

F64 = torch.float64
IDS = torch.tensor([5, 17, 42, 99, 3, 250, 77, 310])


def _inputs(B=2, H=4, H_kv=2, n=6, dh=8, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    return (
        randn(B, H, 1, dh),
        randn(B, H_kv, 1, dh),
        randn(B, H_kv, 1, dh),
        randn(B, H_kv, n, dh),
        randn(B, H_kv, n, dh),
    )


def _sdpa_reference(q, k, v, K0, V0, mask, scale):
    keys, values = torch.cat([K0, k], -2), torch.cat([V0, v], -2)
    groups = q.shape[1] // k.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


def _masks(B, H, n):
    padding = torch.ones(B, 1, 1, n + 1, dtype=torch.bool)
    padding[0, :, :, :2] = False  # document 0 is left-padded by two positions
    additive = torch.randn(B, H, 1, n + 1, generator=torch.Generator().manual_seed(1), dtype=F64)
    return {"none": None, "bool-padding": padding, "additive-per-head": additive}


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("mask_name", ["none", "bool-padding", "additive-per-head"])
@pytest.mark.parametrize(("H", "H_kv"), [(4, 4), (4, 2), (4, 1)])
def test_split_attention_equals_sdpa_on_the_concatenation(per_head, mask_name, H, H_kv):
    q, k, v, K0, V0 = _inputs(H=H, H_kv=H_kv)
    mask = _masks(2, H, K0.shape[2])[mask_name]
    expected = _sdpa_reference(q, k, v, K0, V0, mask, 0.3)
    actual = split_attention(q, k, v, K0, V0, mask, 0.3, per_head=per_head)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_head", [True, False])
def test_split_attention_shares_one_prefix_across_a_batch(per_head):
    q, k, v, K0, V0 = _inputs(B=3)
    K0, V0 = K0[:1], V0[:1]
    shared = (K0.expand(3, -1, -1, -1), V0.expand(3, -1, -1, -1))
    expected = _sdpa_reference(q, k, v, *shared, None, None)
    actual = split_attention(q, k, v, K0, V0, None, None, per_head=per_head)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_split_attention_jvps_under_vmap_equal_the_concatenation():
    """The reason it exists: vectorized tangents through the prefix give the same products."""
    q, k, v, K0, V0 = _inputs()
    mask = _masks(2, 4, K0.shape[2])["bool-padding"]
    tangents = torch.randn(5, *q.shape, generator=torch.Generator().manual_seed(2), dtype=F64)

    def products(attention):
        def push(t):
            return torch.func.jvp(lambda x: attention(x, k * x.sum(), v), (q,), (t,))[1]

        return torch.func.vmap(push)(tangents)

    split = products(lambda x, kk, vv: split_attention(x, kk, vv, K0, V0, mask, None))
    with sdpa_kernel([SDPBackend.MATH]):  # the one SDPA backend with forward-mode AD
        concat = products(lambda x, kk, vv: _sdpa_reference(x, kk, vv, K0, V0, mask, None))
    torch.testing.assert_close(split, concat, rtol=1e-12, atol=1e-12)


def _model(model_type: str, attn: str, **overrides):
    config = tiny_config(model_type, 512, d_model=32, n_layers=2, n_heads=4, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(F64).eval()


ARCHITECTURES = {
    "gpt2": {},
    "llama-gqa": {"num_key_value_heads": 2},
    "gpt_neox": {},
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_sdpa_models_take_the_split_path_with_the_same_jacobians(name):
    model_type = name.split("-")[0]
    if model_type == "gpt2":
        require_fixed("gpt2 own sdpa branch")
    model = _model(model_type, "sdpa", **ARCHITECTURES[name])
    parts = locate_model_parts(model)
    prefixes = run_prompts(model, parts, [IDS]).prefixes
    with engine_mode(model):
        calls = record_last_token(model, parts, [IDS], F64, prefixes)
    assert all(call.split_prefix for call in calls)
    J = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=4).dense_jacobians(IDS)
    naive = naive_block_jacobians(model, parts, IDS)
    # RMSNorm and NeoX's rotary path upcast to float32 inside the model (see test_jacobian).
    tol = 1e-10 if model_type == "gpt2" else 1e-6
    torch.testing.assert_close(J, naive, rtol=0, atol=tol * naive.abs().max().item())


def test_batched_documents_with_padding_through_the_split_path():
    model = _model("llama", "sdpa", num_key_value_heads=2)
    parts = locate_model_parts(model)
    prompts = [IDS, IDS[:5], torch.tensor([7, 8, 9])]
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=4, method="dense")
    batched = engine.factors_batch(prompts)
    for prompt, factors in zip(prompts, batched, strict=True):
        alone = engine.factors(prompt)
        torch.testing.assert_close(factors.A, alone.A, rtol=0, atol=1e-6)
        torch.testing.assert_close(factors.S, alone.S, rtol=0, atol=1e-6)


def test_eager_models_keep_the_concatenating_cache():
    model = _model("gpt2", "eager")
    parts = locate_model_parts(model)
    prefixes = run_prompts(model, parts, [IDS]).prefixes
    with engine_mode(model):
        calls = record_last_token(model, parts, [IDS], F64, prefixes)
    assert not any(call.split_prefix for call in calls)
    sdpa = _model("gpt2", "sdpa")
    J_eager = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=4).dense_jacobians(
        IDS
    )
    J_sdpa = JacobianEngine(sdpa, locate_model_parts(sdpa), k_max=4).dense_jacobians(IDS)
    torch.testing.assert_close(J_eager, J_sdpa, rtol=0, atol=1e-10)


def test_the_engine_switches_only_its_own_model_and_leaves_sdpa_alone():
    """A second model run while the engine works (from a hook) gives its outputs without engine."""
    from transformers.modeling_utils import AttentionInterface

    before = dict(AttentionInterface._global_mapping)
    model = _model("llama", "sdpa", num_key_value_heads=2)  # the split path on every release
    other = _model("gpt2", "sdpa")
    with torch.no_grad():
        alone = other(IDS[None]).logits
    during, names = [], []

    def use_other(module, args, output):
        if len(during) < 3:
            sdpa = AttentionInterface._global_mapping["sdpa"] is before["sdpa"]
            pair = (model.config._attn_implementation, other.config._attn_implementation)
            names.append((*pair, sdpa))
            with torch.no_grad():
                during.append(other(IDS[None]).logits)

    parts = locate_model_parts(model)
    assert choose_replay(model)[0] == CACHE  # its probe runs before the hook: the engine's passes
    handle = parts.blocks[-1].register_forward_hook(use_other)
    try:
        JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=4).factors(IDS)
    finally:
        handle.remove()
    assert AttentionInterface._global_mapping["sdpa"] is before["sdpa"]
    assert model.config._attn_implementation == "sdpa"
    assert (SPLIT_ATTENTION, "sdpa", True) in names
    assert len(during) == 3
    for logits in during:
        torch.testing.assert_close(logits, alone, rtol=0, atol=1e-12)


def test_falcon_with_its_own_sdpa_branch_keeps_sdpa_inside_the_engine():
    model = _model("falcon", "sdpa")
    parts = locate_model_parts(model)
    with engine_mode(model):
        assert model.config._attn_implementation == "sdpa"
    prefixes = run_prompts(model, parts, [IDS]).prefixes
    with engine_mode(model):
        calls = record_last_token(model, parts, [IDS], F64, prefixes)
    assert not any(call.split_prefix for call in calls)
