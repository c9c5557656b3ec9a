"""Attention probabilities of every block, where the attention implementation gives them.

Hugging Face attention modules return ``(attn_output, attn_weights)``; the
weights are the probabilities ``softmax(QK^T/sqrt(d_h) + mask)`` ``[B, H, T, T]``
under the ``eager`` implementation and None under ``sdpa`` or
``flash_attention_2`` (fused kernels never form them). Capture takes them
with a forward hook on each block's attention module, the shallowest
submodule of the block whose class name ends in ``Attention``.
"""

from __future__ import annotations

from torch import nn

from lm_coupling.errors import ConfigurationError, UnsupportedModelError
from lm_coupling.model import transformers_adapter as adapter
from lm_coupling.model.block_calls import is_unrolled

__all__ = ["EAGER_FIX", "attention_implementation", "attention_modules", "check_attentions"]

EAGER_FIX = (
    "load the model with eager attention: --model_args ...,attn_implementation=eager "
    "(Python: model_args={..., 'attn_implementation': 'eager'}, or "
    "from_pretrained(..., attn_implementation='eager'))"
)


def attention_implementation(model: nn.Module) -> str | None:
    """The attention implementation the model's config names (None: not recorded)."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for holder in (text, config):
        value = adapter.attention_implementation(holder)
        if value:
            return str(value)
    return None


def check_attentions(model: nn.Module, wanted_by: str) -> None:
    """Refuse, before any forward pass, a model whose attention gives no probabilities.

    Args:
        model: the measured model.
        wanted_by: who reads them, for the message (``"metric 'x' (plugin 'y')"``).

    Raises:
        ConfigurationError: the attention implementation is not ``eager``.
    """
    implementation = attention_implementation(model)
    if implementation != "eager":
        raise ConfigurationError(
            f"{wanted_by} reads attention probabilities, but the model runs "
            f"attn_implementation={implementation!r}, which does not form them; {EAGER_FIX}"
        )


def attention_modules(blocks: list[nn.Module]) -> list[nn.Module]:
    """Each block's attention module (the shallowest submodule named ``*Attention``).

    Raises:
        UnsupportedModelError: a block has no such submodule.
    """
    if is_unrolled(blocks):
        raise UnsupportedModelError(
            "the model's blocks run more than once per forward pass (looped depth): the "
            "attention probabilities of each call are not taken; metrics that read "
            "attentions do not support this model (the trajectory and Jacobian metrics do)"
        )
    found = []
    for index, block in enumerate(blocks, start=1):
        candidates = [
            (name.count("."), name, module)
            for name, module in block.named_modules()
            if name and type(module).__name__.lower().endswith("attention")
        ]
        if not candidates:
            raise UnsupportedModelError(
                f"block {index} ({type(block).__name__}) has no submodule whose class name ends "
                "in 'Attention', so its attention probabilities cannot be taken; metrics that "
                "read attentions do not support this model"
            )
        found.append(min(candidates, key=lambda c: (c[0], c[1]))[2])
    return found
