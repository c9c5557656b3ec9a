"""Modules whose forward ``torch.func`` cannot transform, and exact stand-ins for the engine.

The engine's products are ``torch.func`` transforms (``jvp``, ``vjp``, ``vmap``)
of a block. A custom ``torch.autograd.Function`` without ``setup_context``
(old-style, ``forward(ctx, ...)``) cannot be transformed: torch raises
``RuntimeError("In order to use an autograd.Function with functorch
transforms ...")``. Bloom's MLP runs its GELU through one (``BloomGelu`` ->
``GeLUFunction``), with a hand-written backward for training; RecurrentGemma's
RG-LRU its square root (``SqrtBoundDerivative``, a clipped gradient).

Inside ``engine_mode`` only, on this model's instances only, such a module's
forward is replaced by a plain function computing the same forward
(``SUBSTITUTES``; the engine's run-time check verifies it). Where no
substitute exists, :func:`untransformable_modules` names the modules.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["SUBSTITUTES", "differentiable_substitutes", "untransformable_modules"]


def _bloom_gelu(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Bloom's tanh GELU, the forward of its ``GeLUFunction`` (Bloom's own function)."""
    from lm_coupling.model.transformers_adapter import bloom_gelu_forward

    return bloom_gelu_forward()


class _PlainSqrt:
    """Stands in for RecurrentGemma's ``SqrtBoundDerivative``: the same forward, ``sqrt``."""

    apply = staticmethod(torch.sqrt)


def _recurrent_gemma_rglru(module: nn.Module) -> Callable:
    """RecurrentGemma's RG-LRU, ``SqrtBoundDerivative`` (a clipped gradient) rebound to ``sqrt``."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as modeling

    forward = type(module).forward

    def run(*args, **kwargs):
        saved = modeling.SqrtBoundDerivative
        modeling.SqrtBoundDerivative = _PlainSqrt
        try:
            return forward(module, *args, **kwargs)
        finally:
            modeling.SqrtBoundDerivative = saved

    return run


SUBSTITUTES: dict[str, Callable[[nn.Module], Callable]] = {
    "transformers.models.bloom.modeling_bloom.BloomGelu": _bloom_gelu,
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRglru": (
        _recurrent_gemma_rglru
    ),
}
"""Qualified class name -> factory of a differentiable forward with the same output.

A substitute must compute exactly the module's forward (only its backward,
the one ``torch.func`` cannot use, may differ); the engine's replay check
compares every block's output with the model's own.
"""

TRANSFORM_ERROR = "autograd.Function with functorch transforms"
"""Part of torch's message for a custom Function that ``torch.func`` cannot transform."""

INPLACE_ERROR = "attempted to call in-place operation"
"""Part of torch's message for an in-place write, under ``torch.func``, into a tensor the
transformed function did not take as input: a module that clamps its own weights at every
call (transformers 4.56's Gemma-3n AltUp: ``weight.data.clamp_``, eval included)."""

_INPLACE_OP = re.compile(r"in-place operation \(([\w:.]+)\)")


def _transform_failure(error: RuntimeError) -> str | None:
    """What ``torch.func`` could not transform, from its error; None for any other error."""
    message = str(error)
    if TRANSFORM_ERROR in message:
        return "a custom autograd.Function"
    if INPLACE_ERROR in message:
        op = _INPLACE_OP.search(message)
        return f"an in-place {op.group(1) if op else 'operation'} on a tensor it was not given"
    return None


def _qualified(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


@contextlib.contextmanager
def differentiable_substitutes(model: nn.Module) -> Iterator[list[str]]:
    """Replace the forward of this model's modules listed in ``SUBSTITUTES`` for the duration.

    Only instance attributes of ``model``'s own modules are set (removed in
    ``finally``); classes and other models are not touched.

    Yields:
        The names of the substituted modules.
    """
    replaced: list[nn.Module] = []
    names: list[str] = []
    try:
        for name, module in model.named_modules():
            factory = SUBSTITUTES.get(_qualified(module))
            if factory is None or "forward" in module.__dict__:
                continue
            module.forward = factory(module)
            replaced.append(module)
            names.append(name)
        yield names
    finally:
        for module in replaced:
            del module.forward


def _innermost_failing(block: nn.Module, run: Callable[[], object]) -> tuple[str, str] | None:
    """``(innermost module running when torch.func failed, what failed)``, None if ``run`` ran."""
    stack: list[str] = []
    names = {m: name for name, m in block.named_modules()}

    def post(module, args, output) -> None:
        stack.pop()

    handles = [m.register_forward_pre_hook(lambda m, a: stack.append(names[m])) for m in names]
    handles += [m.register_forward_hook(post) for m in names]
    try:
        run()
    except RuntimeError as error:
        what = _transform_failure(error)
        if what is None:
            raise
        return stack[-1] if stack else "", what
    finally:
        for handle in handles:
            handle.remove()
    return None


def untransformable_modules(calls) -> list[str]:
    """Modules of the recorded blocks whose forward ``torch.func.jvp`` cannot go through.

    One JVP of one tangent per block on its recorded call (``BlockCall``,
    inside ``engine_mode``, after ``differentiable_substitutes``).

    Returns:
        ``"block i: <module path> (<class>): <what>"`` per failing block, what
        being a custom autograd.Function or an in-place write (empty when
        every block can be differentiated).
    """
    found = []
    for index, call in enumerate(calls):
        f, x = call.last_token_map()
        failure = _innermost_failing(call.block, lambda f=f, x=x: torch.func.jvp(f, (x,), (x,)))
        if failure is not None:
            name, what = failure
            module = call.block.get_submodule(name) if name else call.block
            found.append(f"block {index}: {name or '<block>'} ({_qualified(module)}): {what}")
    return found
