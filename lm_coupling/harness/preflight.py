"""Checks that stop a run early when the model cannot give the selected geometry.

Two moments, each one call from `CouplingHFLM`:

- `check_model`, at model load (before any request): the model must be
  causal (a token's states may not depend on later tokens) and its blocks
  must pass one state ``[B, T, d]`` (several residual streams, hyper-connections
  and Gemma-3n's AltUp, arrive flattened, ``model.block_calls``).
  A model that fails (a BERT loaded as ``BertLMHeadModel``) stops the run
  with a message saying what was found. Any cache is fine for the Jacobian
  metrics: where the model's cache holds more than keys and values (Mamba,
  hybrids, linear attention, indexer attention) or there is none, the
  engine replays whole sequences
  (``jacobian.sequence``); ``ModelProbe.replay`` says which replay.
- `check_first_batch`, on the first captured batch: the lens read-out of the
  last block's output, ``unembed(final_norm(x^L))``, must reproduce the
  model's own logits, and with a Jacobian metric selected the located blocks
  must compose to the model's output (block l+1 consumes what block l
  returned). Otherwise lm-coupling would report the geometry of a different
  function; the run stops naming the architecture and the override to add
  (`lm_coupling.model.architecture.register_override`). With a Jacobian
  metric, ``torch.func`` must also go through every block (one JVP each):
  a custom ``autograd.Function`` without a stand-in, or a module writing in
  place into its own weights, stops the run naming its module, rather than
  failing on every document.

The probes are a few short forward passes (and one JVP per block).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.jacobian.calls import (
    compute_dtype,
    engine_mode,
    record_last_token,
    run_prompts,
)
from lm_coupling.jacobian.sequence import SEQUENCE, choose_replay, record_sequences
from lm_coupling.model.architecture import ModelParts, block_output_hidden
from lm_coupling.model.block_calls import is_unrolled
from lm_coupling.model.differentiable import untransformable_modules
from lm_coupling.model.transformers_adapter import cache_layers, layer_keeps_state, output_cache
from lm_coupling.plugins.manager import get_registry
from lm_coupling.selection import Selection
from lm_coupling.states import ENGINE_NEEDS

JACOBIAN_NEEDS = ENGINE_NEEDS
"""Needs served by the Jacobian engine (which replays blocks with the prefix held fixed)."""

PROBE_TOKENS = 8
"""Length of the synthetic probe sequence of `check_model`."""

FIRST_BATCH_TOKENS = 64
"""At most this many trailing tokens of the first document are used by `check_first_batch`."""


@dataclass(frozen=True)
class ModelProbe:
    """What a short forward pass showed about a model.

    Attributes:
        causal: the logits of positions before the last did not change when
            the last token changed.
        cache: type name of ``past_key_values`` with ``use_cache=True``
            (``"None"`` when the output has none).
        cache_has_layers: the cache is a transformers ``Cache`` with ``.layers``.
        max_change: largest change of an earlier position's logits.
        state_layers: cache layers that hold a recurrent or convolution state
            (state-space and linear-attention layers of hybrid models).
        hidden_shape: the shape of the first block's input hidden states
            (``[1, T, d]`` for one residual stream).
        cache_layers: the number of layers of the cache (0 without one).
        replay: how the Jacobian engine replays this model's blocks
            (``"cache"`` or ``"sequence"``), and why not from the cache (set
            by `check_model` once the model passed its checks); None when no
            selected metric reads Jacobians (the choice, a few forward passes
            of the model, is then not made).
    """

    causal: bool
    cache: str
    cache_has_layers: bool
    max_change: float
    state_layers: tuple[int, ...] = ()
    hidden_shape: tuple[int, ...] = ()
    cache_layers: int = 0
    replay: tuple[str, str] | None = None


def _tolerance(dtype: torch.dtype, scale: float) -> float:
    """Absolute tolerance for comparing logits of magnitude ``scale`` in ``dtype``."""
    relative = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    return relative * max(1.0, scale)


def _causal_tolerance(dtype: torch.dtype, scale: float) -> float:
    """How much earlier logits may move when only the last token changes (kernel noise)."""
    relative = 1e-5 if dtype in (torch.float32, torch.float64) else 1e-2
    return relative * scale + 1e-7


def _accepts_use_cache(model: nn.Module) -> bool:
    """Whether the model's ``forward`` takes a ``use_cache`` argument (or ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: try the argument
        return True
    return any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in params)


def _state_layers(cache) -> tuple[int, ...]:
    """Indices of the cache layers holding a recurrent or convolution state."""
    layers = cache_layers(cache) or []
    return tuple(i for i, layer in enumerate(layers) if layer_keeps_state(layer))


def probe_model(model: nn.Module, parts: ModelParts) -> ModelProbe:
    """Run two short sequences that differ in their last token; inspect the outputs."""
    n = min(PROBE_TOKENS, parts.vocab_size - 1)
    ids = torch.arange(1, n + 1, device=parts.input_device)[None]
    changed = ids.clone()
    changed[0, -1] = 0
    shapes: list[tuple[int, ...]] = []

    def first_input(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and not shapes:
            shapes.append(tuple(hidden.shape))

    handle = parts.blocks[0].register_forward_pre_hook(first_input, with_kwargs=True)
    try:
        with torch.no_grad():
            # A model whose forward has no use_cache argument keeps no cache; any error of
            # a model that has one is the model's and propagates.
            out = model(ids, use_cache=True) if _accepts_use_cache(model) else model(ids)
            other = model(changed)
    finally:
        handle.remove()
    first, second = out.logits[0, :-1].float(), other.logits[0, :-1].float()
    max_change = float((first - second).abs().max()) if first.numel() else 0.0
    scale = float(first.abs().max()) if first.numel() else 1.0
    cache = output_cache(out)
    inner = getattr(cache, "self_attention_cache", cache)
    return ModelProbe(
        causal=max_change <= _causal_tolerance(out.logits.dtype, scale),
        cache=type(cache).__name__,
        cache_has_layers=cache_layers(inner) is not None,
        max_change=max_change,
        state_layers=_state_layers(inner),
        hidden_shape=shapes[0] if shapes else (),
        cache_layers=len(cache_layers(inner) or []),
    )


def _runnable(exclude: frozenset[str]) -> list[str]:
    """Registered metrics that need none of ``exclude``."""
    return [n for n, spec in get_registry().metrics.items() if not (spec.needs & exclude)]


def _streams(model: nn.Module, shape: tuple[int, ...]) -> str:
    """Name the kind of several residual streams a model passes (from its config)."""
    config = getattr(model, "config", None)
    names = [n.lower() for n in vars(config)] if config is not None else []
    if any("altup" in n for n in names):
        return "AltUp streams and per-layer inputs (Gemma-3n)"
    if any("hyper" in n or n.startswith(("hc_", "mhc_")) for n in names):
        return "hyper-connection streams (DeepSeek-V4-style manifold hyper-connections)"
    return f"{len(shape) - 2} stream axes" if shape else ""


_UNKNOWN_STREAMS = (
    "The trajectory, lens and coupling of lm-coupling are defined on one state x^l per "
    "block; several streams are measured as one, flattened, where the locator finds the "
    "model's own collapse of them (its decoder's hc_head or altup_unembed_projections), "
    "and it found none here (docs/architectures.md, 'Conventions'), so none of its "
    "metrics can run on this model"
)


def _looks_ahead(model: nn.Module) -> str:
    """What makes a non-causal model look ahead, for the refusal (from its config)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "")
    if model_type == "xlnet":
        return "XLNet's permutation language model attends both ways without a perm_mask"
    if getattr(config, "is_decoder", None) is False:
        return "a BERT-style encoder: its *LMHeadModel/*ForCausalLM needs config.is_decoder=True"
    return "its attention is not causal"


def check_model(model: nn.Module, parts: ModelParts, selection: Selection) -> ModelProbe:
    """Stop before any request when the model cannot give the selected metrics.

    Raises:
        UnsupportedModelError: the model is not causal or its blocks pass
            more than one residual stream (no metric is defined). The message
            names the model and what was found.
    """
    probe = _check_model(model, parts)
    if selection.needs & JACOBIAN_NEEDS:  # how the Jacobian engine will replay the blocks
        probe = dataclasses.replace(probe, replay=choose_replay(model))
    return probe


def _check_model(model: nn.Module, parts: ModelParts) -> ModelProbe:
    probe = probe_model(model, parts)
    name = f"{type(model).__name__} (model_type={parts.model_type!r})"
    if not probe.causal:
        raise UnsupportedModelError(
            f"{name} is not a causal decoder: changing the last token changed the logits of "
            f"earlier positions (by up to {probe.max_change:.3g}), so its attention looks "
            f"ahead ({_looks_ahead(model)}). "
            "lm-coupling measures the states at the last context token, which would then "
            "depend on the answer being scored: none of its metrics can run on this model"
        )
    several = probe.hidden_shape and len(probe.hidden_shape) == 3 and _streams(model, ())
    if (
        several
        and probe.hidden_shape[-1] % parts.d_model == 0
        and (probe.hidden_shape[-1] > parts.d_model)
    ):  # k streams flattened into the last axis (k d wide)
        raise UnsupportedModelError(
            f"{name} passes hidden states {probe.hidden_shape[-1]} wide between its blocks, "
            f"{probe.hidden_shape[-1] // parts.d_model} times its width d = {parts.d_model}: "
            f"{several}. {_UNKNOWN_STREAMS}"
        )
    if probe.hidden_shape and len(probe.hidden_shape) != 3:
        raise UnsupportedModelError(
            f"{name} passes hidden states of shape {list(probe.hidden_shape)} between its "
            f"blocks, not one residual stream [B, T, d]: {_streams(model, probe.hidden_shape)}. "
            f"{_UNKNOWN_STREAMS}"
        )
    return probe


# -- first captured batch -------------------------------------------------------------------------


def _record_blocks(blocks: Sequence[nn.Module]):
    """Hooks keeping every block's input and output hidden states; returns (records, handles)."""
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(blocks))}
    outputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(blocks))}
    handles = []
    for i, block in enumerate(blocks):

        def pre(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor):
                inputs[i].append(hidden.detach())

        def post(module, args, kwargs, output, i=i):
            outputs[i].append(block_output_hidden(output).detach())

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    return inputs, outputs, handles


def readout_problems(
    model: nn.Module, parts: ModelParts, input_ids: torch.Tensor, composition: bool = True
) -> list[str]:
    """Compare lm-coupling's view of the model with the model's own output.

    Args:
        model: the causal LM.
        parts: its located parts.
        input_ids: ``[T]`` token ids; the last position is checked.
        composition: also check that block l+1 consumes block l's output and
            that every block runs once.

    Returns:
        One sentence per mismatch (empty when the read-out is the model's).
    """
    inputs, outputs, handles = _record_blocks(parts.blocks)
    try:
        with torch.no_grad():
            kwargs = {"use_cache": False} if _accepts_use_cache(model) else {}
            logits = model(input_ids[None].to(parts.input_device), **kwargs).logits
    finally:
        for handle in handles:
            handle.remove()
    problems = []
    calls = [len(outputs[i]) for i in range(parts.n_layers)]
    if any(c != 1 for c in calls):
        problems.append(f"the located blocks were called {calls} times in one forward pass")
        return problems
    own = logits[0, -1].float()
    state = outputs[parts.n_layers - 1][0][0, -1]
    try:
        lens = parts.unembed_fp32(parts.final_norm_fp32(state))
    except RuntimeError as error:  # a projection the locator missed: widths do not fit
        problems.append(
            f"unembed(final_norm(x^L)) cannot be computed ({error}): the state has width "
            f"{state.shape[-1]}, the unembedding takes {parts.unembed_weight.shape[1]}, and "
            "the located final norm does not map one to the other"
        )
        return problems
    difference = float((lens.to(own.device) - own).abs().max())
    if difference > _tolerance(logits.dtype, float(own.abs().max())):
        problems.append(
            "unembed(final_norm(x^L)) differs from the model's logits at the last position by "
            f"up to {difference:.3g} (the logits reach {float(own.abs().max()):.3g})"
        )
    if composition and not is_unrolled(parts.blocks):
        # calls of blocks that run more than once need not compose (HRM sums its two
        # levels' states between stacks); their read-out check above still holds
        for i in range(parts.n_layers - 1):
            out, nxt = outputs[i][0], inputs[i + 1][0] if inputs[i + 1] else None
            if nxt is None or nxt.shape != out.shape or not torch.allclose(out, nxt):
                problems.append(
                    f"block {i + 2} does not consume block {i + 1}'s output (a module runs "
                    "between located blocks, or the block list is not the decoder's)"
                )
                break
    return problems


def _module_path(model: nn.Module, module: nn.Module | None) -> str:
    if module is None:
        return "none (identity)"
    for name, candidate in model.named_modules():
        if candidate is module:
            return repr(name)
    return type(module).__name__


def check_readout(
    model: nn.Module, parts: ModelParts, input_ids: torch.Tensor, selection: Selection
) -> None:
    """Raise when the lens read-out or block composition is not the model's own function.

    Raises:
        UnsupportedModelError: names the architecture, what differs, what was
            located, and the ``register_override`` call to add.
    """
    needs = selection.needs
    composition = bool(needs & JACOBIAN_NEEDS)
    if not composition and "lens" not in needs:
        return
    problems = readout_problems(model, parts, input_ids, composition)
    if "lens" not in needs:
        problems = [p for p in problems if not p.startswith("unembed(")]
    if not problems:
        return
    others = _runnable(JACOBIAN_NEEDS | {"lens"})
    raise UnsupportedModelError(
        f"lm-coupling's view of {type(model).__name__} (model_type={parts.model_type!r}) is "
        f"not the model's own function: {'; '.join(problems)}. Located: final norm "
        f"{_module_path(model, parts.final_norm)}, logit scale {parts.logit_scale}, soft-cap "
        f"{parts.logit_softcap}, {parts.n_layers} blocks. The model applies something the "
        "locator missed (a logit scale, soft-capping, a final norm or projection); tell "
        "lm-coupling before the run, e.g. lm_coupling.model.architecture.register_override("
        f"{parts.model_type!r}, blocks='model.layers', final_norm='model.norm', "
        "unembed='lm_head', logit_scale=..., logit_softcap=...) with your model's paths and "
        "values, rather than measuring the lens of a different function. Metrics that read "
        f"neither the lens nor the Jacobians can still run: {', '.join(others)}"
    )


def check_differentiable(
    model: nn.Module, parts: ModelParts, input_ids: torch.Tensor, selection: Selection
) -> None:
    """Raise when a Jacobian metric is selected and ``torch.func`` cannot go through a block.

    One JVP per block on the engine's recorded last-token calls of
    ``input_ids`` (``model.differentiable``); modules with an exact stand-in
    (Bloom's GELU) are substituted first, as the engine does.

    Raises:
        UnsupportedModelError: names the modules, and the metrics that can still run.
    """
    if not selection.needs & JACOBIAN_NEEDS or input_ids.shape[0] < 1:
        return
    ids = input_ids.to(parts.input_device)
    dtype = compute_dtype(parts)
    if choose_replay(model)[0] == SEQUENCE:
        with engine_mode(model):
            calls = record_sequences(model, parts, [ids], dtype)
            failing = untransformable_modules(calls)
    else:
        prefixes = run_prompts(model, parts, [ids]).prefixes
        with engine_mode(model):
            calls = record_last_token(model, parts, [ids], dtype, prefixes)
            failing = untransformable_modules(calls)
    if failing:
        others = _runnable(JACOBIAN_NEEDS)
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type={parts.model_type!r}) runs an operation "
            "that torch.func (the Jacobian engine's jvp/vjp/vmap) cannot transform (a custom "
            "torch.autograd.Function, or an in-place write to a tensor such as its own "
            f"weights), in {'; '.join(failing)}, and lm-coupling has no exact "
            "differentiable stand-in for it (lm_coupling.model.differentiable.SUBSTITUTES: "
            "add one computing the same forward; for an in-place write, a transformers "
            "release whose model does not write its weights in eval mode). Metrics that do "
            f"not need Jacobians and can still run: {', '.join(others)}"
        )


def check_first_batch(lm: Any, session: Any, keys: Sequence[tuple]) -> None:
    """Run `check_readout` once per run, on the first captured document's context.

    Args:
        lm: the `CouplingHFLM` (``tok_encode``, ``model``).
        session: the geometry session (``runner``, ``selection``).
        keys: the batch's document keys ``(context, continuation)``.
    """
    runner = session.runner
    if runner is None or not session.claim_first_batch():
        return
    context = next((k[0] for k in keys if k and isinstance(k[0], str) and k[0]), "")
    tokens = list(lm.tok_encode(context))[-FIRST_BATCH_TOKENS:] if context else []
    if not tokens:
        tokens = list(range(1, min(PROBE_TOKENS, runner.parts.vocab_size - 1) + 1))
    check_readout(lm.model, runner.parts, torch.tensor(tokens), session.selection)
    check_differentiable(lm.model, runner.parts, torch.tensor(tokens), session.selection)
