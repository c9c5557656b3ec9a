"""The engine's context: this model's attention, kernels and modules set for ``torch.func``.

``engine_mode`` switches one model, for its duration, to what the Jacobian
engine can differentiate while computing the function the benchmark ran:
eager attention as it is, SDPA through its math backend (as
``capture.frozen_attention.SPLIT_ATTENTION`` where the model looks its
attention up by name), other implementations to SDPA, exact stand-ins for
modules ``torch.func`` cannot transform (``capture.differentiable``), eval
mode and no parameter graphs. Everything is restored afterwards; nothing
outside the model (transformers' global entries, other models) changes.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from lm_coupling.capture import transformers_adapter as tfa
from lm_coupling.capture.differentiable import differentiable_substitutes
from lm_coupling.capture.frozen_attention import STASH, register_split_attention
from lm_coupling.errors import EngineFallbackWarning

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


def _dispatches_by_name(model: nn.Module) -> bool:
    """Whether the model's attention looks its function up by the config's name only.

    True when the modeling modules of its submodules use transformers'
    ``ALL_ATTENTION_FUNCTIONS`` and none compares ``_attn_implementation`` with
    ``"sdpa"``: then its SDPA attention can run as ``SPLIT_ATTENTION`` (the
    same function, taking a frozen prefix). A model with its own SDPA branch
    (Falcon) would take another path under another name, so it keeps ``"sdpa"``.
    """
    names = {type(m).__module__ for m in model.modules()}
    # transformers' modeling modules, and remote-code ones (``transformers_modules.*``).
    sources = [_module_source(n) for n in sorted(names) if n.startswith("transformers")]
    uses = any("ALL_ATTENTION_FUNCTIONS" in source for source in sources)
    return uses and not any(_OWN_SDPA_BRANCH.search(source) for source in sources)


def _engine_attention(current, forced: str | None, split: bool):
    """The attention implementation a config gets inside ``engine_mode`` (None: unchanged)."""
    target = forced if forced is not None else current
    if not isinstance(target, str):
        return forced
    if target not in FORWARD_AD_ATTENTION:
        target = "sdpa"
    if target == "sdpa" and split:
        return register_split_attention()
    return None if target == current else target


@contextlib.contextmanager
def engine_mode(model: nn.Module, attn_implementation: str | None = None) -> Iterator[None]:
    """The model's own attention with forward-mode AD, eval mode, no parameter graphs.

    The engine must differentiate the function the benchmark ran. Eager and
    SDPA attention are kept as they are; SDPA runs through its math backend
    (``torch.nn.attention.sdpa_kernel``), the one SDPA backend that supports
    forward-mode AD and ``vmap``, and computes the same function as the fused
    kernels. Any other implementation (flash, flex, paged) is switched to
    SDPA for the duration; the engine's run-time check (see
    ``JacobianEngine``) then tells whether that changed the function. Where
    the model looks its attention up by name, this model's SDPA runs as
    ``capture.frozen_attention.SPLIT_ATTENTION`` (transformers' SDPA, taking a
    frozen prefix without copying it); transformers' global entries and other
    models are not touched. Modules whose forward ``torch.func`` cannot
    transform get an exact differentiable stand-in on this model's instances
    (``capture.differentiable``: Bloom's GELU). Mixture-of-experts layers run
    their experts one by one (``"eager"``; the fused ``grouped_mm`` kernels
    have no forward-mode AD). Dropout is switched off (eval mode);
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
    training = {m: m.training for m in model.modules()}
    split = _dispatches_by_name(model)
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
        model.eval()
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), differentiable_substitutes(model):
            yield
    finally:
        for config, (value, experts) in zip(configs, saved, strict=True):
            tfa.set_attention_implementation(config, value)
            if experts is not None:
                tfa.set_experts_implementation(config, experts)
        for module, flag in training.items():
            module.training = flag
        STASH.take()
