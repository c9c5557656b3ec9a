"""Block Jacobians on the coupling authors' route: the last block's includes the final norm.

Aubry et al. (ICLR 2025; released code sugolov/coupling, ``coupling/main.py``)
take the residual Jacobian of block l as ``d h_l[n] / d h_{l-1}[n] - I`` with
``h = output_hidden_states``, every other position fixed, at the last token n.
transformers ties ``h_L`` to the state **after** the final norm N, so for the
last block their Jacobian is

    J^L_authors = d N(x^L_n) / d x^{L-1}_n - I = D_N (I + J^L) - I,

``D_N = dN/dy`` at ``y = x^L_n`` (N acts on each position alone), and ``J^l``
(l < L) is this package's block Jacobian (docs/design.md: x^L before the
norm). :func:`authors_jacobians` forms them from the engine's exact dense
block Jacobians at n (``JacobianEngine.dense_jacobians``) and the norm's
Jacobian at ``x^L_n``; it builds no d x d Jacobian by d backward passes
through the whole sequence, as the authors' code does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lm_coupling.errors import LmCouplingError
from lm_coupling.jacobian.calls import run_prompts
from lm_coupling.model.architecture import work_dtype

__all__ = ["authors_jacobians", "final_norm_jacobian"]


def final_norm_jacobian(parts, y: torch.Tensor) -> torch.Tensor:
    """``dN(y)/dy`` ``[d, d]`` (rows: output coordinates) of the model's final norm at ``y [d]``.

    The identity for a model without a final norm. float32 (float64 stays).
    """
    dtype = work_dtype(y)
    if parts.final_norm is None:
        return torch.eye(y.shape[-1], dtype=dtype, device=y.device)
    norm = parts._norm_in(dtype)
    device = next((p.device for p in norm.parameters()), y.device)
    with torch.enable_grad():
        return torch.func.jacrev(lambda v: norm(v[None, None])[0, 0])(y.to(device, dtype)).detach()


def authors_jacobians(runner: Any, prompts: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per prompt, the L residual Jacobians at n of the authors' route ``[L, d, d]``, on the CPU.

    Reference: Aubry et al., ICLR 2025, released code (``coupling/main.py``:
    ``J - I`` of consecutive ``output_hidden_states`` at the last token).

    Args:
        runner: the geometry runner (``model``, ``parts``, ``engine``).
        prompts: ``[T_b]`` token ids of each sampled document.

    Returns:
        ``J^1 .. J^{L-1}`` as the engine gives them and ``D_N (I + J^L) - I``;
        None where the engine could not reproduce the model's blocks.
    """
    out: list[torch.Tensor | None] = []
    for ids in prompts:
        ids = torch.as_tensor(ids).reshape(-1).to(runner.parts.input_device)
        try:
            dense = runner.engine.dense_jacobians(ids)
        except LmCouplingError:
            out.append(None)
            continue
        y = run_prompts(runner.model, runner.parts, [ids], prefixes=False).outputs[-1][0]
        D = final_norm_jacobian(runner.parts, y).to(dense.device, dense.dtype)
        eye = torch.eye(dense.shape[-1], dtype=dense.dtype, device=dense.device)
        dense = dense.clone()
        dense[-1] = D @ (eye + dense[-1]) - eye
        out.append(dense.cpu())
    return out
