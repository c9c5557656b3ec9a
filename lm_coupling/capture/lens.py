"""The built-in lens: the logit lens, ``P^l = softmax(W_U N(x^l) + b)``.

A lens maps a state ``x^l_n`` (before the final norm) to next-token logits
(`lm_coupling.states.Lens`). The logit lens applies the model's own final norm
N and unembedding, so that the lens of ``x^L`` is exactly the model's output
(docs/design.md, "Metric definitions"). A plugin supplies another lens (tuned,
Jacobian) through the hook ``lmc_lens``; capture serves whichever lens the run
uses, and the lens metrics read its logits.

Reference: nostalgebraist, "interpreting GPT: the logit lens" (2020).
"""

from __future__ import annotations

import torch

from lm_coupling.capture.architecture import ModelParts

__all__ = ["LogitLens"]


class LogitLens:
    """``logits(l, x) = W_U N(x) + b`` with the model's final norm N, for every layer l.

    Args:
        parts: the model's located parts (final norm and unembedding).
    """

    name = "logit"

    def __init__(self, parts: ModelParts):
        self.parts = parts

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits of ``hidden [B, d]`` (float32, float64 for float64 input)."""
        return self.logits_of_normed(self.parts.final_norm_fp32(hidden))

    def logits_of_normed(self, normed: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits ``W_U y + b`` of states already normed, ``y = N(x)``."""
        return self.parts.unembed_fp32(normed)
