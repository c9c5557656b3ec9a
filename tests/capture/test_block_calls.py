"""Blocks called more than once per forward pass: a state and a Jacobian per call.

HRM (``hrm_text``, looped depth: a low- and a high-level stack, each run
several times per forward pass) is unrolled into one call site per call
(``model.block_calls``). Checked against an independent computation that
knows nothing of call sites: hooks on the model's own layer modules record
each call's input and output in call order, and ``J`` of each call is taken by
reverse-mode autograd through that module on its recorded whole-sequence
input with the last row variable (the diagonal block at the last position).

DeepSeek-V4's and HY-V4's hyper-connections pass k streams ``[B, T, k, d]`` between its
blocks; the state is the k streams flattened, ``x^l`` in R^{k d}, read out
through the model's own collapse (``hc_head``) and final norm; J^l is
``k d x k d``. The independent check flattens the streams recorded from the
model's own layers.

Dory loops its recurrent section (``n_recurrent_loops`` times) over the layers of
its one layer list: the located layers called twice become one call site per
call. Mllama's text model skips its cross-attention layers without an image:
a block never called on text has no state and is left out.

Zamba-2 shares one attention block between depths, but each use sits inside
its own hybrid layer (``model.layers``), so its blocks are the hybrid layers,
each called once: the same independent check holds with the layers as blocks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from fixtures.transformers_range import experts_kwargs, require_fixed, require_model_type

from lm_coupling.capture.collector import StateCollector
from lm_coupling.capture.lens import LogitLens
from lm_coupling.errors import UnsupportedModelError
from lm_coupling.harness import preflight
from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.metrics.coupling import coupling_matrices_dense, coupling_score, miscoupling
from lm_coupling.metrics.trajectory import line_shape_score
from lm_coupling.model import checks
from lm_coupling.model.architecture import block_output_hidden, locate_model_parts
from lm_coupling.model.block_calls import CallSite, is_unrolled
from lm_coupling.model.checks import readout_problems
from lm_coupling.plugins.builtin.coupling import pair_reduction
from lm_coupling.selection import make_selection

K = 4
PROMPTS = [
    torch.tensor([5, 17, 42, 99, 3, 250]),
    torch.tensor([11, 12, 200, 33, 8, 19, 240, 101, 7]),
    torch.tensor([201, 4, 87, 150, 22, 9, 180, 36]),
    torch.tensor([44, 1, 210, 27, 199, 58, 3, 212, 81, 16, 230]),
]
"""Four prompts of 6 to 11 tokens (a right-padded batch has pads in three rows)."""

_SIZES = dict(
    hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=256,
    max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


_V4 = dict(
    hidden_size=16, num_hidden_layers=2, num_key_value_heads=1, head_dim=16, q_lora_rank=16,
    o_lora_rank=16, o_groups=2, qk_rope_head_dim=8, moe_intermediate_size=16, n_routed_experts=4,
    num_experts_per_tok=2, index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=6,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe"], hc_mult=2,
)  # fmt: skip
"""DeepSeek-V4: both attention kinds (compressed sparse with its indexer, heavily compressed),
hash-routed and learned-routed experts, k = 2 hyper-connection streams of d = 16."""


_HY_V4 = dict(
    hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, head_dim=8, n_routed_experts=4,
    num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, mlp_layer_types=["dense", "sparse"],
    layer_types=["indexed_attention"] * 2, indexer_types=["full", "shared"], index_topk=4,
    index_head_dim=8, index_n_heads=2, hc_mult=2,
)  # fmt: skip
"""HY-V4: indexed attention (a full indexer, then one sharing its top-k), dense and sparse
experts, k = 2 hyper-connection streams of d = 16."""

_GEMMA3N = dict(
    hidden_size=16, intermediate_size=[32] * 4, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, num_kv_shared_layers=2, vocab_size_per_layer_input=256,
    hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
    activation_sparsity_pattern=[0.0] * 4, sliding_window=6,
    layer_types=["sliding_attention", "full_attention"] * 2,
)  # fmt: skip
"""Gemma-3n: k = 2 AltUp streams ``[k, B, T, d]``, per-layer inputs, local and global
layers, the last two reading the keys and values of earlier layers (KV sharing)."""

HYPER = {"deepseek_v4": _V4, "hy_v4": _HY_V4}
STREAMS = {**HYPER, "gemma3n_text": _GEMMA3N}
LEADING = {"gemma3n_text"}
"""Models whose streams axis comes first (``[k, B, T, d]``)."""


def build(model_type: str) -> transformers.PreTrainedModel:
    require_model_type(model_type)
    if model_type in STREAMS:  # float64 needs the eager experts (no grouped_mm)
        sizes = {**_SIZES, **STREAMS[model_type]}
        config = transformers.AutoConfig.for_model(model_type, **sizes)
        torch.manual_seed(0)
        extra = experts_kwargs(None if model_type in LEADING else "eager")
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", **extra
        )
        return model.to(torch.float64).eval()
    if model_type == "hrm_text":
        extra = dict(num_hidden_layers=2, H_cycles=2, L_cycles=2, num_key_value_heads=4)
    elif model_type == "dory":  # input layer, two recurrent layers looped twice, output layer
        extra = dict(
            num_hidden_layers=4, num_key_value_heads=4, head_dim=8, n_input_layers=1,
            n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=2, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )  # fmt: skip
    elif model_type == "mllama":  # text model: layer 2 is a cross-attention layer
        # transformers 4.56 exports MllamaTextConfig from its configuration module only
        from transformers.models.mllama.configuration_mllama import MllamaTextConfig

        config = MllamaTextConfig(  # rope_scaling: 4.56 leaves it None (5.x: the same default)
            **_SIZES, num_hidden_layers=4, num_key_value_heads=4, cross_attention_layers=[2],
            rope_scaling={"rope_type": "default"},
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.MllamaForCausalLM(config)
        return model.to(torch.float64).eval()
    else:  # zamba2: hybrid (shared attention + Mamba-2) and Mamba-2 layers
        extra = dict(
            num_hidden_layers=4, num_key_value_heads=4, mamba_d_state=8, mamba_headdim=8,
            n_mamba_heads=8, mamba_ngroups=1, chunk_size=4, num_mem_blocks=1,
            layers_block_type=["hybrid", "mamba", "hybrid", "mamba"],
        )  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **_SIZES, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(torch.float64).eval()


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(model_type):
        if model_type not in cache:
            cache[model_type] = build(model_type)
        return cache[model_type]

    return get


def _layer_modules(model) -> list[torch.nn.Module]:
    """The model's own layer modules (no call sites): HRM's two stacks, Zamba-2's layers."""
    if model.config.model_type == "hrm_text":
        return [*model.model.L_module.layers, *model.model.H_module.layers]
    return list(model.model.layers)


def _flat(hidden: torch.Tensor, leading: bool = False) -> torch.Tensor:
    """``[B, T, k, d]`` (``[k, B, T, d]`` when ``leading``) ``-> [B, T, k d]``; one stream as is."""
    if hidden.dim() != 4:
        return hidden
    return (hidden.movedim(0, -2) if leading else hidden).flatten(-2)


def independent_calls(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> list[tuple]:
    """Per call, in call order: (module, args, kwargs, output), and the logits at the end.

    ``ids [T]``: one prompt alone, no cache; ``ids [B, T]`` with ``mask``: a padded batch.
    """
    calls: list[list] = []
    handles = []
    for module in _layer_modules(model):

        def pre(mod, args, kwargs):
            kwargs = dict(kwargs)
            if "shared_kv_states" in kwargs:  # Gemma-3n's KV sharing: this call's snapshot
                kwargs["shared_kv_states"] = copy.copy(kwargs["shared_kv_states"])
            calls.append([mod, args, kwargs, None])

        def post(mod, args, kwargs, output):
            open_call = next(c for c in reversed(calls) if c[0] is mod and c[3] is None)
            open_call[3] = block_output_hidden(output).detach()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            if ids.dim() == 1:
                return calls, model(ids[None], use_cache=False).logits[0, -1]
            return calls, model(ids, attention_mask=mask, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()


def independent_jacobians(calls, leading: bool = False) -> torch.Tensor:
    """``[L, d, d]``: each call's J at the last position, autograd on its own input."""
    out = []
    for module, args, kwargs, _ in calls:
        X = (args[0] if args else kwargs["hidden_states"]).detach()
        axis = 2 if leading else 1  # the sequence axis

        def f(x, X=X, module=module, args=args, kwargs=kwargs, axis=axis):
            last = x.view(X.shape[0], 1, 1, -1) if leading else x.view(1, 1, *X.shape[2:])
            rows = torch.cat([X.narrow(axis, 0, X.shape[axis] - 1), last], dim=axis)
            if args:
                y = module(rows, *args[1:], **kwargs)
            else:
                y = module(**{**kwargs, "hidden_states": rows})
            return _flat(block_output_hidden(y), leading)[0, -1] - x

        out.append(torch.autograd.functional.jacobian(f, _flat(X, leading)[0, -1]))
    return torch.stack(out)


def independent_trajectory(calls, row: int = 0, n: int = -1, leading=False) -> torch.Tensor:
    """``[L+1, d]``: the first call's input, then every call's output, at position n of a row."""
    first = calls[0][1][0] if calls[0][1] else calls[0][2]["hidden_states"]
    rest = [_flat(c[3], leading)[row, n] for c in calls]
    return torch.stack([_flat(first, leading)[row, n], *rest])


def coupling_of(A: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    return coupling_score(miscoupling(A[..., :K, :K], S[:, :K]))


def test_hrm_is_unrolled_into_its_calls(models):
    model = models("hrm_text")
    parts = locate_model_parts(model)
    calls, _ = independent_calls(model, PROMPTS[0])
    # 2 high-level cycles x (2 low-level passes + 1 high-level pass) x 2 layers
    assert parts.n_layers == len(calls) == 12 == model.config.num_hidden_layers
    assert is_unrolled(parts.blocks) and all(isinstance(b, CallSite) for b in parts.blocks)
    assert [b.block for b in parts.blocks] == [c[0] for c in calls]
    assert [b.call for b in parts.blocks[:6]] == [0, 0, 1, 1, 0, 0]
    assert locate_model_parts(model).blocks == parts.blocks  # the same sites each time
    assert readout_problems(model, parts, PROMPTS[-1]) == []
    probe = preflight.check_model(model, parts, make_selection("coupling,lss"))
    assert probe.replay[0] == "sequence" and "more than once" in probe.replay[1]


def test_dory_loop_is_unrolled_into_its_calls(models):
    model = models("dory")
    parts = locate_model_parts(model)
    calls, _ = independent_calls(model, PROMPTS[0])
    layers = list(model.model.layers)
    assert parts.n_layers == len(calls) == 6 and is_unrolled(parts.blocks)
    assert [b.block for b in parts.blocks] == [c[0] for c in calls]
    assert [b.block for b in parts.blocks] == [layers[i] for i in (0, 1, 2, 1, 2, 3)]
    assert [b.call for b in parts.blocks] == [0, 0, 0, 1, 1, 0]
    assert locate_model_parts(model).blocks == parts.blocks  # the same sites each time
    assert readout_problems(model, parts, PROMPTS[-1]) == []


def test_blocks_never_called_on_text_are_left_out(models):
    model = models("mllama")
    parts = locate_model_parts(model)
    layers = list(model.model.layers)
    assert type(layers[2]).__name__ == "MllamaCrossAttentionDecoderLayer"
    assert parts.blocks == [layers[0], layers[1], layers[3]]
    assert not is_unrolled(parts.blocks)
    assert readout_problems(model, parts, PROMPTS[-1]) == []  # read-out and composition


F32_UNIT = 2.0**-24
"""float32's unit round-off u."""


def float64_tolerance(model) -> float:
    """Relative tolerance of two float64 computations of a block Jacobian, from float32 bounds.

    1e-6 where the model computes in float64 throughout. Gemma-3n's RMSNorm casts its
    input to float32 (``hidden_states.float()``) inside a float64 model, so each of the N
    norms of a block (10: q/k/v norms, four sandwich norms, AltUp's router norm, LAuReL's
    and the per-layer input's) is a float32 stage. Its mean of d squares is within
    gamma_d ~ d u of exact (Higham, "Accuracy and Stability of Numerical Algorithms",
    Lemma 3.1/3.4), its cast in, power, two products and cast out add 4 u: at most
    (d + 4) u relative per stage, N stages in series on a path through the block, and two
    computations (the engine's and the test's, whose float32 kernels may sum in another
    order: vectorised under ``vmap`` or not, another CPU's SIMD width) differ by at most
    twice one's error: ``2 N (d + 4) u`` = 2.4e-5 at d = 16, N = 10. Observed: 1.35e-6 on a
    CPU whose kernels differ (issue 48), 1e-15 where both use the same kernels.
    """
    if model.config.model_type != "gemma3n_text":
        return 1e-6
    block = (
        model.model.language_model.layers[0]
        if hasattr(model.model, "language_model")
        else (model.model.layers[0])
    )
    stages = sum(type(m).__name__ == "Gemma3nRMSNorm" for m in block.modules())
    assert stages == 10, stages  # the count above: a transformers change shows here
    return 2 * stages * (model.config.hidden_size + 4) * F32_UNIT


@pytest.mark.parametrize("model_type", ["hrm_text", "dory", "mllama", "zamba2", *STREAMS])
def test_coupling_of_calls_equals_the_independent_jacobians(model_type, models, one_thread):
    if model_type == "gemma3n_text":
        require_fixed("gemma3n in-place clamp")
        require_fixed("gemma3n shared cache")  # the replay asserted below
    model = models(model_type)
    parts = locate_model_parts(model)
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K, method="dense")
    batched = engine.factors_batch(PROMPTS)
    (alone,) = engine.factors_batch(PROMPTS[:1])
    assert [f.replay for f in batched] == ["sequence"] * len(PROMPTS)
    tol = float64_tolerance(model)
    for ids, factors in zip(PROMPTS, batched, strict=True):
        J = independent_jacobians(independent_calls(model, ids)[0], model_type in LEADING)
        assert J.shape[0] == parts.n_layers
        U, S, Vh = torch.linalg.svd(J)
        A = coupling_matrices_dense(J, U[..., :K], Vh.transpose(-1, -2)[..., :K])
        torch.testing.assert_close(factors.S, S[:, : K + 1], rtol=tol, atol=tol * S.max())
        torch.testing.assert_close(
            coupling_of(factors.A, factors.S), coupling_of(A, S), rtol=0, atol=1e-5
        )
    torch.testing.assert_close(alone.A, batched[0].A, rtol=0, atol=1e-10)


class _Keep:
    """Keeps the states at n of each layer view (tests only)."""

    def __init__(self, batch):
        self.at_n, self.logits = [], []

    def update(self, view):
        self.at_n.append(view.at_n.clone())
        self.logits.append(view.logits.clone())

    def finalize(self):
        return self


@pytest.mark.parametrize("model_type", ["hrm_text", "dory", "mllama", "zamba2", *STREAMS])
def test_trajectory_of_a_padded_batch_follows_the_calls(model_type, models, one_thread):
    """The collector's states at n equal the model's own, recorded from its layers.

    HY-V4's own forward pass of a right-padded batch differs from each prompt alone
    (logits by 1e-3 at this size: its indexer sees the pads), so its rows are compared
    with the same padded forward only; the other models' rows also equal each prompt alone.
    """
    model = models(model_type)
    parts = locate_model_parts(model)
    length = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        ids[row, : len(prompt)], mask[row, : len(prompt)] = prompt, 1
    last = [len(p) - 1 for p in PROMPTS]
    collector = StateCollector(model, parts, hidden_states=True, lens=LogitLens(parts))
    with (
        torch.no_grad(),
        collector.capture(last, [0] * len(PROMPTS), None, {"keep": _Keep}) as handle,
    ):
        model(ids, attention_mask=mask, use_cache=False)
    keep = handle.reduced["keep"]
    states = torch.stack(keep.at_n, dim=1)  # [B, L+1, d]
    assert states.shape[1] == parts.n_layers + 1
    batch_calls, batch_logits = independent_calls(model, ids, mask)
    lens_tol = 1e-6 if model_type in STREAMS else 1e-8  # hc_head mixes the streams in float32
    if batch_logits.dtype == torch.float32:  # Dory returns float32 logits of float64 states
        lens_tol = 1e-5
    for row, prompt in enumerate(PROMPTS):
        reference = independent_trajectory(batch_calls, row, last[row], model_type in LEADING)
        torch.testing.assert_close(states[row], reference, rtol=0, atol=1e-10)
        own = batch_logits[row, last[row]]
        lens = keep.logits[-1][row]
        torch.testing.assert_close(lens.to(own.dtype), own, atol=lens_tol, rtol=0)
        if model_type != "hy_v4":  # padded rows equal each prompt alone (HC mixes in float32)
            calls, logits = independent_calls(model, prompt)
            alone = independent_trajectory(calls, leading=model_type in LEADING)
            torch.testing.assert_close(states[row], alone, rtol=0, atol=1e-6)
            torch.testing.assert_close(lens.to(logits.dtype), logits, rtol=0, atol=1e-5)
        if model_type in HYPER:  # every state read out by the model's own modules
            base, (k, d) = model.model, (model.config.hc_mult, model.config.hidden_size)
            with torch.no_grad():
                own = model.lm_head(base.norm(base.hc_head(reference.view(1, -1, k, d))))[0]
            torch.testing.assert_close(
                torch.stack([lg[row] for lg in keep.logits]), own, rtol=0, atol=lens_tol
            )
        torch.testing.assert_close(
            line_shape_score(states[row]), line_shape_score(reference), rtol=0, atol=1e-10
        )


@pytest.mark.parametrize("model_type", list(STREAMS))
def test_several_streams_are_one_flattened_state(model_type, models):
    model = models(model_type)
    parts = locate_model_parts(model)
    config = model.config
    k, d = getattr(config, "hc_mult", None) or config.altup_num_inputs, config.hidden_size
    assert (parts.n_layers, parts.d_model) == (config.num_hidden_layers, k * d)
    assert not is_unrolled(parts.blocks)
    assert [b.block for b in parts.blocks] == list(model.model.layers)
    assert readout_problems(model, parts, PROMPTS[-1]) == []  # read-out and composition
    probe = preflight.check_model(model, parts, make_selection("coupling,lss"))
    assert probe.hidden_shape == (1, checks.PROBE_TOKENS, k * d)
    if model_type == "gemma3n_text":
        require_fixed("gemma3n shared cache")  # before it, the cache replay serves
    assert probe.replay[0] == "sequence"


def test_attention_metrics_are_refused_on_repeated_calls(models):
    parts = locate_model_parts(models("hrm_text"))
    with pytest.raises(UnsupportedModelError, match="more than once"):
        StateCollector(models("hrm_text"), parts, attentions=True)
