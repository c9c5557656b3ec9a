"""Checks of a model's own function, before any measurement: causal, one stream, read-out.

- `probe_model` / `check_causal_decoder`: two short sequences that differ in
  their last token; a model whose earlier logits move looks ahead, and blocks
  must pass one state ``[B, T, d]`` (several residual streams arrive flattened,
  ``model.block_calls``).
- `readout_problems`: the lens read-out of the last block's output,
  ``unembed(final_norm(x^L))``, must reproduce the model's own logits, and the
  located blocks must compose (block l+1 consumes what block l returned).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.model.architecture import ModelParts, block_output_hidden
from lm_coupling.model.block_calls import accepts_argument, is_unrolled
from lm_coupling.model.transformers_adapter import cache_layers, output_cache

PROBE_TOKENS = 8
"""Length of the synthetic probe sequence of `check_model`."""


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
        hidden_shape: the shape of the first block's input hidden states
            (``[1, T, d]`` for one residual stream).
        replay: ``(replay, why not from the cache)`` of the Jacobian engine
            (``jacobian.sequence.choose_replay``); None when no selected
            metric reads Jacobians.
    """

    causal: bool
    cache: str
    cache_has_layers: bool
    max_change: float
    hidden_shape: tuple[int, ...] = ()
    replay: tuple[str, str] | None = None


def _tolerance(dtype: torch.dtype, scale: float) -> float:
    """Absolute tolerance for comparing logits of magnitude ``scale`` in ``dtype``."""
    relative = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    return relative * max(1.0, scale)


def _causal_tolerance(dtype: torch.dtype, scale: float) -> float:
    """How much earlier logits may move when only the last token changes (kernel noise)."""
    relative = 1e-5 if dtype in (torch.float32, torch.float64) else 1e-2
    return relative * scale + 1e-7


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
            out = model(ids, use_cache=True) if accepts_argument(model, "use_cache") else model(ids)
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
        hidden_shape=shapes[0] if shapes else (),
    )


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


def check_causal_decoder(model: nn.Module, parts: ModelParts) -> ModelProbe:
    """`probe_model`, then stop when the model is not causal or passes several streams.

    Raises:
        UnsupportedModelError: the model looks ahead, or its blocks pass more
            than one residual stream that the locator cannot collapse.
    """
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
            kwargs = {"use_cache": False} if accepts_argument(model, "use_cache") else {}
            logits = model(input_ids[None].to(parts.input_device), **kwargs).logits
    finally:
        for handle in handles:
            handle.remove()
    calls = [len(outputs[i]) for i in range(parts.n_layers)]
    if any(c != 1 for c in calls):
        return [f"the located blocks were called {calls} times in one forward pass"]
    own = logits[0, -1].float()
    state = outputs[parts.n_layers - 1][0][0, -1]
    try:
        lens = parts.unembed_fp32(parts.final_norm_fp32(state))
    except RuntimeError as error:  # a projection the locator missed: widths do not fit
        return [
            f"unembed(final_norm(x^L)) cannot be computed ({error}): the state has width "
            f"{state.shape[-1]}, the unembedding takes {parts.unembed_weight.shape[1]}, and "
            "the located final norm does not map one to the other"
        ]
    problems = []
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


def module_path(model: nn.Module, module: nn.Module | None) -> str:
    """The name of ``module`` inside ``model`` (its type name if it is not found)."""
    if module is None:
        return "none (identity)"
    for name, candidate in model.named_modules():
        if candidate is module:
            return repr(name)
    return type(module).__name__
