"""The Jacobian lens's fit terms under the run's estimator: the engine's products, the lens's math.

The reference estimator's terms are the engine's (`lm_coupling.jacobian.lens_fit`);
the last-position estimator multiplies the engine's dense block Jacobians into the
total Jacobians (`lm_coupling.metrics.jacobian_lens.jacobian_products`). Kept apart
from jacobian/, which knows no metric code (docs/design.md, the module map).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lm_coupling.errors import LmCouplingError
from lm_coupling.jacobian.lens_fit import (
    DEFAULT_DIM_BATCH,
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_SKIP_FIRST,
    ESTIMATORS,
    REFERENCE,
    reference_lens_rows,
)
from lm_coupling.metrics.jacobian_lens import jacobian_products


def lens_terms(
    runner: Any,
    prompts: Sequence[torch.Tensor],
    estimator: str = REFERENCE,
    skip_first: int = DEFAULT_SKIP_FIRST,
    max_len: int = DEFAULT_MAX_SEQ_LEN,
    dim_batch: int = DEFAULT_DIM_BATCH,
) -> list[torch.Tensor | None]:
    """Each prompt's term of the Jacobian-lens fit, under ``estimator``.

    ``reference`` (default): :func:`reference_lens_rows` with ``skip_first``,
    ``max_len`` and ``dim_batch``; ``last_position``: ``d x^L_n / d x^l_n`` at
    the target position n from the engine's dense block Jacobians
    (``metrics.jacobian_lens.jacobian_products``). The J-lens plugin names
    them from its options (``JacobianRequest.lens_terms``).

    Args:
        runner: the geometry runner (``model``, ``parts``, ``engine``).
        prompts: ``[T_b]`` token ids of each sampled document.
        estimator: one of ``lens_fit.ESTIMATORS``.
        skip_first: leading positions the reference estimator leaves out.
        max_len: tokens the reference estimator keeps from a prompt's start.
        dim_batch: cotangent directions per backward pass of the reference.

    Returns:
        Per prompt ``[L+1, d, d]`` on the CPU; None where the reference skips
        the prompt (too short); NaN where the engine could not reproduce the
        model's blocks (the document is then left out of the fit, counted).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"the estimator must be one of {ESTIMATORS}, found {estimator!r}")
    out: list[torch.Tensor | None] = []
    for ids in prompts:
        if estimator == REFERENCE:
            out.append(
                reference_lens_rows(
                    runner.model,
                    runner.parts,
                    ids,
                    skip_first_positions=skip_first,
                    max_seq_len=max_len,
                    dim_batch=dim_batch,
                )
            )
            continue
        try:
            blocks = runner.engine.dense_jacobians(ids)
        except LmCouplingError:
            L, d = runner.parts.n_layers, runner.parts.d_model
            out.append(torch.full((L + 1, d, d), math.nan))
            continue
        out.append(jacobian_products(blocks).cpu())
    return out
