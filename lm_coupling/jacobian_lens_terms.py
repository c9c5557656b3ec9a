"""The Jacobian lens's fit terms under the run's estimator: the engine's products, the lens's math.

The reference estimator's terms are the engine's (`lm_coupling.jacobian.lens_fit`);
the last-position estimator multiplies the engine's dense block Jacobians into the
total Jacobians (`lm_coupling.metrics.jacobian_lens.jacobian_products`). Kept apart
from jacobian/, which knows no metric code (docs/design.md, the module map).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
    runner: Any, prompts: Sequence[torch.Tensor], options: Mapping[str, Any]
) -> list[torch.Tensor | None]:
    """Each prompt's term of the Jacobian-lens fit, under the estimator ``options`` name.

    ``jlens_estimator=reference`` (default): :func:`reference_lens_rows` with
    ``jlens_skip_first``, ``jlens_max_len`` and ``jlens_dim_batch``;
    ``last_position``: ``d x^L_n / d x^l_n`` at the target position n from the
    engine's dense block Jacobians (``metrics.jacobian_lens.jacobian_products``).

    Args:
        runner: the geometry runner (``model``, ``parts``, ``engine``).
        prompts: ``[T_b]`` token ids of each sampled document.
        options: the run's options.

    Returns:
        Per prompt ``[L+1, d, d]`` on the CPU; None where the reference skips
        the prompt (too short); NaN where the engine could not reproduce the
        model's blocks (the document is then left out of the fit, counted).
    """
    estimator = options.get("jlens_estimator", REFERENCE)
    if estimator not in ESTIMATORS:
        raise ValueError(f"jlens_estimator must be one of {ESTIMATORS}, found {estimator!r}")
    out: list[torch.Tensor | None] = []
    for ids in prompts:
        if estimator == REFERENCE:
            out.append(
                reference_lens_rows(
                    runner.model,
                    runner.parts,
                    ids,
                    skip_first_positions=options.get("jlens_skip_first", DEFAULT_SKIP_FIRST),
                    max_seq_len=options.get("jlens_max_len", DEFAULT_MAX_SEQ_LEN),
                    dim_batch=options.get("jlens_dim_batch", DEFAULT_DIM_BATCH),
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
