"""Logit-lens quantities from per-layer logits at the target position.

The logits ``[B, L+1, V]`` are ``W_U N(x^l_n) + b`` for l = 0..L, computed by
capture/ with the model's own final norm N and unembedding, so that layer L
gives exactly the model's next-token distribution. Pitfall: applying the lens
without the final norm, or to Hugging Face's ``hidden_states[-1]`` (already
normed), gives a different, wrong last layer.

Each row's values are those of the row alone.
"""

from __future__ import annotations

import math

import torch

from lm_coupling.metrics import work_dtype

__all__ = ["fixation_depth", "lens_summary", "tv_to_target"]


def _summary_rows(
    logits: torch.Tensor, target: torch.Tensor, top1: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(H / ln V, P(target), argmax)`` of rows of logits ``z`` ``[n, V]``.

    With ``m = max_v z_v``, ``s = z - m``, ``e = exp(s)`` and ``Z = sum_v e_v``:
    ``P(v) = e_v / Z`` and ``H = -sum_v P(v) ln P(v) = ln Z - sum_v e_v s_v / Z``,
    a sum of two non-negative terms (no cancellation). One max (which also
    gives the argmax), one exp, one sum and one dot product per row, and two
    ``[n, V]`` temporaries.

    ``0 ln 0 = 0``: a ``-inf`` logit's ``s`` is raised to the lowest finite
    number, whose term ``0 * s`` is then 0. NaN logits, and rows entirely
    ``-inf``, give NaN. ``target`` is ``-1`` where a row has none (NaN
    probability).
    """
    top, arg = logits.max(dim=-1) if top1 else (logits.amax(dim=-1), None)
    shifted = logits - top[:, None]
    shifted.clamp_(min=torch.finfo(shifted.dtype).min)
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    entropy = (total.log() - torch.linalg.vecdot(exp, shifted) / total) / math.log(logits.shape[-1])
    picked = exp.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1) / total
    return entropy, torch.where(target >= 0, picked, math.nan), arg


def lens_summary(
    logits: torch.Tensor, target: torch.Tensor, *, check_target: bool = True, top1: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-layer lens entropy, target probability and top-1 token.

    ``P^l = softmax(logits[:, l])``; returns ``H(P^l) / ln V``,
    ``P^l(target)`` and ``argmax_v P^l(v)`` for l = 0..L.

    Reference: nostalgebraist, "interpreting GPT: the logit lens" (2020);
    Aubry et al., "Picking an LLM's Brain" (2024). docs/design.md,
    "Metric definitions".

    Args:
        logits: ``[B, L+1, V]`` lens logits at the target position n.
        target: ``[B]`` int64 gold token ids, ``-1`` where a document has none.
        check_target: check the ids against ``[-1, V)`` (a host-device sync);
            a caller streaming layer by layer checks once and passes False.
        top1: also the top-1 tokens (the indices of the rows' max, a little
            slower than the max alone); None in their place when False.

    Returns:
        ``(entropy [B, L+1], target_prob [B, L+1], top1 [B, L+1] int64 or None)``;
        entropy and target_prob in float32 (float64 if given float64).
        target_prob is NaN where target is -1; NaN logits give NaN values.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor of shape [B, L+1, V]")
    if logits.dim() != 3 or logits.shape[-1] < 2:
        raise ValueError(f"logits must have shape [B, L+1, V], V >= 2, found {tuple(logits.shape)}")
    batch, depth, vocab = logits.shape
    if target.shape != (batch,) or target.is_floating_point():
        raise ValueError(
            f"target must be an integer tensor of shape [B] = [{batch}], found "
            f"{target.dtype} {tuple(target.shape)}"
        )
    if check_target and bool(((target < -1) | (target >= vocab)).any()):
        raise ValueError(
            f"target ids must be -1 (none) or in [0, {vocab}), found {target.tolist()}"
        )
    rows = logits.reshape(batch * depth, vocab).to(work_dtype(logits))
    row_target = target.to(device=logits.device, dtype=torch.int64).repeat_interleave(depth)
    columns = _summary_rows(rows, row_target, top1)
    return tuple(None if column is None else column.view(batch, depth) for column in columns)


def tv_to_target(target_prob: torch.Tensor) -> torch.Tensor:
    """Normalized total variation between ``P^l`` and the one-hot of the target.

    ``TV(P, e_y) = (1/2) (1 - P(y) + sum_{v != y} P(v)) = 1 - P(y)``.

    Reference: docs/design.md, "Metric definitions" (``tv_to_target``).

    Args:
        target_prob: ``[...]`` ``P^l(target)``.

    Returns:
        ``[...]`` ``1 - target_prob``, NaN where target_prob is NaN.
    """
    return 1 - target_prob


def fixation_depth(top1: torch.Tensor) -> torch.Tensor:
    """Relative depth after which the lens's top-1 token no longer changes.

    ``l* / L`` with ``l* = min { l : top1[l'] = top1[L] for all l' in l..L }``:
    0 when the top-1 token is the same at every layer, 1 when it only settles
    at the last layer.

    Reference: Aubry et al., "Picking an LLM's Brain: Thought and Fixation in
    Hidden Representations" (2024), fixation; docs/design.md, "Metric definitions".

    Args:
        top1: ``[B, L+1]`` int64 top-1 token ids per layer l = 0..L.

    Returns:
        ``[B]`` float32 in [0, 1].
    """
    if top1.dim() != 2 or top1.shape[1] < 2:
        raise ValueError(f"top1 must have shape [B, L+1] with L >= 1, found {tuple(top1.shape)}")
    n_layers = top1.shape[1] - 1
    changed = top1 != top1[:, -1:]
    index = torch.arange(n_layers + 1, device=top1.device).expand_as(top1)
    last_changed = torch.where(changed, index, torch.full_like(index, -1)).amax(dim=1)
    return (last_changed + 1).to(torch.float32) / n_layers
