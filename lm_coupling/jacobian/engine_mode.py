"""The engine's context: this model's attention, kernels and modules set for ``torch.func``.

``engine_mode`` switches one model, for its duration, to what the Jacobian
engine can differentiate while computing the function the benchmark ran:
eager attention as it is, SDPA through its math backend (as
``jacobian.frozen_attention.SPLIT_ATTENTION`` where the model looks its
attention up by name), other implementations to SDPA, exact stand-ins for
modules ``torch.func`` cannot transform (``model.differentiable``), eval
mode and no parameter graphs. Everything is restored afterwards; nothing
outside the model (transformers' global entries, other models) changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lm_coupling.jacobian.frozen_attention import SPLIT_ATTENTION, STASH, split_sdpa
from lm_coupling.model import transformers_adapter as tfa
from lm_coupling.model.block_calls import eval_mode
from lm_coupling.model.differentiable import differentiable_substitutes

__all__ = ["FORWARD_AD_ATTENTION", "engine_mode"]


def _configs(model: nn.Module) -> list:
    """Every distinct config object of the model, its modules and their sub-configs."""
    found: dict[int, object] = {}
    pending = [getattr(model, "config", None)]
    pending += [getattr(m, "config", None) for m in model.modules()]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "sub_configs"):
            continue
        found[id(config)] = config
        pending += [getattr(config, key, None) for key in config.sub_configs]
    return list(found.values())


FORWARD_AD_ATTENTION = ("eager", "sdpa")
"""Attention implementations differentiated as they are (SDPA through its math backend)."""


def _engine_attention(current, forced: str | None, split: bool):
    """The attention implementation a config gets inside ``engine_mode`` (None: unchanged)."""
    target = forced if forced is not None else current
    if not isinstance(target, str):
        return forced
    if target not in FORWARD_AD_ATTENTION:
        target = "sdpa"
    if target == "sdpa" and split:  # a name of its own: no global entry changes
        tfa.register_attention(SPLIT_ATTENTION, split_sdpa)
        return SPLIT_ATTENTION
    return None if target == current else target


@contextlib.contextmanager
def engine_mode(model: nn.Module, attn_implementation: str | None = None) -> Iterator[None]:
    """The model's own attention with forward-mode AD, eval mode, no parameter graphs.

    SDPA runs through its math backend (``sdpa_kernel``), the one SDPA backend
    with forward-mode AD and ``vmap``, the same function as the fused kernels;
    other implementations (flash, flex, paged) are switched to SDPA, and the
    engine's run-time check tells whether that changed the function.
    Mixture-of-experts layers run their experts one by one (``"eager"``).
    ``torch.no_grad`` stops graphs through the parameters (``torch.func``
    transforms still differentiate with respect to their inputs). Everything
    is restored in ``finally``.

    Args:
        model: the causal LM.
        attn_implementation: force this implementation instead (tests and
            diagnostics; e.g. ``"eager"``).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    configs = _configs(model)
    saved = [tfa.saved_implementations(c) for c in configs]
    split = tfa.attention_dispatched_by_name(model)
    try:
        for config in configs:
            current = tfa.attention_implementation(config)
            target = _engine_attention(current, attn_implementation, split)
            if target is not None:
                tfa.set_attention_implementation(config, target)
            experts = tfa.experts_implementation(config)
            if isinstance(experts, str) and experts != "eager":
                # grouped_mm and the other fused expert kernels have no forward-mode AD;
                # the per-expert loop computes the same function (the run-time check verifies).
                tfa.set_experts_implementation(config, "eager")
        with eval_mode(model), torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            with differentiable_substitutes(model):
                yield
    finally:
        for config, (value, experts) in zip(configs, saved, strict=True):
            tfa.set_attention_implementation(config, value)
            if experts is not None:
                tfa.set_experts_implementation(config, experts)
        STASH.take()
