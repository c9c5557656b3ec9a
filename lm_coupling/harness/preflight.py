"""Checks that stop a run early when the model cannot give the selected geometry.

The model's own checks (`lm_coupling.model.checks`) applied to the run's
selection, with the Jacobian engine's, at model load (`check_model`) and on
the first captured batch (`check_first_batch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lm_coupling.errors import UnsupportedModelError
from lm_coupling.jacobian.calls import (
    compute_dtype,
    engine_mode,
    record_last_token,
    run_prompts,
)
from lm_coupling.jacobian.sequence import SEQUENCE, choose_replay, record_sequences
from lm_coupling.model.architecture import ModelParts
from lm_coupling.model.checks import (
    PROBE_TOKENS,
    ModelProbe,
    check_causal_decoder,
    module_path,
    readout_problems,
)
from lm_coupling.model.differentiable import untransformable_modules
from lm_coupling.plugins.manager import get_registry
from lm_coupling.selection import Selection
from lm_coupling.states import ENGINE_NEEDS

FIRST_BATCH_TOKENS = 64
"""At most this many trailing tokens of the first document are used by `check_first_batch`."""


def _runnable(exclude: frozenset[str]) -> list[str]:
    """Registered metrics that need none of ``exclude``."""
    return [n for n, spec in get_registry().metrics.items() if not (spec.needs & exclude)]


def check_model(model: nn.Module, parts: ModelParts, selection: Selection) -> ModelProbe:
    """Stop before any request when the model cannot give the selected metrics.

    Raises:
        UnsupportedModelError: the model is not causal or its blocks pass
            more than one residual stream (no metric is defined). The message
            names the model and what was found.
    """
    probe = check_causal_decoder(model, parts)
    if selection.needs & ENGINE_NEEDS:  # how the Jacobian engine will replay the blocks
        probe = dataclasses.replace(probe, replay=choose_replay(model))
    return probe


# -- first captured batch -------------------------------------------------------------------------


def check_readout(
    model: nn.Module, parts: ModelParts, input_ids: torch.Tensor, selection: Selection
) -> None:
    """Raise when the lens read-out or block composition is not the model's own function.

    Raises:
        UnsupportedModelError: names the architecture, what differs, what was
            located, and the ``register_override`` call to add.
    """
    needs = selection.needs
    composition = bool(needs & ENGINE_NEEDS)
    if not composition and "lens" not in needs:
        return
    problems = readout_problems(model, parts, input_ids, composition)
    if "lens" not in needs:
        problems = [p for p in problems if not p.startswith("unembed(")]
    if not problems:
        return
    others = _runnable(ENGINE_NEEDS | {"lens"})
    raise UnsupportedModelError(
        f"lm-coupling's view of {type(model).__name__} (model_type={parts.model_type!r}) is "
        f"not the model's own function: {'; '.join(problems)}. Located: final norm "
        f"{module_path(model, parts.final_norm)}, logit scale {parts.logit_scale}, soft-cap "
        f"{parts.logit_softcap}, {parts.n_layers} blocks. The model applies something the "
        "locator missed (a logit scale, soft-capping, a final norm or projection); tell "
        "lm-coupling before the run, e.g. lm_coupling.model.architecture.register_override("
        f"{parts.model_type!r}, blocks='model.layers', final_norm='model.norm', "
        "unembed='lm_head', logit_scale=..., logit_softcap=...) with your model's paths and "
        "values, rather than measuring the lens of a different function. Metrics that read "
        f"neither the lens nor the Jacobians can still run: {', '.join(others)}"
    )


def check_differentiable(
    model: nn.Module, parts: ModelParts, input_ids: torch.Tensor, selection: Selection
) -> None:
    """Raise when a Jacobian metric is selected and ``torch.func`` cannot go through a block.

    One JVP per block on the engine's recorded calls of ``input_ids``, exact
    stand-ins substituted first, as the engine does (``model.differentiable``).

    Raises:
        UnsupportedModelError: names the modules, and the metrics that can still run.
    """
    if not selection.needs & ENGINE_NEEDS or input_ids.shape[0] < 1:
        return
    ids = input_ids.to(parts.input_device)
    dtype = compute_dtype(parts)
    sequence = choose_replay(model)[0] == SEQUENCE
    prefixes = None if sequence else run_prompts(model, parts, [ids]).prefixes
    with engine_mode(model):
        if sequence:
            calls = record_sequences(model, parts, [ids], dtype)
        else:
            calls = record_last_token(model, parts, [ids], dtype, prefixes)
        failing = untransformable_modules(calls)
    if failing:
        others = _runnable(ENGINE_NEEDS)
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type={parts.model_type!r}) runs an operation "
            "that torch.func (the Jacobian engine's jvp/vjp/vmap) cannot transform (a custom "
            "torch.autograd.Function, or an in-place write to a tensor such as its own "
            f"weights), in {'; '.join(failing)}, and lm-coupling has no exact "
            "differentiable stand-in for it (lm_coupling.model.differentiable.SUBSTITUTES: "
            "add one computing the same forward; for an in-place write, a transformers "
            "release whose model does not write its weights in eval mode). Metrics that do "
            f"not need Jacobians and can still run: {', '.join(others)}"
        )


def check_first_batch(lm: Any, session: Any, keys: Sequence[tuple]) -> None:
    """Run `check_readout` and `check_differentiable` once per run, on the first document.

    The lens read-out ``unembed(final_norm(x^L))`` must reproduce the model's
    own logits; with a Jacobian metric selected the located blocks must
    compose to the model's output and ``torch.func`` must go through every
    block (one JVP each).

    Args:
        lm: the `CouplingHFLM` (``tok_encode``, ``model``).
        session: the geometry session (``runner``, ``selection``).
        keys: the batch's document keys ``(context, continuation)``.
    """
    runner = session.runner
    if runner is None or session.first_batch_checked:
        return
    session.first_batch_checked = True
    context = next((k[0] for k in keys if k and isinstance(k[0], str) and k[0]), "")
    tokens = list(lm.tok_encode(context))[-FIRST_BATCH_TOKENS:] if context else []
    if not tokens:
        tokens = list(range(1, min(PROBE_TOKENS, runner.parts.vocab_size - 1) + 1))
    check_readout(lm.model, runner.parts, torch.tensor(tokens), session.selection)
    check_differentiable(lm.model, runner.parts, torch.tensor(tokens), session.selection)
