"""Lenses as objects: a transform of the state, then one read-out shared by every lens.

A lens maps a state ``x^l_n`` (before the final norm) to next-token logits
(`lm_coupling.states.Lens`). As tuned-lens's ``Lens``, a `TransformLens` is
its own ``transform(l, x)`` (the identity for the logit lens, ``J_l x`` for
the Jacobian lens) then the model's shared read-out ``W_U N(.) + b``, which
capture applies once per batch to every state's transformed rows (`read_all`).

A lens that only has ``logits(layer, hidden)`` (the protocol) is called
once per state; so is a `TransformLens` subclass that overrides ``logits``.

Reference: nostalgebraist, "interpreting GPT: the logit lens" (2020);
Belrose et al., "Eliciting Latent Predictions from Transformers with the
Tuned Lens" (2023), the ``Lens``/``Unembed`` split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lm_coupling.model.architecture import ModelParts

__all__ = ["JacobianLens", "LogitLens", "TransformLens", "read_all", "read_out", "shared_transform"]


def read_out(parts: ModelParts, states: torch.Tensor) -> torch.Tensor:
    """The shared read-out ``W_U N(x) + b`` of states ``[N, d]``: ``[N, V]`` (float32)."""
    return parts.unembed_fp32(parts.final_norm_fp32(states))


class TransformLens:
    """A lens as an object: ``logits(l, x) = read_out(transform(l, x))``.

    Subclasses override `transform` (and set `name`); the read-out (the
    model's final norm and unembedding) is shared, so capture can read every
    state of a batch in one call.

    Args:
        parts: the model's located parts (final norm and unembedding).
    """

    name = "transform"

    def __init__(self, parts: ModelParts):
        self.parts = parts

    def transform(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The state ``x^layer_n`` ``[B, d]`` as the read-out takes it (here: itself)."""
        return hidden

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits of ``hidden [B, d]`` (float32, float64 for float64 input)."""
        return read_out(self.parts, self.transform(layer, hidden))


class LogitLens(TransformLens):
    """The logit lens, ``P^l = softmax(W_U N(x^l) + b)``: the identity transform.

    The lens of ``x^L`` is exactly the model's output (docs/design.md,
    "Metric definitions").
    """

    name = "logit"


class JacobianLens(TransformLens):
    """The Jacobian lens, ``W_U N(J_l x) + b`` (Gurnee et al. 2026): ``transform = J_l x``.

    A state without a transport (NaN ``J_l``) reads as NaN.

    Args:
        jacobians: ``[L+1, d, d]`` the fitted ``J_l`` (rows: output coordinates).
        parts: the model's located parts.
    """

    name = "jacobian"

    def __init__(self, jacobians: torch.Tensor, parts: ModelParts):
        super().__init__(parts)
        self.jacobians = jacobians

    def transform(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``J_layer x`` of ``hidden [B, d]``, float32 (float64 stays)."""
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        return hidden.to(dtype) @ self.jacobians[layer].to(device=hidden.device, dtype=dtype).T


def shared_transform(lens: Any):
    """The lens's ``transform`` when its logits are the shared read-out of it, else None."""
    transform = getattr(lens, "transform", None)
    if transform is None or getattr(type(lens), "logits", None) is not TransformLens.logits:
        return None
    return transform


def read_all(lens: Any, parts: ModelParts, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The lens logits ``[B, L+1, V]`` of every state's rows at n (``rows[l]``: ``[B, d]``).

    One read-out call on the stacked transformed rows ``[(L+1) B, d]`` (the
    norm and unembedding act row by row, so each state's logits equal the
    lens's ``logits``); a lens without a shared read-out is called once per state.
    """
    transform = shared_transform(lens)
    if transform is None:
        return torch.stack([lens.logits(i, x) for i, x in enumerate(rows)], dim=1)
    moved = [transform(i, x) for i, x in enumerate(rows)]
    depth, (batch, width) = len(moved), moved[0].shape
    flat = torch.stack(moved, dim=1).reshape(batch * depth, width)
    return read_out(parts, flat).reshape(batch, depth, -1)
