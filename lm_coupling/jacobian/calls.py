"""Replayable block calls for the Jacobian engine: record a block's inputs, call it again.

The engine differentiates one decoder block at a time. A forward pre-hook
records what the model passes to block l (hidden states x^{l-1}, attention
mask, position embeddings, cache, ...); :class:`BlockCall` then calls the block
again on new hidden states with everything else held fixed, in float32 (float64
for a float64 model), without modifying the model.

The cache replay: attention is causal and n is the last position, so the keys
and values of positions 0..n-1 do not depend on x_n. Token n runs with each
block's cache replaced by a :class:`FrozenPrefixCache` of the prefix's keys
and values, whose ``update`` returns ``cat(prefix, new)`` without storing
anything, so the block can be called any number of times, also under
``torch.func`` transforms; or, where the model's attention runs as the
engine's own SDPA function, hands the prefix to it uncopied (``probe_split``,
``jacobian.frozen_attention``). The prefix keeps every key/value row on every
layer: sliding windows and attention chunks are applied by the model's masks.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lm_coupling.errors import EngineFallbackWarning, LmCouplingError, UnsupportedModelError
from lm_coupling.jacobian.engine_mode import engine_mode
from lm_coupling.jacobian.frozen_attention import STASH, StashMismatch
from lm_coupling.model import transformers_adapter as tfa
from lm_coupling.model.architecture import ModelParts, block_output_hidden, work_dtype
from lm_coupling.model.block_calls import accepts_argument, eval_mode

__all__ = [
    "BlockCall",
    "FrozenPrefixCache",
    "compute_dtype",
    "engine_mode",
    "probe_split",
    "PromptPass",
    "record_last_token",
    "replay_errors",
    "run_prompts",
]


def compute_dtype(parts: ModelParts) -> torch.dtype:
    """The engine's dtype: float64 for a float64 model (tests), else float32."""
    param = next((p for p in parts.blocks[0].parameters() if p.is_floating_point()), None)
    return torch.float32 if param is None else work_dtype(param)


class FrozenPrefixCache:
    """A read-only stand-in for a transformers ``Cache`` holding fixed prefix keys/values.

    ``update(k, v, layer_idx)`` returns ``(cat([K_prefix, k], -2), cat([V_prefix, v], -2))``
    and stores nothing, so repeated and vectorized calls (``vmap``, ``jvp``,
    ``vjp``) all see the same prefix.

    Args:
        prefixes: layer index -> ``(K [1, H_kv, n, d_head], V [...])``.
    """

    is_compileable = False

    def __init__(self, prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self._prefixes = prefixes
        self.split: set[int] = set()
        """Layers whose prefix goes to the wrapped SDPA attention (``probe_split``)."""
        self.touched: set[int] = set()
        """Layers ``update`` was called for (reset by ``probe_split``)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Return the prefix keys/values followed by the new ones, without storing.

        For a layer in ``split``, stash the prefix for the attention call instead
        and return only the new key and value (``jacobian.frozen_attention``).
        """
        if layer_idx not in self._prefixes:
            raise LmCouplingError(
                f"the Jacobian engine has no prefix keys/values for attention layer "
                f"{layer_idx}; found layers {sorted(self._prefixes)}"
            )
        k0, v0 = self._prefixes[layer_idx]
        self.touched.add(layer_idx)
        if layer_idx in self.split:
            STASH.put(k0, v0)
            return key_states, value_states
        batch = key_states.shape[0]
        keys = torch.cat([k0.expand(batch, *k0.shape[1:]), key_states], dim=-2)
        values = torch.cat([v0.expand(batch, *v0.shape[1:]), value_states], dim=-2)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The prefix length n."""
        keys = self._prefixes.get(layer_idx)
        return 0 if keys is None else keys[0].shape[-2]


def _map_tensors(obj, fn: Callable):
    """Apply ``fn`` to every tensor (and Cache) inside tuples, lists and dicts."""
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return fn(obj)


@dataclass
class BlockCall:
    """One decoder block with its recorded inputs, callable on new hidden states.

    Attributes:
        block: the model's own block (never modified).
        args: recorded positional arguments (cast to ``dtype``; caches replaced).
        kwargs: recorded keyword arguments (same).
        hidden: ``[1, T', d]`` recorded hidden-state input x^{l-1} in ``dtype``.
        dtype: the compute dtype.
        split_prefix: the frozen prefix reaches the attention without being
            concatenated (``probe_split``), so products do not copy it per tangent.
    """

    block: nn.Module
    args: tuple
    kwargs: dict
    hidden: torch.Tensor
    dtype: torch.dtype
    split_prefix: bool = False

    def params(self) -> dict[str, torch.Tensor] | None:
        """The block's parameters and buffers in ``dtype``, or None if already so.

        Copies one block at a time (call it per layer and drop the result).
        """
        named = list(self.block.named_parameters()) + list(self.block.named_buffers())
        if all(not t.is_floating_point() or t.dtype == self.dtype for _, t in named):
            return None
        return {n: t.detach().to(self.dtype) if t.is_floating_point() else t for n, t in named}

    def run(self, x: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Call the block on hidden states ``x [1, T', d]``; returns ``[1, T', d]``."""
        if self.args:
            args, kwargs = (x, *self.args[1:]), self.kwargs
        else:
            args, kwargs = (), {**self.kwargs, "hidden_states": x}
        if params is None:
            out = self.block(*args, **kwargs)
        else:
            out = torch.func.functional_call(self.block, params, args, kwargs, strict=False)
        return block_output_hidden(out)

    def last_token_map(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        """``f(x) = block(x)_n - x`` on the last token of each document, and ``x^{l-1}_n [B, d]``.

        Valid for calls recorded by :func:`record_last_token` (T' = 1); ``f``
        maps ``[B, d] -> [B, d]``, document b's output depending on row b only.
        """
        params = self.params()

        def f(x: torch.Tensor) -> torch.Tensor:
            return self.run(x[:, None, :], params)[:, 0] - x

        return f, self.hidden[:, -1]

    def position_map(
        self, t_in: int, t_out: int
    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        """``f(x) = block(X with row t_in = x)_{t_out} (- x if t_in == t_out)``, and ``x_{t_in}``.

        Valid for whole-sequence calls (``jacobian.sequence.record_sequences``, one
        document); ``f`` maps ``[1, d] -> [1, d]``.
        """
        params = self.params()
        X = self.hidden

        def f(x: torch.Tensor) -> torch.Tensor:
            rows = torch.cat([X[:, :t_in], x[:, None], X[:, t_in + 1 :]], dim=1)
            out = self.run(rows, params)[:, t_out]
            return out - x if t_in == t_out else out

        return f, X[:, t_in]


class _StopForward(Exception):
    """Raised by a recording hook to end a forward pass early."""


def _record(
    model: nn.Module, blocks: list[nn.Module], input_ids: torch.Tensor, **forward_kwargs
) -> list[tuple[tuple, dict]]:
    """Run the model once, recording each block's (args, kwargs); stop after the last block."""
    records: list[tuple[tuple, dict] | None] = [None] * len(blocks)

    def hook(index: int):
        def pre_hook(module, args, kwargs):
            records[index] = (args, dict(kwargs))
            if index == len(blocks) - 1:
                raise _StopForward

        return pre_hook

    handles = [b.register_forward_pre_hook(hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        model(input_ids, **forward_kwargs)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        raise LmCouplingError(
            f"the Jacobian engine expected the model's forward pass to call every decoder "
            f"block, but blocks {missing} were never called; check locate_model_parts()"
        )
    return records


def _block_call(block, record, dtype: torch.dtype, swap: Callable) -> BlockCall:
    """A BlockCall from a recorded (args, kwargs): floats cast, caches swapped, on its device."""
    param = next(block.parameters(), None)
    device = None if param is None or param.device.type == "meta" else param.device

    def convert(obj):
        if tfa.is_cache(obj):
            return swap(obj)
        if isinstance(obj, torch.Tensor):
            obj = obj.detach() if device is None else obj.detach().to(device)
            return obj.to(dtype) if obj.is_floating_point() else obj
        return obj

    args, kwargs = record
    args, kwargs = _map_tensors(args, convert), _map_tensors(kwargs, convert)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise LmCouplingError(
            "the Jacobian engine expected a decoder block's first argument (or its "
            f"hidden_states keyword) to be [B, T, d] hidden states, found {type(hidden).__name__}"
        )
    return BlockCall(block=block, args=args, kwargs=kwargs, hidden=hidden, dtype=dtype)


def _prefix_keys_values(cache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer index -> (K, V) of a transformers cache after the prefix run, in its dtype."""
    layers = tfa.cache_layers(cache)
    if layers is None:
        raise LmCouplingError(
            f"the Jacobian engine expected a transformers Cache with .layers after the prefix "
            f"run, found {type(cache).__name__}; run with transformers >= 5 or method on a "
            "prompt of one token"
        )
    pairs = {i: tfa.layer_keys_values(layer) for i, layer in enumerate(layers)}
    return {i: (kv[0].detach(), kv[1].detach()) for i, kv in pairs.items() if kv is not None}


def _prefix_cache(model: nn.Module, prompt: torch.Tensor) -> dict[int, tuple]:
    """Layer index -> (K, V) ``[1, H_kv, n, d_head]`` of one prompt's prefix, model dtype."""
    cache = tfa.output_cache(model(prompt[None, :-1], use_cache=True))
    if cache is None:
        raise LmCouplingError(
            f"the Jacobian engine expected {type(model).__name__} to return a cache with "
            "use_cache=True, found None"
        )
    return _prefix_keys_values(cache)


def _truncated_prefix(cache, length: int) -> tuple[dict[int, tuple] | None, str]:
    """``(prefix, "")``: the first ``length - 1`` rows of a prompt's cache, or ``(None, why)``.

    None where the cache is not one key/value row per position on every layer.
    """
    try:
        keys_values = _prefix_keys_values(cache)
    except LmCouplingError as error:
        return None, str(error)
    if not keys_values:
        return None, f"{type(cache).__name__} holds no keys"
    rows = {i: k.shape[-2] for i, (k, _) in keys_values.items() if k.shape[-2] != length}
    if rows:
        return None, f"layers {sorted(rows)} hold {sorted(set(rows.values()))} rows, not {length}"
    return {i: (k[..., :-1, :], v[..., :-1, :]) for i, (k, v) in keys_values.items()}, ""


def _refuse_state_layers(model: nn.Module) -> None:
    """Raise when the model's own cache has layers with a recurrent or convolution state."""
    layers = tfa.model_cache_layers(model)
    state = [i for i, lay in enumerate(layers) if tfa.layer_keeps_state(lay)]
    if state:
        raise UnsupportedModelError(
            f"the Jacobian engine cannot differentiate {type(model).__name__}: its cache "
            f"layers {state} keep a state-space, linear-attention or convolution state, and "
            "the engine freezes a prefix as keys and values only; the metrics that need no "
            "Jacobians can still run on it"
        )


@dataclass
class PromptPass:
    """What one plain forward pass per prompt gives the engine.

    Attributes:
        prefixes: per prompt, layer index -> (K, V) ``[1, H_kv, n, d_head]`` of
            positions < n in the model's dtype (None for a one-token prompt).
        outputs: per block, ``[B, d]`` its output at n in the model's dtype.
    """

    prefixes: list[dict[int, tuple] | None]
    outputs: list[torch.Tensor]


def run_prompts(
    model: nn.Module, parts: ModelParts, prompts: list[torch.Tensor], prefixes: bool = True
) -> PromptPass:
    """One plain forward pass per prompt: every block's output at n, and the prefix keys/values.

    Run *outside* :func:`engine_mode` (the function the benchmark ran), each
    prompt alone, in eval mode, stopped after the last block. The block
    outputs are the reference of the engine's run-time check. With
    ``prefixes`` (the cache replay) the pass also fills a cache, whose keys
    and values of positions < n the engine freezes (the prefix runs again
    alone where that cache is not one row per position).
    """
    if prefixes:
        _refuse_state_layers(model)
    outputs: list[list[torch.Tensor]] = [[] for _ in parts.blocks]

    def hook(index: int):
        def post_hook(module, args, output):
            outputs[index].append(block_output_hidden(output)[:, -1].detach())
            if index == len(parts.blocks) - 1:
                raise _StopForward

        return post_hook

    plain = {"use_cache": False} if accepts_argument(model, "use_cache") else {}
    keys_values: list[dict[int, tuple] | None] = []
    alone: list[tuple[int, str]] = []
    with eval_mode(model), torch.no_grad():
        handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(parts.blocks)]
        try:
            for index, prompt in enumerate(prompts):
                length = prompt.shape[0]
                # A cache of full layers keeps every key/value row, also on layers with a
                # sliding window (their mask, not the cache, limits what a query sees).
                cache = tfa.new_cache() if prefixes and length > 1 else None
                kwargs = (
                    plain
                    if cache is None
                    else {"use_cache": True, **tfa.cache_kwargs(model, cache)}
                )
                with contextlib.suppress(_StopForward):
                    model(prompt[None], **kwargs)
                prefix, why = (None, "") if cache is None else _truncated_prefix(cache, length)
                keys_values.append(prefix)
                if cache is not None and prefix is None:
                    alone.append((index, why))
        finally:
            for handle in handles:
                handle.remove()
        for index, why in alone:  # outside the hooks, which stop a pass at the last block
            warnings.warn(
                f"the Jacobian engine could not take prompt {index}'s prefix keys/values from "
                f"the cache of its whole forward pass ({why}); running its prefix alone, one "
                "extra forward pass",
                EngineFallbackWarning,
                stacklevel=2,
            )
            keys_values[index] = _prefix_cache(model, prompts[index])
    return PromptPass(keys_values, [torch.cat(rows) for rows in outputs])


def _padded_prefixes(prompts: list[torch.Tensor], per_doc: list[dict[int, tuple] | None]):
    """Each prompt's prefix keys/values (each run alone), left-padded with zeros to the longest.

    Returns:
        ``(layer -> (K [B, H, N, d_head], V), mask [B, N + 1] or None)``; the
        mask marks real tokens (prefix and last token).
    """
    lengths = [p.shape[0] - 1 for p in prompts]
    N, B = max(lengths), len(prompts)
    if N == 0:
        return {}, None
    template = next(kv for kv in per_doc if kv is not None)
    padded = {}
    for layer, (k0, v0) in template.items():
        K = k0.new_zeros(B, k0.shape[1], N, k0.shape[3])
        V = v0.new_zeros(B, v0.shape[1], N, v0.shape[3])
        for b, kv in enumerate(per_doc):
            if kv is not None:
                K[b, :, N - lengths[b] :] = kv[layer][0][0]
                V[b, :, N - lengths[b] :] = kv[layer][1][0]
        padded[layer] = (K, V)
    mask = torch.zeros(B, N + 1, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, N - n :] = 1
    return padded, None if bool(mask.all()) else mask


def record_last_token(
    model: nn.Module,
    parts: ModelParts,
    prompts: list[torch.Tensor],
    dtype: torch.dtype,
    prefixes: list[dict[int, tuple] | None],
    rows: torch.Tensor | None = None,
) -> list[BlockCall]:
    """Record every block's call on the last token n with the prefix keys/values frozen.

    Call inside :func:`engine_mode`. The prompts' prefix keys/values
    (:func:`run_prompts`) are left-padded into one batch (padded keys masked
    out, every prompt at its own positions); the last tokens run as one batch.

    Args:
        model: the causal LM.
        parts: its located parts.
        prompts: ``[T_b]`` token ids on the input device; n_b = T_b - 1.
        dtype: compute dtype.
        prefixes: ``PromptPass.prefixes`` of these prompts.
        rows: ``[R]`` token ids to run instead of the last token, after the
            prefix of one prompt (``prompts[0][:-1]``): position Jacobians.

    Returns:
        L block calls whose hidden states are ``[B, 1, d]`` (x^{l-1}_n), or
        ``[1, R, d]`` for ``rows``.
    """
    last = torch.stack([p[-1:] for p in prompts]) if rows is None else rows[None]
    padded, mask = _padded_prefixes(prompts, prefixes)
    kwargs: dict = {"use_cache": bool(padded)}
    if padded:
        cache = tfa.new_cache()
        for layer in sorted(padded):
            cache.update(*padded[layer], layer)
        kwargs.update(tfa.cache_kwargs(model, cache))
    if mask is not None:
        kwargs["attention_mask"] = mask.to(last.device)
        kwargs["position_ids"] = torch.tensor([[p.shape[0] - 1] for p in prompts]).to(last.device)
    records = _record(model, parts.blocks, last, **kwargs)
    frozen = FrozenPrefixCache(
        {i: (k.detach().to(dtype), v.detach().to(dtype)) for i, (k, v) in padded.items()}
    )
    calls = [
        _block_call(block, record, dtype, lambda _cache: frozen)
        for block, record in zip(parts.blocks, records, strict=True)
    ]
    if last.shape[1] == 1:  # one row: the split attention applies (SDPA models)
        probe_split(calls, frozen)
    return calls


def replay_errors(
    calls: list[BlockCall], expected: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document, the largest relative error of the replayed block calls at n, and its block.

    ``||block_l(x)_n - y_l|| / ||y_l||`` with ``y_l`` the model's own output of
    block l at n (``PromptPass.outputs``); non-finite errors count as inf.

    Returns:
        ``(worst [B] float64, block [B] int64)`` on the CPU.
    """
    n_docs = calls[0].hidden.shape[0]
    worst = torch.zeros(n_docs, dtype=torch.float64)
    block = torch.zeros(n_docs, dtype=torch.long)
    for index, (call, ref) in enumerate(zip(calls, expected, strict=True)):
        f, x = call.last_token_map()
        out = f(x) + x
        ref = ref.to(out.dtype)
        scale = torch.linalg.vector_norm(ref, dim=-1).clamp_min(torch.finfo(out.dtype).tiny)
        err = (torch.linalg.vector_norm(out - ref, dim=-1) / scale).double().cpu()
        err = torch.where(torch.isfinite(err), err, torch.inf)
        block = torch.where(err > worst, index, block)
        worst = torch.maximum(worst, err)
    return worst, block


def probe_split(calls: list[BlockCall], cache: FrozenPrefixCache) -> None:
    """Let ``cache`` hand its prefix to the split attention for the blocks where that is exact.

    Per block, one call with the concatenating cache and one with the split
    attention (``jacobian.frozen_attention``) on the recorded hidden states;
    the block's layers join ``cache.split`` only when the attention took the
    stashed prefix and the two outputs agree to ``sqrt(eps)`` (relative).
    """
    enabled: set[int] = set()
    for call in calls:
        f, x = call.last_token_map()
        cache.split, cache.touched = set(enabled), set()
        calls_before = STASH.calls
        reference = f(x)
        layers = set(cache.touched)
        if not layers or STASH.calls == calls_before:
            continue  # no cached attention, or one that is not ``split_sdpa``: concatenate
        cache.split = enabled | layers
        try:
            out = f(x)
        except StashMismatch:  # the cache's rows are not the attention's keys: concatenate
            STASH.take()
            continue
        taken = STASH.take() is None
        tol = torch.finfo(reference.dtype).eps ** 0.5
        err = torch.linalg.vector_norm(out - reference) / torch.linalg.vector_norm(reference)
        if taken and bool(err <= tol):
            enabled |= layers
            call.split_prefix = True
    cache.split, cache.touched = enabled, set()
