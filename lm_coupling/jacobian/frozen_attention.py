"""Attention of one new token over a frozen prefix, without concatenating keys under ``vmap``.

The engine's JVPs and VJPs run block l on the last token n with the prefix's
keys and values frozen (``jacobian_calls.FrozenPrefixCache``). A cache hands
the attention ``cat(K_prefix, k_n)``; under ``vmap`` over m tangents that
concatenation (and its tangent, zero on the prefix) is materialised m times,
``[m, H, n + 1, d_head]`` for keys and values alike, and dominates the cost
of a product (85% at GPT-2-small shape, 128 tokens).

Here the cache instead stashes the prefix and returns only the new token's
key and value; the engine's own attention function takes the stash and
computes the same attention in two parts::

    s = [q K_prefix^T, q k_n^T] * scale + mask      (scores of the n + 1 keys)
    P = softmax(s)
    o = P[:, :n] V_prefix + P[:, n:] v_n

so the prefix enters only through products with an unbatched operand (one
GEMM per batch of tangents). This is SDPA's own definition (the math
backend's, up to round-off), for one query token, grouped-query heads, a
boolean or additive mask and any ``scaling``; any other case (no stash, more
than one query, dropout, a position bias, soft-capping, attention sinks)
goes to transformers' SDPA function with the keys concatenated, i.e. exactly
as without the engine.

The function is registered with transformers under a name of its own,
``SPLIT_ATTENTION`` (``AttentionInterface``, and SDPA's mask builder under the
same name in ``AttentionMaskInterface``, since transformers picks mask
builders by attention name). ``engine_mode`` switches only the engine's
model to it, for its duration: transformers' global ``"sdpa"`` entry, and any
other model in the process, are never touched. A model whose attention does
not look its function up by name (eager attention, a model with its own
SDPA branch) never takes the stash: ``probe_split`` finds out per block,
before any Jacobian work, and such blocks keep the concatenating cache.
"""

from __future__ import annotations

import threading

import torch

from lm_coupling.errors import LmCouplingError

__all__ = [
    "SPLIT_ATTENTION",
    "STASH",
    "PrefixStash",
    "StashMismatch",
    "split_attention",
    "split_sdpa",
]


class PrefixStash(threading.local):
    """The prefix keys/values the cache hands to the next attention call (per thread)."""

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.calls = 0
        """Calls of ``split_sdpa`` so far (``probe_split`` reads whether a block made one)."""

    def put(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stash one layer's prefix ``[B, H_kv, n, d_head]`` for the next attention call."""
        self.pending = (keys, values)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stashed prefix (and clear it), or None."""
        pending, self.pending = self.pending, None
        return pending


STASH = PrefixStash()
"""The one stash shared by ``FrozenPrefixCache`` and ``split_sdpa``."""


def _prefix_matmul(a: torch.Tensor, b: torch.Tensor, per_head: bool | None = None) -> torch.Tensor:
    """``a @ b`` for ``a [B, H_kv, g, k]`` and a prefix operand ``b [B' in (1, B), H_kv, k, n]``.

    ``per_head`` (default: on a CPU) makes one 2-D matmul per (document, head):
    a batched matmul under ``vmap`` copies ``b`` per tangent (27x slower on a CPU).
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


class StashMismatch(LmCouplingError):
    """The stashed prefix is not keys/values of the attention that took it (``probe_split``)."""


def _fits(prefix: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether a prefix ``[B', H_kv, n, d]`` can precede new rows ``[B, H_kv, 1, d]``."""
    return (
        prefix.dim() == new.dim() == 4
        and prefix.shape[0] in (1, new.shape[0])
        and prefix.shape[1] == new.shape[1]
        and prefix.shape[3] == new.shape[3]
    )


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


SPLIT_ATTENTION = "lm_coupling_split"
"""The name ``split_sdpa`` is registered under in transformers' attention and mask interfaces."""


def split_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Transformers' SDPA attention, taking a stashed frozen prefix if there is one.

    Same signature and return value as ``transformers.integrations.sdpa_attention``'s
    ``sdpa_attention_forward`` (looked up as the global ``"sdpa"`` entry at each
    call); without a stashed prefix it is that function, with the same arguments.
    """
    from lm_coupling.model.transformers_adapter import global_attention

    STASH.calls += 1
    sdpa = global_attention("sdpa")
    pending = STASH.take()
    if pending is None:
        return sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    prefix_keys, prefix_values = pending
    if not _fits(prefix_keys, key) or not _fits(prefix_values, value):
        raise StashMismatch(
            f"the cached prefix {tuple(prefix_keys.shape)}/{tuple(prefix_values.shape)} is not "
            f"this attention's keys/values {tuple(key.shape)}/{tuple(value.shape)} (the cache "
            "holds something the attention expands, such as DeepSeek's latents)"
        )
    if not _split_ok(query, key, attention_mask, dropout, kwargs):
        batch = key.shape[0]
        key = torch.cat([prefix_keys.expand(batch, *prefix_keys.shape[1:]), key], dim=-2)
        value = torch.cat([prefix_values.expand(batch, *prefix_values.shape[1:]), value], -2)
        return sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = split_attention(query, key, value, prefix_keys, prefix_values, attention_mask, scaling)
    return out.contiguous(), None
