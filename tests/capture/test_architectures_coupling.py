"""Coupling on every causal architecture, against an independent whole-sequence Jacobian.

``TABLE`` is the list of architectures the suite checks in depth and what it
checks on each (every attention implementation, sliding windows, experts);
``docs/architectures.md`` is the census of every causal LM of the installed
transformers (``bench/census.py``, tested in ``tests/bench/test_census.py``).

Per coupled architecture (tiny: 4 blocks, d = 64, float64 where the model
allows it), with each attention implementation it supports:

- the lens read-out ``unembed(final_norm(x^L))`` reproduces the model's logits
  and the located blocks compose to the model (``readout_problems``);
- per document, the engine's top singular values and coupling (``K = 4``,
  batches of 4 prompts and of 1, every prompt longer than any sliding
  window) equal those of the reference: ``J^l`` by reverse-mode autograd
  (``torch.autograd.functional.jacobian``, d backward passes) through the
  block called on the whole sequence recorded from the model's own forward
  pass without cache, the model's own attention and modules, no engine.

Models whose cache holds more than keys and values (Mamba, hybrids, linear
attention, RG-LRU) are replayed on the whole sequence
(``jacobian.sequence``); Gemma-3n's AltUp streams are measured as one
state, the k streams flattened (``model.block_calls``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import transformers
from fixtures.census import census
from fixtures.transformers_range import (
    INSTALLED,
    LATER_MODEL_TYPES,
    PINNED,
    experts_kwargs,
    is_fixed,
    require_experts_implementation,
    require_fixed,
    require_model_type,
)

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.harness import preflight
from lm_coupling.jacobian.calls import _truncated_prefix
from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.jacobian.engine_mode import engine_mode
from lm_coupling.jacobian.sequence import _is_resource_failure, choose_replay
from lm_coupling.metrics.coupling import coupling_matrices_dense, coupling_score, miscoupling
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.model.checks import readout_problems
from lm_coupling.plugins.builtin.coupling import pair_reduction
from lm_coupling.selection import make_selection

F64, F32 = torch.float64, torch.float32
K = 4
WINDOW = census.WINDOW
LOCAL_GLOBAL = ["sliding_attention", "full_attention"] * 2

_SIZES = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
    max_position_embeddings=256, vocab_size=512, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip
_GQA = dict(num_key_value_heads=2, head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True)
class Arch:
    """One row of the table: how to build the tiny model and what the suite verifies."""

    model_type: str
    config: dict = field(default_factory=dict)
    attention: tuple[str, ...] = ("eager", "sdpa")
    dtype: torch.dtype = F64
    experts: str | None = None
    refused: str = ""
    """Empty: coupling is verified. Else a phrase of the refusal at load."""
    note: str = ""


TABLE: dict[str, Arch] = {
    "mistral": Arch("mistral", {**_GQA, "sliding_window": WINDOW}, note="sliding window"),
    "ministral": Arch(
        "ministral",
        {**_GQA, "sliding_window": WINDOW, "layer_types": LOCAL_GLOBAL},
        note="local and global layers",
    ),
    "gemma2": Arch(
        "gemma2",
        {**_GQA, "sliding_window": WINDOW, "layer_types": LOCAL_GLOBAL},
        attention=("eager",),
        note="local and global layers; soft-capped attention (no SDPA in transformers)",
    ),
    "gemma3_text": Arch(
        "gemma3_text",
        {**_GQA, "sliding_window": WINDOW, "layer_types": LOCAL_GLOBAL},
        note="local and global layers",
    ),
    "cohere2": Arch(
        "cohere2",
        {**_GQA, "sliding_window": WINDOW, "layer_types": LOCAL_GLOBAL},
        note="local and global layers, logit scale",
    ),
    "starcoder2": Arch("starcoder2", {**_GQA, "sliding_window": WINDOW}, note="sliding window"),
    "olmo3": Arch(
        "olmo3",
        {**_GQA, "sliding_window": WINDOW, "layer_types": LOCAL_GLOBAL},
        note="local and global layers",
    ),
    "gpt_oss": Arch(
        "gpt_oss",
        {**_GQA, "sliding_window": WINDOW, "layer_types": LOCAL_GLOBAL}
        | {"num_local_experts": 4, "num_experts_per_tok": 2},
        attention=("eager",),
        experts="eager",
        note="local and global layers, attention sinks, mixture of experts",
    ),
    "bloom": Arch(
        "bloom",
        {"n_embed": 64, "n_layer": 4, "n_head": 4},
        attention=("eager",),
        note="ALiBi; its GELU is a custom autograd.Function, replaced inside the engine",
    ),
    "falcon-alibi": Arch(
        "falcon",
        {"alibi": True, "new_decoder_architecture": False, "multi_query": False},
        note="ALiBi: transformers' eager and SDPA paths compute different functions",
    ),
    "llama4_text": Arch(
        "llama4_text",
        {**_GQA, "num_local_experts": 2, "num_experts_per_tok": 1}
        | {"intermediate_size_mlp": 128, "attention_chunk_size": 4, "no_rope_layers": [1, 0] * 2},
        experts="eager",
        note="chunked attention, mixture of experts; decoder under `model`",
    ),
    "biogpt": Arch("biogpt", note="final norm `layer_norm`, scaled embedding"),
    "xglm": Arch(
        "xglm",
        {"d_model": 64, "num_layers": 4, "attention_heads": 4, "ffn_dim": 128},
        attention=("eager",),
        dtype=F32,
        note="final norm `layer_norm`; float32 (its eager attention fails in float64)",
    ),
    "mixtral": Arch(
        "mixtral",
        {**_GQA, "num_local_experts": 4, "num_experts_per_tok": 2},
        experts="eager",
        note="mixture of experts",
    ),
    "qwen3_moe": Arch(
        "qwen3_moe",
        {**_GQA, **_MOE, "decoder_sparse_step": 1},
        experts="eager",
        note="mixture of experts",
    ),  # fmt: skip
    "olmoe": Arch(
        "olmoe",
        {**_GQA, "num_experts": 4, "num_experts_per_tok": 2},
        experts="eager",
        note="mixture of experts",
    ),
    "deepseek_v3": Arch(
        "deepseek_v3",
        {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2}
        | {"moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1}
        | {"topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "v_head_dim": 16}
        | {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8},
        experts="eager",
        note="multi-head latent attention (its cache holds latents: concatenating path), "
        "mixture of experts",
    ),
    "falcon_h1": Arch(
        "falcon_h1",
        {**_GQA, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16}
        | {"mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 4},
        dtype=F32,
        note="attention and Mamba-2 state in every layer; sequence replay",
    ),
    "qwen3_next": Arch(
        "qwen3_next",
        {**_GQA, **_MOE, "layer_types": ["linear_attention", "full_attention"] * 2}
        | {"linear_num_value_heads": 4, "linear_num_key_heads": 2}
        | {"linear_key_head_dim": 16, "linear_value_head_dim": 16},
        dtype=F32,
        experts="eager",
        note="gated delta-rule (linear attention) layers; sequence replay",
    ),
    "lfm2": Arch(
        "lfm2",
        {**_GQA, "layer_types": ["conv", "full_attention"] * 2},
        dtype=F32,
        note="short-convolution layers; final norm `embedding_norm`; sequence replay",
    ),
    "recurrent_gemma": Arch(
        "recurrent_gemma",
        {**_GQA, "attention_window_size": WINDOW, "block_types": ["recurrent", "attention"]}
        | {"lru_width": 64},
        attention=("eager",),
        dtype=F32,
        note="RG-LRU recurrence (its clipped-gradient sqrt replaced inside the engine); "
        "final norm `final_norm`; sequence replay",
    ),
    "mamba": Arch(
        "mamba",
        {"state_size": 8, "expand": 2, "conv_kernel": 4},
        attention=("eager",),
        note="selective scan, every cache layer a recurrent state; sequence replay",
    ),
    "gemma3n_text": Arch(
        "gemma3n_text",
        {**_GQA, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 16}
        | {"vocab_size_per_layer_input": 512, "laurel_rank": 8, "altup_num_inputs": 2}
        | {"intermediate_size": [128] * 4, "activation_sparsity_pattern": [0.0] * 4}
        | {"layer_types": LOCAL_GLOBAL, "sliding_window": WINDOW},
        dtype=F32,
        note="AltUp streams [k, B, T, d] (the state: the k streams flattened), per-layer inputs",
    ),
    "cpmant": Arch(
        "cpmant",
        refused="is not a causal decoder",
        note="its attention looks ahead: the states at the last token would see the answer",
    ),
}
"""Architectures the suite checks (model_type must exist in the installed transformers)."""

COUPLED = [name for name, arch in TABLE.items() if not arch.refused]
CASES = [(name, attn) for name in COUPLED for attn in TABLE[name].attention]
PROMPTS = [torch.tensor(p) for p in census.PROMPTS]
"""The census's four prompts of 8 to 16 tokens, longer than the sliding windows and chunks."""


def dtype_of(name: str) -> torch.dtype:
    """The row's dtype; DeepSeek-V3 in float32 where transformers cannot run it in float64."""
    if name == "deepseek_v3" and not is_fixed("deepseek_v3 float64"):
        return F32
    return TABLE[name].dtype


def replay_of(name: str) -> str:
    """The replay the engine must pick for a row (Llama-4: see `DIFFERENCES`)."""
    if name == "llama4_text" and not is_fixed("llama4 cache replay"):
        return "sequence"
    return "sequence" if "sequence replay" in TABLE[name].note else "cache"


def build(name: str, attn: str, **config) -> transformers.PreTrainedModel:
    """The tiny model of a table row (seeded, eval mode, in the row's dtype)."""
    arch = TABLE[name]
    require_model_type(arch.model_type)
    sizes = {**_SIZES, **arch.config, **config}
    cfg = transformers.AutoConfig.for_model(arch.model_type, **sizes)
    extra = experts_kwargs(arch.experts)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, **extra)
    return model.to(dtype_of(name)).eval()


@pytest.fixture(scope="module")
def models():
    """Cached tiny models by (row, attention)."""
    cache = {}

    def get(name: str, attn: str = "eager"):
        if (name, attn) not in cache:
            cache[name, attn] = build(name, attn)
        return cache[name, attn]

    return get


def reference_jacobians(model, parts, ids: torch.Tensor) -> torch.Tensor:
    """``[L, d, d]`` J^l at the last position by autograd through the whole sequence.

    The census's independent definition (``bench/census.py``): each block's
    call is recorded by a pre-hook on the model's own forward pass (no cache),
    then the block is called on the sequence with its last row replaced,
    outside any engine context.
    """
    return census.reference_jacobians(model, parts, ids)


def coupling_of(A: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Mean coupling c_K over ordered pairs l != l' (the default coupling metric)."""
    return coupling_score(miscoupling(A[..., :K, :K], S[:, :K]))


def reference_coupling(J: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S [L, K+1], c_K)`` of the reference Jacobians (full SVD, the dense formula)."""
    U, S, Vh = torch.linalg.svd(J)
    A = coupling_matrices_dense(J, U[..., :K], Vh.transpose(-1, -2)[..., :K])
    return S[:, : K + 1], coupling_of(A, S)


@pytest.mark.parametrize(("name", "attn"), CASES, ids=[f"{n}-{a}" for n, a in CASES])
def test_coupling_equals_the_whole_sequence_jacobian(name, attn, models, one_thread):
    if name == "gemma3n_text":
        require_fixed("gemma3n in-place clamp")
    model = models(name, attn)
    parts = locate_model_parts(model)
    streams = getattr(model.config, "altup_num_inputs", 1)  # the state: k streams flattened
    assert (parts.n_layers, parts.d_model) == (4, 64 * streams)
    assert readout_problems(model, parts, PROMPTS[-1]) == []
    # The route is the probe's (`choose_replay`: the model's cache and a cache replay of a
    # probe prompt against its own forward pass), never timing or load: say why on failure.
    route, why = choose_replay(model)
    assert route == replay_of(name), f"{name}-{attn}: {route} replay because {why}"
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K, method="dense")
    batched = engine.factors_batch(PROMPTS)
    assert [f.replay for f in batched] == [replay_of(name)] * len(PROMPTS)
    (alone,) = engine.factors_batch(PROMPTS[:1])
    # Norms upcast to float32 inside several models (RMSNorm): float32 round-off remains.
    tol = 1e-6 if dtype_of(name) == F64 else 2e-4
    for ids, factors in zip(PROMPTS, batched, strict=True):
        S, c = reference_coupling(reference_jacobians(model, parts, ids))
        torch.testing.assert_close(factors.S, S, rtol=tol, atol=tol * float(S.max()))
        torch.testing.assert_close(coupling_of(factors.A, factors.S), c, rtol=0, atol=tol * 10)
    torch.testing.assert_close(alone.A, batched[0].A, rtol=0, atol=tol * 10)


def test_a_probe_that_runs_out_of_memory_picks_no_route():
    """The route must not follow the machine's load: such a failure is raised, not a route."""
    assert _is_resource_failure(
        RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")
    )
    assert _is_resource_failure(MemoryError())
    assert _is_resource_failure(RuntimeError("Resource temporarily unavailable"))
    assert not _is_resource_failure(RuntimeError("The size of tensor a (7) must match (8)"))
    assert not _is_resource_failure(AttributeError("'DynamicCache' has no attribute 'compressor'"))


@pytest.mark.parametrize("window", [2, 6, 64])
def test_sliding_window_jacobians_follow_the_window(window, one_thread):
    """Windows 2 and 6 are shorter than the prompt, 64 longer; each is the model's own J."""
    model = build("mistral", "sdpa", sliding_window=window)
    parts = locate_model_parts(model)
    ids = PROMPTS[-1]
    J = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K).dense_jacobians(ids)
    reference = reference_jacobians(model, parts, ids)
    torch.testing.assert_close(J, reference, rtol=0, atol=1e-10 * float(reference.abs().max()))
    if window < ids.shape[0]:  # the window changes the function: a test that could fail
        full = build("mistral", "sdpa", sliding_window=64)
        other = reference_jacobians(full, locate_model_parts(full), ids)
        assert float((other - reference).abs().max()) > 1e-3


def test_a_sliding_cache_is_not_taken_for_a_whole_prefix():
    """transformers' own sliding cache keeps window - 1 rows: the engine says so, never pads it."""
    model = build("mistral", "sdpa")
    ids = PROMPTS[-1]
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[None], use_cache=True, past_key_values=cache)
    prefix, why = _truncated_prefix(cache, ids.shape[0])
    assert prefix is None
    assert why == f"layers [0, 1, 2, 3] hold [{WINDOW - 1}] rows, not {ids.shape[0]}"
    full = transformers.DynamicCache()
    with torch.no_grad():
        model(ids[None], use_cache=True, past_key_values=full)
    prefix, why = _truncated_prefix(full, ids.shape[0])
    assert why == "" and prefix[0][0].shape[-2] == ids.shape[0] - 1


def _experts(model, ids: torch.Tensor) -> list[list[frozenset[int]]]:
    """Per layer, per position, the set of experts the router picks."""
    arch = TABLE[model.config.model_type]
    top = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(ids[None], output_router_logits=True).router_logits
    assert len(logits) == 4, arch
    return [[frozenset(row.topk(top).indices.tolist()) for row in layer] for layer in logits]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_with_a_last_token_routed_elsewhere(name, models, one_thread):
    model = models(name)
    parts = locate_model_parts(model)
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        ids = torch.randint(1, 500, (10,), generator=generator)
        routes = _experts(model, ids)
        if any(layer[-1] != layer[-2] for layer in routes):
            break
    else:
        pytest.fail("no prompt of 50 routes its last token differently from its neighbour")
    J = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K).dense_jacobians(ids)
    reference = reference_jacobians(model, parts, ids)
    torch.testing.assert_close(J, reference, rtol=0, atol=1e-10 * float(reference.abs().max()))


def test_fused_experts_of_a_default_load_go_through_forward_mode(one_thread):
    """transformers loads Mixtral with grouped_mm experts (no forward-mode AD); JVP routes work."""
    require_experts_implementation("a default load with fused experts")
    config = transformers.AutoConfig.for_model("mixtral", **{**_SIZES, **TABLE["mixtral"].config})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.eval()
    assert model.config._experts_implementation == "grouped_mm"
    parts = locate_model_parts(model)
    ids = PROMPTS[-1]
    factors = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method="krylov"
    ).factors(ids)
    assert model.config._experts_implementation == "grouped_mm"
    S = torch.linalg.svdvals(reference_jacobians(model, parts, ids))[:, : K + 1]
    torch.testing.assert_close(factors.S, S, rtol=1e-4, atol=1e-4 * float(S.max()))


def test_indexer_attention_keeps_its_top_k_mask_inside_the_engine(one_thread):
    """DeepSeek-V3.2's indexer masks all but its top-k keys under "eager"/"sdpa" only.

    Under another attention name the model hands the indices to a sparse kernel
    instead, so the engine must keep "sdpa" (not its split-prefix name) for it;
    with top-k 4 below every prompt's length the selection changes the function.
    """
    require_model_type("deepseek_v32")
    model = census.build("deepseek_v32")
    assert model.config.index_topk < min(len(p) for p in PROMPTS)
    parts = locate_model_parts(model)
    with engine_mode(model):
        assert model.config._attn_implementation == "sdpa"
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K, method="dense")
    prompts = [PROMPTS[0], PROMPTS[3]]
    tol = 1e-6 if next(model.parameters()).dtype == F64 else 2e-4
    for ids, factors in zip(prompts, engine.factors_batch(prompts), strict=True):
        S, c = reference_coupling(reference_jacobians(model, parts, ids))
        torch.testing.assert_close(factors.S, S, rtol=tol, atol=tol * float(S.max()))
        torch.testing.assert_close(coupling_of(factors.A, factors.S), c, rtol=0, atol=tol * 10)
    dense = census.build("deepseek_v32", index_topk=64)  # every key selected
    reference = reference_jacobians(model, parts, PROMPTS[3])
    other = reference_jacobians(dense, locate_model_parts(dense), PROMPTS[3])
    assert float((other - reference).abs().max()) > 1e-3


REFUSED = [name for name, arch in TABLE.items() if arch.refused]


@pytest.mark.parametrize("name", REFUSED)
def test_refused_at_load_naming_the_architecture(name, models, one_thread):
    model = models(name)
    parts = locate_model_parts(model)
    with pytest.raises(UnsupportedModelError, match=TABLE[name].refused) as info:
        preflight.check_model(model, parts, make_selection("all"))
    assert "can still run" not in str(info.value)


def test_every_model_type_exists_in_transformers():
    """Every row's model type is installed; below the pinned release, or one added later."""
    from transformers import CONFIG_MAPPING

    missing = [a.model_type for a in TABLE.values() if a.model_type not in CONFIG_MAPPING]
    assert [t for t in missing if t not in LATER_MODEL_TYPES] == []
    if INSTALLED >= PINNED:
        assert missing == []
