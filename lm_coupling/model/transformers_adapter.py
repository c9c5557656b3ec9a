"""The one module that uses transformers beyond its documented public API.

Cache access (keys, values and recurrent states of a cache's layers), the
cache argument's name, switching and registering attention and experts
implementations, and the modules the Jacobian engine swaps all live here, one
function per use, each commented with the transformers behaviour it relies on;
``tests/capture/test_transformers_contract.py`` checks every use against the
installed transformers and names the use that broke. No other module of the
package reads or writes a private name of transformers (a test greps for it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from lm_coupling.errors import EngineFallbackWarning

STATE_ATTRIBUTES = ("conv_states", "recurrent_states", "ssm_states")
"""Attributes of a cache layer that keeps a state instead of (or beside) keys and values."""


# -- the cache argument ---------------------------------------------------------------
def cache_keyword(model: nn.Module) -> str:
    """The name under which ``model``'s forward takes a cache: ``cache`` or ``past_key_values``.

    Relies on: transformers renamed the forward argument ``past_key_values`` to
    ``cache`` (5.2x; the old name is a deprecated alias that warns with a
    ``FutureWarning`` and is announced for removal in 5.40.0); older releases,
    and remote-code models written for them, take ``past_key_values`` only. The
    name is read from the forward's signature (``inspect`` follows the
    ``deprecate_kwarg`` wrapper to the function itself), so each model gets the
    name it declares.
    """
    return _forward_cache_keyword(type(model))


@functools.cache
def _forward_cache_keyword(model_class: type) -> str:
    try:
        params = inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):  # no readable signature: the older, longer-lived name
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for a forward call of ``model`` (`cache_keyword`)."""
    return {cache_keyword(model): cache}


def output_cache(output: Any) -> Any:
    """The cache a model's forward returned with ``use_cache=True`` (None if it returned none).

    Relies on: model outputs are dataclasses (``ModelOutput``) whose cache
    field is ``cache`` on releases with the renamed argument and
    ``past_key_values`` before; reading the old name on a new release goes
    through a deprecated property that logs a warning, so the declared field
    is read.
    """
    names = {f.name for f in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else ()
    for name in ("cache", "past_key_values", "cache_params"):
        if name in names:
            return getattr(output, name)
    return getattr(output, "past_key_values", None)


def new_cache(config: Any = None) -> Any:
    """An empty ``DynamicCache``; laid out for ``config``'s layers where the release can.

    Relies on: ``DynamicCache(config=...)`` (transformers >= 4.56) builds one
    layer per decoder layer of the kind the model's own cache uses (sliding
    window, linear attention, indexed, ...); ``DynamicCache()`` builds full
    layers lazily, keeping every key/value row. ``config`` None asks for the
    latter (the engine's prefix cache keeps every row on every layer).
    """
    from transformers import DynamicCache

    return DynamicCache() if config is None else DynamicCache(config=config)


def is_cache(obj: Any) -> bool:
    """Whether ``obj`` is a transformers cache (``transformers.cache_utils.Cache``)."""
    from transformers.cache_utils import Cache

    return isinstance(obj, Cache)


def cache_layers(cache: Any) -> list[Any] | None:
    """The per-layer entries of a cache (its self-attention part), or None without them.

    Relies on: ``Cache.layers`` is a list with one entry per decoder layer
    (transformers >= 4.54); an ``EncoderDecoderCache`` keeps the decoder's in
    ``self_attention_cache``.
    """
    cache = getattr(cache, "self_attention_cache", cache)
    return getattr(cache, "layers", None)


def layer_keys_values(layer: Any) -> tuple[Any, Any] | None:
    """A cache layer's ``(keys, values)`` ``[B, H_kv, T, d_head]``, or None where it holds none.

    Relies on: a cache layer keeps its keys and values as the tensors
    ``.keys`` and ``.values`` (``DynamicLayer``, transformers >= 4.54), None
    (or absent) before its first update and on layers without attention.
    """
    keys = getattr(layer, "keys", None)
    if keys is None or not hasattr(keys, "shape"):
        return None
    return keys, layer.values


def layer_keeps_state(layer: Any) -> bool:
    """Whether a cache layer keeps a recurrent, state-space or convolution state.

    Relies on: such layers (``LinearAttentionLayer``, Mamba's and hybrids'
    layers) carry one of `STATE_ATTRIBUTES`.
    """
    return any(hasattr(layer, name) for name in STATE_ATTRIBUTES)


def cache_keeps_state(cache: Any) -> bool:
    """Whether a cache without per-layer entries keeps a recurrent or convolution state itself.

    Relies on: before ``Cache.layers`` covered them, transformers returned
    Mamba's state as a ``MambaCache`` (transformers 4.56: no ``layers``, the
    lists ``conv_states`` and ``ssm_states`` on the cache itself); later
    releases give such models a ``Cache`` whose layers carry
    `STATE_ATTRIBUTES` (`layer_keeps_state`).
    """
    return cache is not None and cache_layers(cache) is None and layer_keeps_state(cache)


def model_cache_layers(model: nn.Module) -> list[Any]:
    """The layers of the cache the model itself would use (`new_cache` with its config)."""
    return cache_layers(new_cache(model.config)) or []


# -- attention and experts implementations --------------------------------------------
_ATTN_FIELD = "_attn_implementation_internal"
_EXPERTS_FIELD = "_experts_implementation_internal"


def attention_implementation(config: Any) -> Any:
    """The attention implementation a config selects (``"eager"``, ``"sdpa"``, ...).

    Relies on: ``PretrainedConfig._attn_implementation`` (a property over
    ``_attn_implementation_internal``) names the implementation every
    attention module of the model looks up at call time.
    """
    return getattr(config, "_attn_implementation", None)


def saved_implementations(config: Any) -> tuple[Any, Any]:
    """The values `set_implementations` overwrites, as set on this config object itself.

    Relies on: ``_attn_implementation_internal`` and
    ``_experts_implementation_internal`` are plain instance attributes of the
    config (read from ``__dict__``, so a class default is not mistaken for a
    value set on this config).
    """
    return config.__dict__.get(_ATTN_FIELD), config.__dict__.get(_EXPERTS_FIELD)


def experts_implementation(config: Any) -> Any:
    """The mixture-of-experts implementation this config sets (None where it sets none).

    Relies on: ``_experts_implementation_internal`` (transformers >= 5) selects
    the experts kernel (``"eager"`` loops over experts; ``"grouped_mm"``...).
    """
    return config.__dict__.get(_EXPERTS_FIELD)


def set_attention_implementation(config: Any, value: Any) -> None:
    """Make every attention module reading ``config`` use ``value`` from its next call.

    Relies on: attention modules read ``config._attn_implementation`` at each
    forward (not once at construction), so assigning
    ``_attn_implementation_internal`` switches a built model without
    reloading; ``set_attn_implementation`` would also validate and re-dispatch
    sub-models, which the engine must not do for one call.
    """
    setattr(config, _ATTN_FIELD, value)


def set_experts_implementation(config: Any, value: Any) -> None:
    """Make the model's experts layers use ``value`` from their next call.

    Relies on: experts layers read ``_experts_implementation_internal`` at each forward.
    """
    setattr(config, _EXPERTS_FIELD, value)


def global_attention(name: str) -> Callable:
    """Transformers' registered attention function ``name`` (its global entry).

    Relies on: a fresh ``AttentionInterface()`` has no local overrides, so
    indexing it returns the global registration.
    """
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface()[name]


def register_attention(name: str, attention: Callable) -> None:
    """Register ``attention`` under ``name``, with SDPA's mask builder for the same name.

    Relies on: ``AttentionInterface.register`` and
    ``AttentionMaskInterface.register`` add a global name that a config's
    ``_attn_implementation`` can select, and transformers picks the mask
    builder by the same name (``sdpa_mask`` builds SDPA's masks).
    """
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)


_OWN_SDPA_BRANCH = re.compile(
    r"""_attn_implementation\s*(?:[!=]=|(?:not\s+)?in)\s*[^:\n]*["']sdpa["']"""
)
"""Source text of a modeling module that tests the attention's name itself: Falcon's
``_attn_implementation == "sdpa"``, and DeepSeek-V3.2-style indexer attention's
``_attn_implementation in ("eager", "sdpa")``, which applies the indexer's top-k mask
under those names only (under another name it hands the indices to a kernel instead)."""


def _module_source(module_name: str) -> str:
    """The source text of an imported module ("" where it has none; ``linecache`` keeps it)."""
    module = sys.modules.get(module_name)
    try:
        return inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError) as error:  # no source file (a frozen or compiled module)
        warnings.warn(
            f"the Jacobian engine cannot read the source of {module_name} ({error}), so it "
            "cannot tell whether that module's attention is looked up by name; its models "
            "keep SDPA with the prefix concatenated (exact, slower on long prompts)",
            EngineFallbackWarning,
            stacklevel=3,
        )
        return ""


def attention_dispatched_by_name(model: nn.Module) -> bool:
    """Whether the model's attention looks its function up by the config's name only.

    True when the modeling modules of its submodules (transformers' own and
    remote-code ``transformers_modules.*``) use ``ALL_ATTENTION_FUNCTIONS`` and
    none compares ``_attn_implementation`` with ``"sdpa"``: then an attention
    function registered under another name (`register_attention`) runs where
    SDPA would. A model with its own SDPA branch (Falcon) would take another
    path under another name.

    Relies on: transformers' modeling modules select the attention function
    as ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` (read in
    their source text: transformers has no flag for it), and a module that
    branches on the name itself compares ``_attn_implementation`` with
    ``"sdpa"`` in its source (``==``, ``!=``, ``in (...)``).
    """
    names = {type(m).__module__ for m in model.modules()}
    sources = [_module_source(n) for n in sorted(names) if n.startswith("transformers")]
    uses = any("ALL_ATTENTION_FUNCTIONS" in source for source in sources)
    return uses and not any(_OWN_SDPA_BRANCH.search(source) for source in sources)


# -- modules the engine swaps -----------------------------------------------------------
def bloom_gelu_forward() -> Callable:
    """Bloom's GELU function (``BloomGelu``'s forward, a custom autograd function in training).

    Relies on: ``transformers.models.bloom.modeling_bloom.bloom_gelu_forward``
    is the tanh-approximate GELU that ``BloomGelu`` computes outside training.
    """
    from transformers.models.bloom.modeling_bloom import bloom_gelu_forward as forward

    return forward


def module_with_child_replaced(module: nn.Module, name: str, child: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose child ``name`` is ``child``; ``module`` is unchanged.

    Relies on: ``torch.nn.Module`` keeps its children in the ``_modules``
    dictionary and looks them up there on attribute access, so a shallow copy
    with its own ``_modules`` runs the parent's ``forward`` with one child
    swapped (a head transform read out without its unembedding).
    """
    import copy

    head = copy.copy(module)
    head._modules = dict(module._modules)
    head._modules[name] = child
    return head


def forward_hooks(module: nn.Module, pre: bool) -> list[tuple[Callable, bool]]:
    """The forward (``pre=False``) or forward-pre hooks registered on ``module``, in order.

    Each as ``(hook, with_kwargs)``, so that a dispatcher can run the hooks of a
    module that is not itself called (a call site of a block run several times,
    ``model.block_calls``) as torch would.

    Relies on: ``torch.nn.Module`` keeps its hooks in the ordered dictionaries
    ``_forward_pre_hooks`` / ``_forward_hooks`` (handle id -> hook) and the ids
    of hooks registered ``with_kwargs=True`` in ``_forward_pre_hooks_with_kwargs``
    / ``_forward_hooks_with_kwargs`` (torch has no public accessor).
    """
    if pre:
        hooks, with_kwargs = module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs
    else:
        hooks, with_kwargs = module._forward_hooks, module._forward_hooks_with_kwargs
    return [(hook, key in with_kwargs) for key, hook in list(hooks.items())]


def loaded_from(model: Any) -> str:
    """The path or hub id a model was loaded from (``config.name_or_path``; empty if built).

    Relies on: ``PretrainedConfig.name_or_path`` is set by ``from_pretrained``
    and empty for a model built from a config.
    """
    value = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    return value if isinstance(value, str) else ""
