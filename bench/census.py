"""Census: every causal LM of the installed transformers, tiny, measured and checked.

For every entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (one
child process each, with a time limit):

1. build a tiny random model (4 blocks, d = 64, 4 heads, windows and chunks
   shorter than the prompts, every kind of layer its config defaults to;
   float64 where its forward pass runs in float64, else float32); entries
   whose config has a non-text sub-config (vision, audio, ...) or is an
   encoder-decoder are skipped with that reason;
2. run lm-coupling's library path for ``--metrics coupling,lss,logit_lens_entropy``
   as ``lm_eval --model hf-coupling`` runs it: ``locate_model_parts``, the load
   and first-batch checks of ``harness.preflight``, the streamed metrics of a
   right-padded batch of four documents through ``GeometryRunner.capture``
   (no attention mask, as lm-eval's HFLM scores a batch),
   and the Jacobian metrics through ``GeometryRunner.compute_sampled_batch``
   (the four documents in one batch, and the first alone);
3. recompute coupling and LSS of each document independently: ``J^l`` by
   reverse-mode autograd through block l called on the whole unpadded
   sequence recorded from the model's own forward pass (no cache, no
   engine; the diagonal block at the last position), full SVD, coupling
   from the dense formula; LSS from the block outputs of the model's own
   forward pass (docs/design.md, "Metrics").

A model is ``verified`` when every value runs and coupling and LSS equal the
independent values to ``TOL`` (1e-5) in both batch sizes. The page
``docs/architectures.md`` is rendered from the results (``--write-docs``).

    python bench/census.py --write-docs                 # every entry (about 30 min, 2 cores)
    python bench/census.py --only gpt2,llama,mamba     # a sample, printed
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_PAGE = ROOT / "docs" / "architectures.md"
TOL = 1e-5
"""Largest difference between lm-coupling's value and the independent one."""
WINDOW = 6
"""Sliding windows (prompts are 8 to 16 tokens)."""
CHUNK = 4
"""Attention chunks and scan chunks."""
PROMPTS = [
    [5, 17, 42, 99, 3, 250, 77, 310],
    [11, 12, 400, 33, 8, 19, 240, 101, 7, 64, 2],
    [301, 4, 87, 150, 22, 9, 480, 36, 71, 13, 255, 6, 90],
    [44, 1, 310, 27, 199, 58, 3, 412, 81, 16, 230, 77, 5, 141, 62, 19],
]
"""Four prompts of 8 to 16 tokens (ids below 512), longer than every window and chunk."""
CHECKED = (0, 3)
"""Documents of the batch recomputed independently: the shortest and the longest."""
METRICS = "coupling,lss,logit_lens_entropy"

TINY = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, intermediate_size=128, max_position_embeddings=256,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW,
    attention_window_size=WINDOW, chunk_size=CHUNK,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
    topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128,
    mamba_n_groups=1, index_topk=CHUNK,
    mamba_chunk_size=CHUNK, mamba_expand=2, mamba_d_conv=4, state_size=8, ssm_state_size=8,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, lru_width=64, initializer_range=0.05,
)  # fmt: skip
"""Tiny sizes under the usual config names (a config ignores the names it does not use)."""

DROP = object()
"""An ``OVERRIDES`` value: leave this ``TINY`` name out of the entry's config."""


OVERRIDES: dict[str, dict] = {
    "bamba": dict(attn_layer_indices=[1, 3]),
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "llama4": dict(attention_chunk_size=CHUNK),
    "llama4_text": dict(attention_chunk_size=CHUNK),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, use_mamba_kernels=False),  # CPU: 4.56 refuses else
    "deepseek_v32": dict(num_key_value_heads=4),
    "gemma3n_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=16,
                         vocab_size_per_layer_input=512, laurel_rank=8,
                         intermediate_size=[128] * 4, activation_sparsity_pattern=[0.0] * 4),
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2),
    "qwen4_exp_text": dict(head_dim=16, indexer_n_heads=2, indexer_kv_heads=1,
                           indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2),
    "mamba2": dict(num_heads=4, head_dim=32, n_groups=1, state_size=8, expand=2,
                   chunk_size=CHUNK),
    "helium": dict(head_dim=16),
    "ministral": dict(head_dim=16),
    "hunyuan_v1_dense": dict(head_dim=16),
    "hunyuan_v1_moe": dict(head_dim=16),
    "dory": dict(head_dim=16, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
                 layer_types=["sliding_attention", "full_attention"] * 2),
    "longcat_flash": dict(head_dim=8, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=32,
                          ffn_hidden_size=128),
    "mimo_v2_flash": dict(head_dim=16, v_head_dim=16, num_key_value_heads=2, rope_parameters={
        "full_attention": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0,
                                  partial_rotary_factor=0.5)}),
    "hy_v4": dict(head_dim=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                  index_topk=4, index_head_dim=16, index_n_heads=2,
                  indexer_types=["full", "shared", "full", "shared"]),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=4,
                 attn_config=dict(kv_n_heads=4, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "xlstm": dict(num_heads=4, chunk_size=CHUNK, qk_dim_factor=1.0),
    "prophetnet": dict(num_encoder_layers=4, num_decoder_layers=4, num_hidden_layers=DROP),
    "bailing_hybrid": dict(head_dim=16),
    "kimi_linear": dict(linear_head_dim=16, linear_num_heads=4),
    "dots3_note_text": dict(head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=4,
                            shared_experts_intermediate_size=32, swa_num_attention_heads=4,
                            swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16,
                            swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16),
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh"] * 2, axial_pos_shape=[4, 8],
                     axial_pos_embds_dim=[32, 32], max_position_embeddings=32,
                     attention_head_size=16, feed_forward_size=128, local_attn_chunk_length=CHUNK,
                     lsh_attn_chunk_length=CHUNK, num_buckets=2, hash_seed=0),
    "xlnet": dict(d_head=16),
    "zaya": dict(num_experts_per_tok=1),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),
    "cohere_compass_text": dict(rope_parameters={
        "full_attention": dict(rope_type="default", rope_theta=10000.0),
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
}  # fmt: skip
"""model_type -> config values replacing ``TINY``'s (architectures with their own names)."""

DECODER = dict(is_decoder=True, causal=True)
"""What a BERT-style (or XLM) config needs to run as a causal decoder."""

NOT_STANDALONE = {
    "gemma4_assistant": "not a standalone LM: a drafting head that reads the target model's "
    "shared key/value states (every layer kv-shared)",
    "gemma4_unified_assistant": "not a standalone LM: a drafting head whose forward needs the "
    "target model's inputs_embeds and shared_kv_states",
    "dots3_note": "not text-only: the vision and audio config of Dots3NoteForCausalLM, whose "
    "text model is the entry dots3_note_text",
}
"""model_type -> why the census skips an entry that is not a text model of its own."""

NON_TEXT_KEYS = ("vision", "audio", "speech", "image", "encoder", "video", "visual")
"""A sub-config whose name contains one of these makes the entry not text-only."""


@dataclass
class Result:
    """One census row."""

    model_type: str
    status: str
    """verified, mismatch, refused, failed, skipped, timeout, not run."""
    reason: str = ""
    dtype: str = ""
    replay: str = ""
    blocks: list[str] = field(default_factory=list)
    coupling_error: float = math.nan
    lss_error: float = math.nan
    seconds: float = 0.0


class Skip(Exception):
    """The entry is not a text-only causal LM."""


def _config(model_type: str):
    """The tiny config of a mapping entry; raises ``Skip`` for one that is not text-only.

    A composite config (a ``text_config`` beside vision or audio ones) whose
    mapped class is a ``*ForCausalLM`` (Qwen3.5, Mllama, Llama-4) builds the
    text model alone: its ``text_config`` gets the tiny sizes.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if model_type in NOT_STANDALONE:
        raise Skip(NOT_STANDALONE[model_type])
    if "ConditionalGeneration" in mapped:
        raise Skip(f"not text-only: maps to {mapped}")
    cls = transformers.CONFIG_MAPPING[model_type]
    sub = getattr(cls, "sub_configs", {}) or {}
    other = [k for k in sub if any(w in k.lower() for w in NON_TEXT_KEYS)]
    if other and "text_config" not in sub:
        raise Skip(f"not text-only: its config has {', '.join(sorted(other))}")
    if "text_config" in sub and mapped.endswith("ForCausalLM"):
        text_type = getattr(sub["text_config"], "model_type", None)
        if not text_type:  # an AutoConfig slot (Fuyu): the default text config's type
            text_type = transformers.AutoConfig.for_model(model_type).text_config.model_type
        sizes = _sizes(text_type)
        config = transformers.AutoConfig.for_model(model_type, text_config=sizes)
        kinds = _every_layer_kind(text_type, config.get_text_config())
        if kinds is not None:
            config.get_text_config().layer_types = kinds
        return config
    sizes = _sizes(model_type)
    try:
        config = transformers.AutoConfig.for_model(model_type, **sizes)
    except Exception:  # noqa: BLE001 - a config that rejects a generic name it does not use
        config = transformers.AutoConfig.for_model(model_type, **_known(model_type, sizes))
    if getattr(config, "is_encoder_decoder", False):
        raise Skip("not text-only: an encoder-decoder model")
    kinds = _every_layer_kind(model_type, config)
    if kinds is not None:  # at construction: derived values (per-type RoPE) follow the list
        try:
            config = transformers.AutoConfig.for_model(
                model_type, **{**sizes, "layer_types": kinds}
            )
        except Exception:  # noqa: BLE001 - a config that derives its list: set it afterwards
            config.layer_types = kinds
    return config


def _sizes(model_type: str) -> dict:
    """``TINY``, the entry's ``OVERRIDES`` and its per-layer lists cut to 4 blocks."""
    sizes = {**TINY, **OVERRIDES.get(model_type, {})}
    sizes.update(_per_layer_lists(model_type, sizes))
    return {k: v for k, v in sizes.items() if v is not DROP}


def _known(model_type: str, sizes: dict) -> dict:
    """``sizes`` without the generic ``TINY`` names the entry's config does not define.

    A config that rejects a name it does not use (xLSTM's read-only
    ``v_head_dim``, XLNet's missing ``max_position_embeddings``) gets the
    others; the entry's ``OVERRIDES`` always pass.
    """
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]
    names = set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "attribute_map", {}))
    try:
        names |= set(cls().to_dict())
    except Exception:  # noqa: BLE001 - a config without valid defaults: its declared fields
        pass
    own = OVERRIDES.get(model_type, {})
    return {k: v for k, v in sizes.items() if k in names or k in own}


def _pattern(values: list, n: int) -> list:
    """``n`` entries with every distinct value of ``values``, the last one last."""
    kinds = list(dict.fromkeys(values))
    if len(kinds) > n:
        return list(values[:n])
    order = [k for k in kinds if k != values[-1]] + [values[-1]]
    return [order[i % len(order)] for i in range(n - len(order))] + order


def _per_layer_lists(model_type: str, sizes: dict) -> dict:
    """Per-layer lists of the default config (one entry per layer) cut to 4 entries.

    Kinds are kept: ``["mamba"] * 6 + ["attention"]`` becomes
    ``["mamba", "mamba", "mamba", "attention"]``-like patterns with every kind.
    """
    import transformers

    try:
        default = transformers.AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - a config without defaults: nothing to cut
        return {}
    depth = getattr(default, "num_hidden_layers", None)
    n = TINY["num_hidden_layers"]
    if not isinstance(depth, int) or depth <= n:
        return {}
    return {
        key: _pattern(value, n)
        for key, value in vars(default).items()
        if isinstance(value, list) and len(value) == depth and key not in sizes and value
    }


def _every_layer_kind(model_type: str, config) -> list | None:
    """The ``layer_types`` giving a 4-block config every kind its default-depth config has.

    ``None`` where ``config`` already has every kind (or no ``layer_types``).

    A config's default ``layer_types`` (e.g. LFM2's convolution and attention
    layers) may hold only one kind in its first four entries; the kinds then
    alternate in their default order, with the default's last kind last.
    """
    import transformers

    if model_type in OVERRIDES and "layer_types" in OVERRIDES[model_type]:
        return None
    default = getattr(transformers.AutoConfig.for_model(model_type), "layer_types", None)
    current = getattr(config, "layer_types", None)
    if not isinstance(default, list) or not isinstance(current, list):
        return None
    kinds = list(dict.fromkeys(default))
    if len(set(current)) >= len(kinds) or len(kinds) > len(current):
        return None
    order = [k for k in kinds if k != default[-1]] + [default[-1]]
    n = len(current)
    return [order[i % len(order)] for i in range(n - len(order))] + order


def build(model_type: str, **extra):
    """The tiny model (seeded, eval mode), float64 where its forward runs in float64."""
    import torch
    import transformers

    config = _config(model_type)
    for key, value in extra.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if model_type in PREPARE:
        PREPARE[model_type](model)
    ids = torch.tensor([PROMPTS[-1]])
    try:
        model = model.to(torch.float64)
        with torch.no_grad():
            out = model(ids).logits
        if not bool(torch.isfinite(out).all()):
            raise ValueError("non-finite logits in float64")
    except Exception as error:  # noqa: BLE001 - kernels without float64: the model runs in float32
        model = model.to(torch.float32)
        try:  # the tiny model's own forward pass must run: else the census's config is at fault
            with torch.no_grad():
                model(ids)
        except Exception as again:  # noqa: BLE001 - reported as a build failure, with both causes
            raise BuildError(
                f"the tiny model's own forward pass fails in float64 ({_short(error)}) and "
                f"float32 ({type(again).__name__}: {_short(again)})"
            ) from again
    return model


class BuildError(Exception):
    """The census's tiny model of an entry does not run on its own (a census config problem)."""


def _short(error: BaseException, limit: int = 160) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


PREPARE = {"xmod": lambda model: model.set_default_language("en_XX")}
"""model_type -> what a model needs before its first forward pass."""


def _accepts(model, name: str) -> bool:
    from lm_coupling.jacobian.sequence import accepts_argument

    return accepts_argument(model, name)


def _block_records(model, parts, ids):
    """Each block's (args, kwargs) and output of the model's own forward pass, no cache."""
    import torch

    from lm_coupling.model.architecture import block_output_hidden

    records, outputs = {}, {}

    def hooks(index):
        def pre(module, args, kwargs):
            records.setdefault(index, (args, dict(kwargs)))

        def post(module, args, output):
            outputs.setdefault(index, block_output_hidden(output).detach())

        return pre, post

    handles = []
    for i, block in enumerate(parts.blocks):
        pre, post = hooks(i)
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post))
    kwargs = {"use_cache": False} if _accepts(model, "use_cache") else {}
    try:
        with torch.no_grad():
            model(ids[None], **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return records, outputs


def _block_classes(blocks) -> list[str]:
    """The blocks' class names; ``Name (n calls)`` where calls of one module are unrolled."""
    from lm_coupling.model.block_calls import is_unrolled

    modules = [getattr(b, "block", b) if type(b).__name__ == "CallSite" else b for b in blocks]
    if not is_unrolled(blocks):
        return sorted({type(m).__name__ for m in modules})
    calls: dict[str, int] = {}
    for module in modules:
        calls[type(module).__name__] = calls.get(type(module).__name__, 0) + 1
    return sorted(f"{name} ({count} calls)" for name, count in calls.items())


def reference_jacobians(model, parts, ids):
    """``[L, d, d]`` J^l at the last position: autograd through the whole sequence, no engine."""
    import torch

    from lm_coupling.model.architecture import block_output_hidden

    records, _ = _block_records(model, parts, ids)
    jacobians = []
    for index, block in enumerate(parts.blocks):
        args, kwargs = records[index]
        X = (args[0] if args else kwargs["hidden_states"]).detach()

        def f(x, X=X, args=args, kwargs=kwargs, block=block):
            rows = torch.cat([X[:, :-1], x[None, None]], dim=1)
            if args:
                out = block(rows, *args[1:], **kwargs)
            else:
                out = block(**{**kwargs, "hidden_states": rows})
            return block_output_hidden(out)[0, -1] - x

        try:
            J = torch.autograd.functional.jacobian(f, X[0, -1], vectorize=True)
        except RuntimeError:  # a block vmap cannot batch: one backward pass per row
            J = torch.autograd.functional.jacobian(f, X[0, -1])
        jacobians.append(J)
    return torch.stack(jacobians)


def reference_coupling(J, k: int):
    """Coupling c_K (l1 norm, ordered pairs l != l') from dense Jacobians, full SVD."""
    import torch

    from lm_coupling.metrics.coupling import coupling_matrices_dense, coupling_score, miscoupling

    U, S, Vh = torch.linalg.svd(J)
    A = coupling_matrices_dense(J, U[..., :k], Vh.transpose(-1, -2)[..., :k])
    return float(coupling_score(miscoupling(A, S[:, :k])))


def reference_lss(model, parts, ids) -> float:
    """LSS of one prompt from the model's own block inputs and outputs (docs/design.md).

    Per token t = 1..T-1: ``L' / ||sum_l d_l / ||d_l|| ||`` over the steps
    ``d_l = x^l_t - x^{l-1}_t`` that are nonzero (L' of them); the mean over tokens.
    """
    import torch

    records, outputs = _block_records(model, parts, ids)
    args, kwargs = records[0]
    states = [(args[0] if args else kwargs["hidden_states"])[0].double()]
    states += [outputs[i][0].double() for i in range(parts.n_layers)]
    steps = torch.stack([b - a for a, b in zip(states[:-1], states[1:], strict=True)])[:, 1:]
    norms = torch.linalg.vector_norm(steps, dim=-1)
    keep = norms > 0
    unit = torch.where(keep[..., None], steps / norms.clamp_min(1e-300)[..., None], 0.0)
    lss = keep.sum(0) / torch.linalg.vector_norm(unit.sum(0), dim=-1)
    return float(lss.mean())


def _library_values(model, parts, selection, prompts):
    """lm-coupling's per-document values for a right-padded batch, and sampled batches."""
    import torch

    from lm_coupling.geometry import GeometryRunner

    runner = GeometryRunner(model, selection)
    lengths = [len(p) for p in prompts]
    ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    last = torch.tensor(lengths) - 1
    # As HFLM's _model_call scores a right-padded batch: no attention mask (causal
    # attention keeps the padding after n out of every measured state). A padding mask
    # would be a different forward pass: with a sliding window, a padding query whose
    # whole window is padding has no key left, and the eager attention of Gemma-2,
    # Granite-SWA and VaultGemma then returns NaN there, which the next layer's
    # 0 * NaN value product spreads to the row's real tokens (the model's own NaN).
    with runner.capture(last, torch.zeros_like(last), torch.full_like(last, -1)) as handle:
        with torch.no_grad():
            logits = model(ids.to(parts.input_device)).logits
    own = torch.isfinite(logits[torch.arange(len(prompts)), last.to(logits.device)]).all(-1)
    streamed = runner.compute(handle)
    for b, doc in enumerate(streamed):
        missing = [name for name, value in doc.values.items() if not math.isfinite(value)]
        if missing and not bool(own[b]):
            raise ValueError(
                f"the model's own logits of document {b} are not finite in the padded batch: "
                f"{', '.join(missing)} missing because of the model, not lm-coupling"
            )
    tensors = [torch.tensor(p) for p in prompts]
    batched = runner.compute_sampled_batch(tensors, errors="raise")
    alone = runner.compute_sampled_batch(tensors[:1], errors="raise")
    return runner, streamed, batched, alone


def check(model_type: str) -> Result:
    """Build, run and verify one model type (in the calling process)."""
    import torch

    from lm_coupling.errors import UnsupportedModelError
    from lm_coupling.harness import preflight
    from lm_coupling.model import checks
    from lm_coupling.model.architecture import locate_model_parts
    from lm_coupling.selection import make_selection

    start = time.perf_counter()
    try:
        model = build(model_type)
    except Skip as skip:
        return Result(model_type, "skipped", str(skip))
    except Exception as error:  # noqa: BLE001 - the census's own build: a row, not lm-coupling's
        reason = f"tiny-config build: {type(error).__name__}: {_short(error, 240)}"
        return Result(model_type, "failed", reason, seconds=time.perf_counter() - start)
    if not checks.probe_model(model, locate_model_parts(model)).causal:
        # BERT-style models in the causal-LM mapping run as decoders only with this flag.
        model = build(model_type, **DECODER)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    result = Result(model_type, "failed", dtype=dtype)
    selection = make_selection(METRICS)
    try:
        parts = locate_model_parts(model)
        result.blocks = _block_classes(parts.blocks)
        preflight.check_model(model, parts, selection)
        probe_ids = torch.tensor(PROMPTS[-1])
        preflight.check_readout(model, parts, probe_ids, selection)
        preflight.check_differentiable(model, parts, probe_ids, selection)
        runner, streamed, batched, alone = _library_values(model, parts, selection, PROMPTS)
        result.replay = runner.engine.replay or ""
        k = min(10, parts.d_model - 1)
        errors_c, errors_l = [], []
        for b in CHECKED:
            ids = torch.tensor(PROMPTS[b])
            c_ref = reference_coupling(reference_jacobians(model, parts, ids), k)
            l_ref = reference_lss(model, parts, ids)
            errors_c.append(abs(batched[b].values["coupling"] - c_ref))
            errors_l.append(abs(streamed[b].values["lss"] - l_ref))
            if not math.isfinite(streamed[b].values["logit_lens_entropy"]):  # model: above
                raise AssertionError(f"lm-coupling's logit_lens_entropy of document {b} is NaN")
        errors_c.append(abs(alone[0].values["coupling"] - batched[0].values["coupling"]))
        result.coupling_error = max(errors_c)
        result.lss_error = max(errors_l)
        ok = result.coupling_error <= TOL and result.lss_error <= TOL
        result.status = "verified" if ok else "mismatch"
        if not ok:
            result.reason = (
                f"coupling differs by {result.coupling_error:.2g}, LSS by "
                f"{result.lss_error:.2g} from the independent values"
            )
    except UnsupportedModelError as error:
        result.status, result.reason = "refused", str(error)
    except Exception as error:  # noqa: BLE001 - every failure is a census row
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        result.reason = f"{type(error).__name__} at {where}: {error}"
    result.seconds = time.perf_counter() - start
    return result


def _child(model_type: str, queue) -> None:
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        queue.put(asdict(check(model_type)))
    except BaseException as error:  # noqa: BLE001 - reported as the row
        queue.put(asdict(Result(model_type, "failed", f"{type(error).__name__}: {error}")))


def _preload() -> None:
    """Import what every child needs once, in the parent (a forked child shares it)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import lm_coupling.geometry  # noqa: F401
    import lm_coupling.harness.preflight  # noqa: F401


def run_one(model_type: str, timeout: float) -> Result:
    """``check`` in a child process (a crash or a hang is the row, not the census's end)."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=_child, args=(model_type, queue), daemon=True)
    start = time.perf_counter()
    process.start()
    try:
        row = queue.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - queue.Empty: the child hung or died
        process.kill()
        process.join()
        code = process.exitcode
        what = "timeout" if code in (None, -9) else "failed"
        return Result(model_type, what, f"no result within {timeout:.0f} s (exit {code})")
    process.join(10)
    result = Result(**row)
    result.seconds = time.perf_counter() - start
    return result


def model_types() -> list[str]:
    """Every entry of the installed transformers' causal-LM mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _cell(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render(results: list[Result], version: str, seconds: float) -> str:
    """``docs/architectures.md`` from census results."""
    counts = Counter(r.status for r in results)
    text = [r for r in results if r.status not in ("skipped", "not run")]
    lines = [
        "# Architectures: the census",
        "",
        "Generated by `python bench/census.py --write-docs` (do not edit by hand) on",
        f"transformers {version}: every entry of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`",
        f"({len(results)}; {counts['skipped']} skipped as not text-only), each as a tiny random",
        f"model (4 blocks, d = 64, windows {WINDOW} and chunks {CHUNK} shorter than the prompts",
        "of 8 to 16 tokens, every kind of layer its config defaults to), float64 where its",
        f"forward pass runs in float64, through `--metrics {METRICS}`: lm-coupling's",
        "load and first-batch checks, the streamed metrics of a right-padded batch of four",
        "documents (no attention mask, as lm-eval's HFLM scores a batch) and the Jacobian",
        "metrics of the four in one batch and of the first alone.",
        "Coupling (K = 10) and LSS of each document are recomputed independently (autograd",
        "through each block called on the whole unpadded sequence recorded from the model's",
        "own forward pass: the diagonal block of the whole-sequence Jacobian at the last",
        f"position; LSS from the model's own block outputs). **verified**: within {TOL:g}.",
        '`replay` is how the engine replayed the blocks (docs/engine.md, "Replays"):',
        "`cache` (token n against the frozen prefix keys/values) or `sequence` (the whole",
        "prompt, rows before n fixed: recurrent-state caches, no cache, indexer attention).",
        "A `failed` row whose reason starts with `tiny-config build` is the census's own",
        "configuration problem (its tiny model does not run on its own), not an lm-coupling",
        "finding; every other `failed` row is lm-coupling's.",
        "",
        f"**{counts['verified']} of {len(text)} text causal LMs run verified**; "
        + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "verified")
        + f". Census time {seconds / 60:.0f} min (model-seconds, on a shared 2-core machine).",
        "",
        "| model_type | status | dtype | replay | block classes | reason / largest error |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        detail = r.reason
        if r.status == "verified":
            detail = f"coupling {r.coupling_error:.1e}, LSS {r.lss_error:.1e}"
        blocks = ", ".join(r.blocks)
        lines.append(
            f"| {r.model_type} | {r.status} | {r.dtype} | {r.replay} | {_cell(blocks, 120)} "
            f"| {_cell(detail)} |"
        )
    lines += [
        "",
        "## Conventions",
        "",
        "**Blocks called more than once per forward pass** (looped depth: HRM's low- and",
        "high-level stacks): `num_hidden_layers` counts calls, and so does lm-coupling. The",
        "trajectory follows the calls in order (x^0 the first call's input, x^l the output",
        "of call l), J^l is the Jacobian of call l at that call's own recorded input (the",
        "sequence replay, prefix fixed), and coupling couples calls (docs/design.md,",
        "'Conventions'); `block classes` then counts the calls per class. The independent",
        "check records each call of the model's own layer modules in call order",
        "(tests/capture/test_block_calls.py). Zamba-2's shared attention block is called",
        "inside each hybrid layer, and the hybrid layers are the located blocks: each runs",
        "once, and no convention is needed.",
        "",
        "**Several residual streams** (hyper-connections: DeepSeek-V4, HY-V4, `[B, T, k, d]`",
        "between blocks; AltUp: Gemma-3n, `[k, B, T, d]`): the residual state is the k",
        "streams, so x^l is the k streams flattened (k d wide), J^l is the block's k d x k d",
        "Jacobian, and the lens reads each state through the model's own collapse of the",
        "streams (`hc_head`; AltUp's un-embedding projections, magnitude matching and mean)",
        "and final norm (docs/design.md, 'Conventions'); `d_model` is k d. Other inputs of a",
        "block (Gemma-3n's per-layer inputs and shared keys and values) are held fixed.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the census; print one line per model type and the counts."""
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model type")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--workers", type=int, default=1, help="model types run at once")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="render --json (entries it lacks: 'not run') to the page, run nothing",
    )
    parser.add_argument("--write-docs", action="store_true", help=f"write {DOCS_PAGE}")
    parser.add_argument(
        "--resume", action="store_true", help="keep the rows already in --json, run the rest"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        help="a --json file of an earlier census: its rows for the types not run now are kept",
    )
    args = parser.parse_args(argv)
    every = model_types()
    chosen = [m for m in args.only.split(",") if m] or every
    unknown = [m for m in chosen if m not in every]
    if unknown:
        parser.error(f"not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: {', '.join(unknown)}")
    if args.render_only:
        rows = {row["model_type"]: Result(**row) for row in json.loads(args.json.read_text())}
        results = [
            rows.get(m) or Result(m, "not run", "the census ran out of its time before this entry")
            for m in every
        ]
        DOCS_PAGE.write_text(
            render(results, transformers.__version__, sum(r.seconds for r in results))
        )
        print("counts:", dict(sorted(Counter(r.status for r in results).items())))
        return 0
    _preload()
    start = time.perf_counter()
    results = []
    done = {}
    if args.resume and args.json and args.json.exists():
        done = {row["model_type"]: Result(**row) for row in json.loads(args.json.read_text())}
    from concurrent.futures import ThreadPoolExecutor

    todo = [m for m in chosen if m not in done]
    found = dict(done)
    with ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool:
        for result in pool.map(lambda m: run_one(m, args.timeout), todo):
            found[result.model_type] = result
            if args.json:  # after every row: an interrupted census resumes with --resume
                rows = [asdict(found[m]) for m in chosen if m in found]
                args.json.write_text(json.dumps(rows, indent=1))
            print(
                f"{result.model_type:28s} {result.status:9s} {result.replay:8s} "
                f"{result.seconds:6.1f}s {_cell(result.reason, 200)}",
                flush=True,
            )
    results = [found[m] for m in chosen]
    seconds = time.perf_counter() - start
    if args.merge:
        earlier = {row["model_type"]: Result(**row) for row in json.loads(args.merge.read_text())}
        now = {r.model_type: r for r in results}
        seconds += sum(r.seconds for t, r in earlier.items() if t not in now)
        results = [now.get(t) or earlier[t] for t in every if t in now or t in earlier]
    counts = Counter(r.status for r in results)
    print("counts:", dict(sorted(counts.items())), f"of {len(results)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.write_docs:
        DOCS_PAGE.write_text(render(results, transformers.__version__, seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
