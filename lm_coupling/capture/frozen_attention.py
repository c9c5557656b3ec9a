"""Attention of one new token over a frozen prefix, without concatenating keys under ``vmap``.

The engine's JVPs and VJPs run block l on the last token n with the prefix's
keys and values frozen (``jacobian_calls.FrozenPrefixCache``). A cache hands
the attention ``cat(K_prefix, k_n)``; under ``vmap`` over m tangents that
concatenation (and its tangent, zero on the prefix) is materialised m times,
``[m, H, n + 1, d_head]`` for keys and values alike, and dominates the cost
of a product (85% at GPT-2-small shape, 128 tokens).

Here the cache instead stashes the prefix and returns only the new token's
key and value; the SDPA attention function, wrapped for the engine's
duration, takes the stash and computes the same attention in two parts::

    s = [q K_prefix^T, q k_n^T] * scale + mask      (scores of the n + 1 keys)
    P = softmax(s)
    o = P[:, :n] V_prefix + P[:, n:] v_n

so the prefix enters only through products with an unbatched operand (one
GEMM per batch of tangents). This is SDPA's own definition (the math
backend's, up to round-off), for one query token, grouped-query heads, a
boolean or additive mask and any ``scaling``; any other case (no stash, more
than one query, dropout, a position bias, soft-capping) goes to the wrapped
function with the keys concatenated, i.e. exactly as before.

A model whose attention does not go through the global SDPA entry (eager
attention, a model-local override) never takes the stash: ``probe_split``
finds out per block, before any Jacobian work, and such blocks keep the
concatenating cache.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["STASH", "PrefixStash", "sdpa_split_installed", "split_attention", "wrapped_sdpa"]

Attention = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class PrefixStash(threading.local):
    """The prefix keys/values the cache hands to the next attention call (per thread)."""

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def put(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stash one layer's prefix ``[B, H_kv, n, d_head]`` for the next attention call."""
        self.pending = (keys, values)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stashed prefix (and clear it), or None."""
        pending, self.pending = self.pending, None
        return pending


STASH = PrefixStash()
"""The one stash shared by ``FrozenPrefixCache`` and the wrapped attention."""


def _prefix_matmul(a: torch.Tensor, b: torch.Tensor, per_head: bool | None = None) -> torch.Tensor:
    """``a @ b`` for ``a [B, H_kv, g, k]`` and a prefix operand ``b [B' in (1, B), H_kv, k, n]``.

    ``per_head`` (default: on a CPU) makes one 2-D matmul per (document,
    head): under ``vmap`` a matmul with an unbatched 2-D right operand folds
    the tangents into its rows, whereas a batched matmul first copies ``b``
    once per tangent (27x slower at GPT-2-small shape on a CPU). On a GPU
    that copy is cheap and one batched matmul saves B x H_kv kernel launches.
    """
    if per_head is None:
        per_head = a.device.type == "cpu"
    if not per_head:
        return a @ b
    shared = b.shape[0] == 1

    def head(i: int, h: int) -> torch.Tensor:
        return (a[:, h] if shared else a[i, h]) @ b[i, h]

    rows = [torch.stack([head(i, h) for h in range(b.shape[1])], -3) for i in range(b.shape[0])]
    return rows[0] if shared else torch.stack(rows)


def split_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    per_head: bool | None = None,
) -> torch.Tensor:
    """Softmax attention of one query over ``[prefix, new]`` keys, without concatenating them.

    Args:
        query: ``[B, H, 1, d_head]``.
        key: ``[B, H_kv, 1, d_head]`` of the new token (H divisible by H_kv).
        value: ``[B, H_kv, 1, d_head]`` of the new token.
        prefix_keys: ``[B', H_kv, n, d_head]`` (B' = B or 1).
        prefix_values: ``[B', H_kv, n, d_head]``.
        mask: None, or boolean (True: attend) or additive ``[B'', 1 or H, 1, n + 1]``.
        scaling: score scale (None: ``d_head ** -0.5``).
        per_head: products with the prefix head by head (default: on a CPU;
            see ``_prefix_matmul``).

    Returns:
        ``[B, 1, H, d_head]`` (SDPA's output after transformers' transpose).
    """
    B, H, _, dh = query.shape
    groups = H // key.shape[1]
    scale = dh**-0.5 if scaling is None else scaling
    q = query.reshape(B, key.shape[1], groups, dh)  # one query: heads grouped per kv head
    prefix_scores = _prefix_matmul(q, prefix_keys.transpose(-1, -2), per_head)
    scores = torch.cat([prefix_scores, q @ key.transpose(-1, -2)], dim=-1) * scale
    if mask is not None:
        mask = mask.reshape(mask.shape[0], -1, 1, mask.shape[-1])
        if mask.shape[1] == H:
            mask = mask.reshape(mask.shape[0], key.shape[1], groups, mask.shape[-1])
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1)
    n = prefix_keys.shape[-2]
    out = _prefix_matmul(probs[..., :n], prefix_values, per_head) + probs[..., n:] @ value
    return out.reshape(B, H, 1, dh).transpose(1, 2)


def _split_ok(query, key, attention_mask, dropout, kwargs) -> bool:
    """Whether ``split_attention`` computes what the wrapped SDPA function would."""
    if query.shape[2] != 1 or key.shape[2] != 1 or dropout:
        return False
    if query.shape[1] % key.shape[1]:
        return False
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    if kwargs.get("cache") is not None or kwargs.get("s_aux") is not None:
        return False
    return attention_mask is None or attention_mask.dim() == 4


def wrapped_sdpa(original: Attention) -> Attention:
    """``original`` (transformers' SDPA attention), taking a stashed frozen prefix if any."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        pending = STASH.take()
        if pending is None:
            return original(module, query, key, value, attention_mask, dropout, scaling, **kw)
        prefix_keys, prefix_values = pending
        if not _split_ok(query, key, attention_mask, dropout, kw):
            batch = key.shape[0]
            key = torch.cat([prefix_keys.expand(batch, *prefix_keys.shape[1:]), key], dim=-2)
            value = torch.cat([prefix_values.expand(batch, *prefix_values.shape[1:]), value], -2)
            return original(module, query, key, value, attention_mask, dropout, scaling, **kw)
        out = split_attention(
            query, key, value, prefix_keys, prefix_values, attention_mask, scaling
        )
        return out.contiguous(), None

    attention.__wrapped__ = original
    return attention


@contextlib.contextmanager
def sdpa_split_installed() -> Iterator[None]:
    """Wrap transformers' global ``"sdpa"`` attention entry for the duration (restored after).

    Without a stashed prefix the wrapper calls the original function with the
    same arguments, so every other SDPA call is unchanged.
    """
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    original = mapping.get("sdpa")
    if original is None or getattr(original, "__wrapped__", None) is not None:
        yield  # no SDPA entry, or already wrapped by an enclosing engine_mode
        return
    mapping["sdpa"] = wrapped_sdpa(original)
    try:
        yield
    finally:
        mapping["sdpa"] = original
        STASH.take()
