"""Blocks called more than once per forward pass: one call site per call, in call order.

Looped depth (HRM's stacks, ``hrm_text``), weights shared between depths, or
a located layer list whose layers run more than once (Dory, :func:`calls_of`):
``num_hidden_layers`` counts calls, and the trajectory and the block Jacobians
follow the calls in order (docs/design.md, "Blocks called more than once").
A located block the forward pass never calls on text (Mllama's
cross-attention layers) is left out.

A :class:`CallSite` stands for one call: ``ModelParts.blocks`` lists one per
call, so every consumer (the collector's hooks, the engine's recording and
replays) sees L distinct blocks. A hook registered on a call site fires only
on its call of the shared module: one dispatcher hook pair on each repeated
module counts its calls since the decoder's forward began and runs the hooks
of the site whose turn it is. Calling a site directly (the engine's replay)
runs the module once, outside the count.

The dispatcher hooks stay on the model's modules for the model's lifetime (the
model's function is unchanged: they run the sites' hooks and return what
those return, nothing when a site has none).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lm_coupling.model.transformers_adapter import forward_hooks

__all__ = [
    "AltUpCollapse",
    "CallSite",
    "StreamReadout",
    "Streams",
    "call_sites",
    "calls_of",
    "eval_mode",
    "is_unrolled",
    "map_hidden",
    "residual_streams",
    "stream_sites",
]

PROBE_TOKENS = 2
"""Length of the probe prompt that finds the order of the calls."""

_DISPATCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""block module -> its `_Dispatch`."""

_RESETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""decoder -> the dispatchers its forward pre-hook resets."""

_ORDER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""decoder -> the call order the probe found (a list of modules; empty: no unrolling)."""


class CallSite(nn.Module):
    """Call ``call`` (0-based) of ``block`` within one forward pass of the model.

    Its parameters are the block's (the child ``block``); calling it runs the
    block once, outside the dispatcher's count. Hooks registered on it fire
    when the model's forward pass reaches this call.
    """

    def __init__(self, block: nn.Module, call: int, dispatch: _Dispatch):
        super().__init__()
        self.block = block
        self.call = call
        self._dispatch = dispatch  # not an nn.Module: an attribute, not a child

    @property
    def streams(self) -> Streams | None:
        """The residual streams the site flattens (None: one stream)."""
        return self._dispatch.streams

    def forward(self, *args, **kwargs):
        """The block's forward on these arguments (one call); flattened streams in and out."""
        streams = self._dispatch.streams
        if streams is not None:
            args, kwargs = map_hidden(args, kwargs, streams.unflatten)
        with self._dispatch.direct():
            out = self.block(*args, **kwargs)
        return out if streams is None else _map_output(out, streams.flatten)

    def extra_repr(self) -> str:
        """``call=i`` (and the streams) beside the block in the module's repr."""
        streams = self._dispatch.streams
        return f"call={self.call}" + ("" if streams is None else f", streams={streams.k}")


@dataclass(frozen=True)
class Streams:
    """k residual streams of width d, ``[..., k, d]``, seen as one state ``[..., k d]``.

    Stream i is columns ``i d .. (i + 1) d - 1`` of the flattened state.
    """

    k: int
    d: int
    leading: bool = False
    """The streams axis comes first, ``[k, B, T, d]`` (Gemma-3n's AltUp)."""

    def flatten(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., k, d]`` (``[k, ..., d]`` if leading) ``-> [..., k d]``, stream-major."""
        if self.leading:
            hidden = hidden.movedim(0, -2)
        return hidden.flatten(-2)

    def unflatten(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., k d] -> [..., k, d]`` (or ``[k, ..., d]``)."""
        hidden = hidden.unflatten(-1, (self.k, self.d))
        return hidden.movedim(-2, 0) if self.leading else hidden


def map_hidden(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    """Apply ``fn`` to a block call's hidden states (first argument or ``hidden_states``)."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return args, kwargs


def _map_output(output, fn):
    """Apply ``fn`` to a block's returned hidden states (a tensor or a tuple's first item)."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]), *output[1:])
    raise TypeError(f"a block with several residual streams returned {type(output).__name__}")


class _Dispatch:
    """The hooks on one repeated module: count its calls, run the current site's hooks."""

    def __init__(self, block: nn.Module, streams: Streams | None = None):
        self.streams = streams
        self.sites: list[CallSite] = []
        self.count = 0
        self.current: list[CallSite | None] = []
        self.suspended = 0
        block.register_forward_pre_hook(self._pre, with_kwargs=True)
        block.register_forward_hook(self._post, with_kwargs=True)

    def site(self, block: nn.Module, call: int) -> CallSite:
        while len(self.sites) <= call:
            self.sites.append(CallSite(block, len(self.sites), self))
        return self.sites[call]

    def reset(self) -> None:
        self.count = 0
        self.current.clear()

    @contextlib.contextmanager
    def direct(self) -> Iterator[None]:
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1

    def _pre(self, module, args, kwargs):
        if self.suspended:
            return None
        index, self.count = self.count, self.count + 1
        site = self.sites[index] if index < len(self.sites) else None
        self.current.append(site)
        if site is None:
            return None
        if self.streams is not None:
            args, kwargs = map_hidden(args, kwargs, self.streams.flatten)
        for hook, with_kwargs in forward_hooks(site, pre=True):
            if with_kwargs:
                result = hook(site, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(site, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        if self.streams is not None:
            args, kwargs = map_hidden(args, kwargs, self.streams.unflatten)
        return args, kwargs

    def _post(self, module, args, kwargs, output):
        if self.suspended:
            return None
        site = self.current.pop() if self.current else None
        if site is None:
            return None
        changed = False
        if self.streams is not None:
            args, kwargs = map_hidden(args, kwargs, self.streams.flatten)
            output = _map_output(output, self.streams.flatten)
        for hook, with_kwargs in forward_hooks(site, pre=False):
            if with_kwargs:
                result = hook(site, args, kwargs, output)
            else:
                result = hook(site, args, output)
            if result is not None:
                output, changed = result, True
        if self.streams is not None:
            return _map_output(output, self.streams.unflatten) if changed else None
        return output


def is_unrolled(blocks: list[nn.Module]) -> bool:
    """Whether ``blocks`` hold several calls of one module (blocks run more than once)."""
    sites = [b.block for b in blocks if isinstance(b, CallSite)]
    return len({id(m) for m in sites}) < len(sites)


def _top_lists(decoder: nn.Module) -> list[nn.ModuleList]:
    """The non-empty ``nn.ModuleList``s under the decoder not nested in another one."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in decoder.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, module))
    return [m for _, m in found]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode for the duration; every module's training flag restored after."""
    training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        yield
    finally:
        for module, flag in training.items():
            module.training = flag


def accepts_argument(model: nn.Module, name: str) -> bool:
    """Whether the model's ``forward`` takes the argument ``name`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: assume it does
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _call_order(model: nn.Module, decoder: nn.Module) -> list[nn.Module]:
    """The elements of the decoder's top-level module lists in the order one forward calls them."""
    if decoder in _ORDER:
        return _ORDER[decoder]
    members = {id(m): m for lst in _top_lists(decoder) for m in lst}
    order: list[nn.Module] = []
    handles = [
        m.register_forward_pre_hook(lambda module, args: order.append(module))
        for m in members.values()
    ]
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    ids = torch.arange(1, PROBE_TOKENS + 1, device=device)[None]
    try:
        with eval_mode(model), torch.no_grad():
            model(ids, **({"use_cache": False} if accepts_argument(model, "use_cache") else {}))
    except Exception:  # noqa: BLE001 - a model the probe cannot run: the generic rule decides
        order = []
    finally:
        for handle in handles:
            handle.remove()
    _ORDER[decoder] = order
    return order


def call_sites(model: nn.Module, decoder: nn.Module, n_layers: int | None) -> list[CallSite]:
    """One :class:`CallSite` per block call, in call order, or ``[]`` where none is needed.

    A short forward pass (``PROBE_TOKENS`` tokens, once per decoder) records
    the order in which the elements of the decoder's top-level
    ``nn.ModuleList``s run. The blocks are unrolled into calls when a module
    runs more than once or modules of several lists run, and the number of
    calls is the config's ``num_hidden_layers`` (``n_layers``; HRM counts its
    calls there). Otherwise ``[]``: the generic rule locates the blocks.
    """
    order = _call_order(model, decoder)
    if not order or (n_layers is not None and len(order) != n_layers):
        return []
    repeated = len({id(m) for m in order}) < len(order)
    lists = {id(lst) for lst in _top_lists(decoder) if any(m is x for m in lst for x in order)}
    if not repeated and len(lists) < 2:
        return []
    return _sites_in_order(decoder, order)


def calls_of(model: nn.Module, decoder: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The located ``blocks`` as the forward pass calls them: one entry per call, in call order.

    The probe's call order (``_call_order``) restricted to ``blocks``: a
    block never called on text is left out, a block called more than once
    (Dory) gives one :class:`CallSite` per call; ``blocks`` unchanged when
    the probe cannot run the model.
    """
    members = {id(b) for b in blocks}
    order = [m for m in _call_order(model, decoder) if id(m) in members]
    if not order:
        return blocks
    if len({id(m) for m in order}) == len(order):  # each called once (or never)
        return order
    return _sites_in_order(decoder, order)


def _sites_in_order(decoder: nn.Module, order: list[nn.Module]) -> list[nn.Module]:
    """One :class:`CallSite` per entry of ``order`` (modules in call order), numbered by call."""
    sites, seen = [], {}
    for module in order:
        dispatch = _DISPATCH.get(module)
        if dispatch is None:
            dispatch = _DISPATCH[module] = _Dispatch(module)
        call = seen.get(id(module), 0)
        seen[id(module)] = call + 1
        sites.append(dispatch.site(module, call))
    _register_reset(decoder, [_DISPATCH[m] for m in {id(m): m for m in order}.values()])
    return sites


def _register_reset(decoder: nn.Module, dispatchers: list[_Dispatch]) -> None:
    """Reset the dispatchers' counts whenever the decoder's forward begins (once per decoder)."""
    if decoder in _RESETS:
        known = _RESETS[decoder]
        known += [d for d in dispatchers if not any(d is k for k in known)]
        return
    _RESETS[decoder] = list(dispatchers)

    def reset(module, args):
        for dispatch in _RESETS.get(module, ()):
            dispatch.reset()

    decoder.register_forward_pre_hook(reset, prepend=True)


# -- several residual streams (hyper-connections, AltUp) ------------------------------------------
def residual_streams(
    model: nn.Module, decoder: nn.Module, d: int | None
) -> tuple[Streams, nn.Module] | None:
    """``(streams, collapse)`` of a model with several residual streams, else None.

    Hyper-connections (DeepSeek-V4, HY-V4): the decoder's ``hc_head`` (the
    model's own collapse of the ``[B, T, k, d]`` streams before its final
    norm) and ``config.hc_mult = k``. AltUp (Gemma-3n): the decoder's
    ``altup_unembed_projections`` and ``config.altup_num_inputs = k``, streams
    ``[k, B, T, d]``, collapsed as the model does (:class:`AltUpCollapse`).
    """
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not d:
        return None
    k = getattr(config, "hc_mult", None)
    head = getattr(decoder, "hc_head", None)
    if isinstance(k, int) and k >= 2 and isinstance(head, nn.Module):
        return Streams(k, d), head
    k = getattr(config, "altup_num_inputs", None)
    projections = getattr(decoder, "altup_unembed_projections", None)
    if isinstance(k, int) and k >= 2 and isinstance(projections, nn.ModuleList):
        return Streams(k, d, leading=True), AltUpCollapse(projections)
    return None


class AltUpCollapse(nn.Module):
    """Gemma-3n's collapse of its AltUp streams ``[k, ..., d]`` into one ``[..., d]``.

    As ``Gemma3nTextModel.forward`` does after its last block: stream 0 as it
    is; stream i through ``altup_unembed_projections[i - 1]``, rescaled to
    stream 0's root-mean-square (``sqrt(max(mean(p^2), 1e-5))`` below); the
    mean of the k. The first-batch check verifies that it reproduces the
    model's logits (``model.checks.readout_problems``).
    """

    EPS = 1e-5

    def __init__(self, projections: nn.ModuleList):
        super().__init__()
        self.projections = projections

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[k, ..., d] -> [..., d]``."""
        target = torch.mean(hidden[0] ** 2, dim=-1, keepdim=True) ** 0.5
        streams = [hidden[0]]
        for i, projection in enumerate(self.projections, start=1):
            projected = projection(hidden[i]).to(hidden.dtype)
            magnitude = torch.sqrt(
                torch.mean(projected**2, dim=-1, keepdim=True).clamp(min=self.EPS)
            )
            streams.append(projected * target / magnitude)
        return torch.stack(streams).mean(dim=0)


def stream_sites(blocks: list[nn.Module], streams: Streams, decoder: nn.Module) -> list[CallSite]:
    """One site per block that shows (and takes) its k streams as one ``[B, T, k d]`` state."""
    sites = []
    for block in blocks:
        dispatch = _DISPATCH.get(block)
        if dispatch is None:
            dispatch = _DISPATCH[block] = _Dispatch(block, streams)
        sites.append(dispatch.site(block, 0))
    _register_reset(decoder, [_DISPATCH[b] for b in blocks])
    return sites


class StreamReadout(nn.Module):
    """The model's own read-out of the streams: ``norm(hc_head(unflatten(x)))``.

    ``x [..., k d]`` is the flattened stream state; ``hc_head`` is the model's
    collapse of the k streams into one (DeepSeek-V4's ``DeepseekV4HyperHead``:
    a dynamic, input-dependent mix), ``norm`` its final norm (None: identity).
    """

    def __init__(self, streams: Streams, head: nn.Module, norm: nn.Module | None):
        super().__init__()
        self.streams = streams
        self.head = head
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The state the model's unembedding reads, ``[..., d]``."""
        lead = x.shape[:-1]
        rows = self.streams.unflatten(x.reshape(-1, 1, x.shape[-1]))  # [N, 1, k, d]
        collapsed = self.head(rows).reshape(*lead, self.streams.d)
        return collapsed if self.norm is None else self.norm(collapsed)
