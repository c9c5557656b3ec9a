"""Locate the decoder blocks, final norm and unembedding of a Hugging Face causal LM.

This is the only module that knows where a model keeps its parts. A generic
rule covers most causal LMs (``get_output_embeddings``, ``get_input_embeddings``,
the decoder from ``get_decoder``/``base_model``, the ``nn.ModuleList`` of
``num_hidden_layers`` blocks, a final norm under a common attribute name); a
small override table keyed by ``config.model_type`` fixes the rest. Users add
entries with :func:`register_override`.

Notation (docs/design.md, "Conventions"): x^0 is the input of block 1, x^l the output of block l,
before the final norm N. The lens distribution is
``P^l = softmax(W_U N(x^l) + b)``; :meth:`ModelParts.unembed_fp32` composed
with :meth:`ModelParts.final_norm_fp32` reproduces the model's own logits at
l = L (including any logit scaling or soft-capping the model applies).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.model.block_calls import (
    StreamReadout,
    call_sites,
    calls_of,
    residual_streams,
    stream_sites,
)
from lm_coupling.model.transformers_adapter import module_with_child_replaced

__all__ = [
    "ModelParts",
    "block_output_hidden",
    "locate_model_parts",
    "register_override",
    "work_dtype",
]

FINAL_NORM_NAMES = (
    "norm",
    "ln_f",
    "final_layer_norm",
    "final_layernorm",
    "norm_f",
    "model_norm",
    "final_norm",  # RecurrentGemma
    "layer_norm",  # BioGPT, XGLM
    "embedding_norm",  # LFM2 (applied after the last block despite its name)
    "ln_out",  # RWKV
    "layernorm",  # CTRL
    "ln",  # Megatron-BERT (on its encoder)
    "out_norm",  # xLSTM
    "LayerNorm",  # RoBERTa-PreLayerNorm (on the model), XLM-RoBERTa-XL (on its encoder)
)
"""Attribute names of the final norm on the decoder, tried in order (the first-batch
check verifies that the one found reproduces the model's logits)."""

_UNEMBED_CHUNK = 32768
"""Vocabulary rows converted to float32 at a time in :meth:`ModelParts.unembed_fp32`."""

# model_type -> {"blocks": path, "final_norm": path | tuple of paths, "unembed": path,
# "embedding": path, "logit_scale": float, "logit_softcap": float | None}. Paths
# are relative to the causal-LM object; a final-norm tuple is applied in order
# (paths that resolve to None are skipped), and an empty tuple means "no final norm".
_OVERRIDES: dict[str, dict[str, str | tuple[str, ...] | float | None]] = {
    # OPT: optional final_layer_norm (None without do_layer_norm_before) and an
    # optional project_out (word_embed_proj_dim != hidden_size) before lm_head.
    "opt": {
        "blocks": "model.decoder.layers",
        "final_norm": ("model.decoder.final_layer_norm", "model.decoder.project_out"),
    },
    # HRM (looped depth): the last call is the high-level stack's last layer, whose
    # output the stack's own final norm reads out (model/block_calls.py).
    "hrm_text": {"final_norm": ("model.H_module.final_norm",)},
}


def register_override(
    model_type: str,
    *,
    blocks: str | None = None,
    final_norm: str | Sequence[str] | None = None,
    unembed: str | None = None,
    embedding: str | None = None,
    logit_scale: float | None = None,
    logit_softcap: float | None = None,
) -> None:
    """Tell :func:`locate_model_parts` where a model type keeps its parts.

    Paths are dotted attribute paths relative to the causal-LM object, e.g.
    ``register_override("gpt2", blocks="transformer.h", final_norm="transformer.ln_f",
    unembed="lm_head")``. Fields left None fall back to the generic rule.

    Args:
        model_type: ``model.config.model_type``.
        blocks: path of the ``nn.ModuleList`` of decoder blocks.
        final_norm: path of the final norm; a sequence of paths for modules
            applied in order between the last block and the unembedding
            (paths resolving to None are skipped); an empty sequence (or
            ``""``) for a model without a final norm.
        unembed: path of the module whose ``weight`` is ``W_U [V, d]`` (and
            whose ``bias``, if any, is ``b [V]``).
        embedding: path of the input embedding module.
        logit_scale: factor the model multiplies its logits by (when its config
            does not name it ``logit_scale``/``logits_scaling``).
        logit_softcap: ``c`` of a final ``c * tanh(z / c)`` soft-cap (when the
            config does not name it ``final_logit_softcapping``,
            ``logits_soft_cap`` or ``output_logit_soft_cap``); 0 for none.

    Raises:
        TypeError: a path is not a string.
    """
    entry: dict[str, str | tuple[str, ...] | float | None] = {}
    for key, value in (("blocks", blocks), ("unembed", unembed), ("embedding", embedding)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise TypeError(f"register_override: {key} must be a dotted path string, got {value!r}")
        entry[key] = value
    if final_norm is not None:
        paths = (final_norm,) if isinstance(final_norm, str) else tuple(final_norm)
        if not all(isinstance(p, str) for p in paths):
            raise TypeError(
                f"register_override: final_norm must be path string(s), got {final_norm!r}"
            )
        entry["final_norm"] = tuple(p for p in paths if p)
    if logit_scale is not None:
        entry["logit_scale"] = float(logit_scale)
    if logit_softcap is not None:
        entry["logit_softcap"] = float(logit_softcap) or None
    _OVERRIDES[model_type] = entry


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def block_output_hidden(output) -> torch.Tensor:
    """Return the hidden states ``[B, T, d]`` from a decoder block's return value.

    Blocks return a tensor (transformers 5.x, most models) or a tuple whose first
    item is the hidden states (older code, some models); model-output records
    are indexed like tuples.

    Raises:
        TypeError: no tensor could be found.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if hasattr(output, "to_tuple"):
        return block_output_hidden(output.to_tuple())
    raise TypeError(
        "expected a decoder block to return a tensor or a tuple starting with the hidden "
        f"states, got {type(output).__name__}; register an override for this model"
    )


@dataclass
class ModelParts:
    """The parts of a causal LM that capture and the Jacobian engine need.

    Attributes:
        model_type: ``config.model_type``.
        blocks: the L decoder blocks, in order; for a model whose blocks run more
            than once per forward pass, one call site per call, in call order
            (``model.block_calls.CallSite``; docs/design.md); blocks the
            forward pass never calls on text (Mllama's cross-attention layers)
            are left out.
        final_norm: the final norm N (or a composition of modules applied
            before the unembedding); None means N is the identity.
        unembed_weight: ``W_U [V, d]`` (tied to the input embedding in some models).
        unembed_bias: ``b [V]`` or None.
        embedding: the input embedding module.
        hidden_size: the residual-stream width d (None: ``unembed_weight.shape[1]``).
        logit_scale: factor the model applies to its logits (Cohere, Granite); 1.0 if none.
        logit_softcap: ``c`` in ``c * tanh(z / c)`` (Gemma 2 ``final_logit_softcapping``) or None.
    """

    model_type: str
    blocks: list[nn.Module]
    final_norm: nn.Module | None
    unembed_weight: torch.Tensor
    unembed_bias: torch.Tensor | None
    embedding: nn.Module
    hidden_size: int | None = None
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    _norm_copies: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_layers(self) -> int:
        """The number of decoder blocks L."""
        return len(self.blocks)

    @property
    def d_model(self) -> int:
        """The residual-stream width d."""
        return self.hidden_size if self.hidden_size is not None else self.unembed_weight.shape[1]

    @property
    def vocab_size(self) -> int:
        """The number of unembedding rows V."""
        return self.unembed_weight.shape[0]

    @property
    def input_device(self) -> torch.device:
        """The device token ids go to: the input embedding's (else block 1's, else CPU)."""
        for module in (self.embedding, self.blocks[0]):
            param = next(module.parameters(), None)
            if param is not None:
                return param.device
        return torch.device("cpu")

    def _norm_in(self, dtype: torch.dtype) -> nn.Module:
        """The final norm with parameters in ``dtype``: the model's own or a cached copy."""
        params = list(self.final_norm.parameters()) + list(self.final_norm.buffers())
        floats = [p for p in params if p.is_floating_point()]
        if all(p.dtype == dtype for p in floats):
            return self.final_norm
        if dtype not in self._norm_copies:
            self._norm_copies[dtype] = copy.deepcopy(self.final_norm).to(dtype)
        return self._norm_copies[dtype]

    def final_norm_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the model's own final norm N in float32 (float64 input stays float64).

        Args:
            x: ``[..., d]`` states x^l, any float dtype and device.

        Returns:
            ``[..., d]`` ``N(x)`` in float32 (float64 for float64 input), on the
            norm's device; ``x`` converted when there is no final norm.
        """
        dtype = work_dtype(x)
        if self.final_norm is None:
            return x.to(dtype)
        norm = self._norm_in(dtype)
        device = next((p.device for p in norm.parameters()), x.device)
        with torch.no_grad():
            return norm(x.to(device=device, dtype=dtype))

    def unembed_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """Compute the model's logits ``W_U x + b`` in float32 (float64 stays float64).

        Any logit scaling and soft-capping the model applies after its
        unembedding is applied too, so that ``unembed_fp32(final_norm_fp32(x^L))``
        equals the model's own logits. A weight in another dtype (bfloat16) is
        converted in row chunks of `_UNEMBED_CHUNK`, never cached.

        Args:
            x: ``[..., d]`` normed states.

        Returns:
            ``[..., V]`` logits on the unembedding weight's device.
        """
        dtype = work_dtype(x)
        weight = self.unembed_weight.detach()
        x = x.to(device=weight.device, dtype=dtype)
        with torch.no_grad():
            if weight.dtype == dtype:
                logits = nn.functional.linear(x, weight)
            else:
                chunks = [
                    nn.functional.linear(x, rows.to(dtype))
                    for rows in weight.split(_UNEMBED_CHUNK, dim=0)
                ]
                logits = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-1)
            if self.unembed_bias is not None:
                logits = logits + self.unembed_bias.detach().to(dtype)
            if self.logit_scale != 1.0:
                logits = logits * self.logit_scale
            if self.logit_softcap is not None:
                logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


def _resolve(root: nn.Module, path: str):
    """Follow a dotted attribute path (integer parts index lists); None if absent."""
    obj = root
    for part in path.split("."):
        if obj is None:
            return None
        if part.isdigit() and isinstance(obj, (nn.ModuleList, nn.Sequential, list, tuple)):
            obj = obj[int(part)] if int(part) < len(obj) else None
        else:
            obj = getattr(obj, part, None)
    return obj


def _text_config(model: nn.Module):
    """The (text) config of a model, or None."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def _decoder(model: nn.Module) -> nn.Module:
    """The first of ``get_decoder()``, ``base_model``, ``model``, ``transformer`` with a ModuleList.

    Else the model itself (Llama-4's text model returns itself from the first two).
    """
    candidates: list[nn.Module] = []
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(model.get_decoder())
        except (AttributeError, NotImplementedError, ValueError):
            pass
    candidates.append(getattr(model, "base_model", None))
    candidates += [getattr(model, name, None) for name in ("model", "transformer")]
    for candidate in candidates:
        if isinstance(candidate, nn.Module) and candidate is not model:
            if _module_lists(candidate):
                return candidate
    return model


def _module_lists(decoder: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every non-empty ``nn.ModuleList`` under the decoder, with its path."""
    return [
        (name, module)
        for name, module in decoder.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]


def _describe_lists(lists: list[tuple[str, nn.ModuleList]], limit: int = 6) -> str:
    """``'layers' (4: JambaAttentionDecoderLayer x1, JambaMambaDecoderLayer x3), ...``."""
    if not lists:
        return "no non-empty nn.ModuleList"
    parts = []
    for name, module in lists[:limit]:
        classes: dict[str, int] = {}
        for child in module:
            classes[type(child).__name__] = classes.get(type(child).__name__, 0) + 1
        kinds = ", ".join(f"{k} x{v}" for k, v in classes.items())
        parts.append(f"{name or '<decoder>'!r} ({len(module)}: {kinds})")
    more = f" and {len(lists) - limit} more" if len(lists) > limit else ""
    return "nn.ModuleLists " + "; ".join(parts) + more


def _find_blocks(decoder: nn.Module, n_layers: int | None) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of decoder blocks: the shallowest of ``n_layers``, else the longest.

    Without a list of ``n_layers`` (hybrid stacks mix block classes), the
    longest list of one class (then of several), shallowest first.
    """
    candidates = _module_lists(decoder)
    if not candidates:
        return None
    if n_layers is not None:
        exact = [c for c in candidates if len(c[1]) == n_layers]
        if exact:
            return min(exact, key=lambda c: c[0].count("."))
    return max(
        candidates,
        key=lambda c: (len({type(m) for m in c[1]}) == 1, len(c[1]), -c[0].count(".")),
    )


def _find_final_norm(model: nn.Module, decoder: nn.Module) -> nn.Module | None:
    """The final norm under one of ``FINAL_NORM_NAMES`` on the decoder (or base model)."""
    holders = [decoder]
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not decoder:
        holders.append(base)
    encoder = getattr(decoder, "encoder", None)  # BERT-style stacks run as decoders
    if isinstance(encoder, nn.Module):
        holders.append(encoder)
    for holder in holders:
        for name in FINAL_NORM_NAMES:
            module = getattr(holder, name, None)
            if isinstance(module, nn.Module):
                return module
    return None


def _unsupported(model: nn.Module, model_type: str, what: str, looked: str, found: str):
    """An UnsupportedModelError saying what was looked for and how to add an override."""
    return UnsupportedModelError(
        f"cannot use {type(model).__name__} (model_type={model_type!r}) as a causal LM: "
        f"no {what}. Looked for {looked}; found {found}. lm-coupling needs a decoder-only "
        "causal LM (blocks, final norm, unembedding). If this model is one, tell lm-coupling "
        "where its parts are: lm_coupling.model.architecture.register_override("
        f"{model_type!r}, blocks='model.layers', final_norm='model.norm', unembed='lm_head')"
        " with the attribute paths of your model."
    )


def _check_causal(model: nn.Module, model_type: str, config) -> None:
    """Reject encoder-decoder and non-generating models without an override."""
    if config is not None and getattr(config, "is_encoder_decoder", False):
        raise _unsupported(
            model,
            model_type,
            "decoder-only stack",
            "a decoder-only model",
            "an encoder-decoder model (config.is_encoder_decoder=True)",
        )
    if model_type in _OVERRIDES:
        return
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and not can_generate():
        raise _unsupported(
            model,
            model_type,
            "causal language-model head",
            "a model that can generate (a *ForCausalLM class)",
            f"{type(model).__name__}.can_generate() is False",
        )


def _locate_blocks(model, model_type, override, decoder, n_layers) -> list[nn.Module]:
    """The decoder blocks, from the override or the generic rule."""
    if "blocks" in override:
        blocks = _resolve(model, override["blocks"])
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
            raise _unsupported(
                model,
                model_type,
                "decoder blocks",
                f"the override path {override['blocks']!r}",
                f"{type(blocks).__name__}",
            )
        return list(blocks)
    found = _find_blocks(decoder, n_layers)
    if found is None or (n_layers is not None and len(found[1]) != n_layers):
        # no list of num_hidden_layers blocks: blocks called more than once (looped
        # depth, HRM) give one call site per call, in call order
        sites = call_sites(model, decoder, n_layers)
        if sites:
            return list(sites)
    if found is None:
        raise _unsupported(
            model,
            model_type,
            "decoder blocks",
            f"an nn.ModuleList of {n_layers} blocks under {type(decoder).__name__}",
            _describe_lists(_module_lists(decoder)),
        )
    # a located block may run more than once (Dory's looped section: one call site per
    # call) or never on text (Mllama's cross-attention layers: left out)
    return list(calls_of(model, decoder, list(found[1])))


def _locate_final_norm(model, override, decoder) -> nn.Module | None:
    """The final norm (None = identity), from the override or the generic rule."""
    if "final_norm" not in override:
        return _find_final_norm(model, decoder)
    modules = [_resolve(model, p) for p in override["final_norm"]]
    modules = [m for m in modules if isinstance(m, nn.Module)]
    if not modules:
        return None
    return modules[0] if len(modules) == 1 else nn.Sequential(*modules)


_HEAD_WORDS = ("predict", "transform", "head")
"""A top-level module named (or of a class named) with one of these, registered before the
unembedding, is a head transform (Electra's ``generator_predictions``, ModernBERT-decoder's
``lm_head`` before its ``decoder`` projection)."""


class HeadTransform(nn.Module):
    """The part of a prediction head before its unembedding: the head's own forward.

    ``container`` holds the unembedding as its child ``name`` (BERT's
    ``cls.predictions``, RoBERTa's ``lm_head``); its forward runs on a shallow
    copy whose child ``name`` is the identity (the model is not modified).
    """

    def __init__(self, container: nn.Module, name: str):
        super().__init__()
        self.container = container
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The head's forward with the unembedding left out."""
        head = module_with_child_replaced(self.container, self.name, nn.Identity())
        out = type(self.container).forward(head, x)
        return block_output_hidden(out)


def _head_transforms(
    model: nn.Module, head: nn.Module, excluded: list[nn.Module], width_differs: bool
) -> list[nn.Module]:
    """Modules the model applies to the final state before the unembedding ``head``.

    The forward of a prediction module holding the head, without the head
    (:class:`HeadTransform`), after any top-level module registered before the
    head that is named as a head or prediction (or any such module when the
    widths differ), except modules holding ``excluded``. The first-batch check
    (``model.checks.readout_problems``) verifies the read-out.
    """
    path = next((name for name, m in model.named_modules() if m is head), None)
    if not path:
        return []
    names = path.split(".")
    found: list[nn.Module] = []
    for name, child in model.named_children():
        if name == names[0]:
            break
        if any(x is child or any(x is m for m in child.modules()) for x in excluded):
            continue
        label = f"{name} {type(child).__name__}".lower()
        if width_differs or any(word in label for word in _HEAD_WORDS):
            found.append(child)
    if len(names) > 1:
        container = model.get_submodule(".".join(names[:-1]))
        # A container that holds the decoder or the embedding is the causal LM itself
        # (a PEFT-wrapped model keeps it under base_model.model), not a prediction head.
        if not any(x is m for m in container.modules() for x in excluded):
            found.append(HeadTransform(container, names[-1]))
    return found


def _locate_unembed(model, model_type, override) -> nn.Module:
    """The unembedding module (``weight [V, d]``, optional ``bias``)."""
    if "unembed" in override:
        head, looked = _resolve(model, override["unembed"]), f"the path {override['unembed']!r}"
    else:
        getter = getattr(model, "get_output_embeddings", None)
        head, looked = (getter() if callable(getter) else None), "model.get_output_embeddings()"
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise _unsupported(
            model,
            model_type,
            "unembedding (output embeddings)",
            looked,
            "None" if head is None else f"{type(head).__name__} without a 2-D weight",
        )
    return head


def _logit_transform(config, override) -> tuple[float, float | None]:
    """The logit scale and soft-cap: the override's, else the config's."""
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    scaling = getattr(config, "logits_scaling", None)
    if scaling:
        scale /= float(scaling)
    mup = getattr(config, "logits_mup_width_multiplier", None)  # Inkling: lm_head(x / m)
    if mup:
        scale /= float(mup)
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is None:
        softcap = getattr(config, "logits_soft_cap", None)  # RecurrentGemma
    if softcap is None:
        softcap = getattr(config, "output_logit_soft_cap", None)  # xLSTM
    scale = float(override.get("logit_scale", scale))
    softcap = override.get("logit_softcap", softcap)
    return scale, softcap


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``get_base_model()``), else ``model``."""
    getter = getattr(model, "get_base_model", None)
    inner = getter() if callable(getter) else None
    return inner if isinstance(inner, nn.Module) and inner is not model else model


def locate_model_parts(model: nn.Module) -> ModelParts:
    """Find the blocks, final norm, unembedding and input embedding of a causal LM.

    The generic rule runs first; entries of the override table for
    ``config.model_type`` (see :func:`register_override`) replace what they name.

    Args:
        model: a Hugging Face causal LM (e.g. ``AutoModelForCausalLM``).

    Returns:
        The located :class:`ModelParts`; the model is not modified.

    Raises:
        UnsupportedModelError: the model is not a decoder-only causal LM or a part
            could not be located; the message says what was looked for, what was
            found, and how to add an override.
    """
    model = _unwrapped(model)
    config = _text_config(model)
    model_type = str(getattr(config, "model_type", None) or type(model).__name__)
    override = _OVERRIDES.get(model_type, {})
    _check_causal(model, model_type, config)
    decoder = _decoder(model)
    n_layers = getattr(config, "num_hidden_layers", None)
    blocks = _locate_blocks(model, model_type, override, decoder, n_layers)
    head = _locate_unembed(model, model_type, override)
    if "embedding" in override:
        embedding = _resolve(model, override["embedding"])
    else:
        getter = getattr(model, "get_input_embeddings", None)
        embedding = getter() if callable(getter) else None
    if not isinstance(embedding, nn.Module):
        raise _unsupported(
            model, model_type, "input embedding", "model.get_input_embeddings()", "None"
        )
    bias = getattr(head, "bias", None)
    scale, softcap = _logit_transform(config, override)
    final_norm = _locate_final_norm(model, override, decoder)
    hidden = getattr(config, "hidden_size", None)
    if "final_norm" not in override:
        width_differs = hidden is not None and head.weight.shape[1] != hidden
        transforms = _head_transforms(model, head, [decoder, embedding], width_differs)
        if transforms:
            modules = ([final_norm] if final_norm is not None else []) + transforms
            final_norm = nn.Sequential(*modules)
    several = residual_streams(model, decoder, hidden)
    if several is not None:  # hyper-connections, AltUp: the k streams flattened are the state
        streams, collapse = several
        blocks = stream_sites(blocks, streams, decoder)
        final_norm = StreamReadout(streams, collapse, final_norm)
        hidden = streams.k * streams.d
    return ModelParts(
        model_type=model_type,
        blocks=blocks,
        final_norm=final_norm,
        unembed_weight=head.weight,
        unembed_bias=bias if isinstance(bias, torch.Tensor) else None,
        embedding=embedding,
        hidden_size=hidden,
        logit_scale=scale,
        logit_softcap=float(softcap) if softcap else None,
    )
