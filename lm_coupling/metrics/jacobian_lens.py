"""The Jacobian lens: a layer's state read through the average Jacobian from that layer to the last.

Gurnee et al., "Verbalizable Representations Form a Global Workspace in
Language Models" (2026) read the state ``h`` of layer l as

    lens_l(h) = W_U N(J_l h) + b,    J_l = E[ d x^L_n / d x^l_n ],

with N the model's own final norm and ``W_U``, ``b`` its unembedding (the same
read-out as the logit lens, ``lm_coupling.metrics.lens``), the expectation
over prompts at the measured token n (here the target position, the last
context token). ``J_L = I``, so the last layer's J-lens is exactly the model's
output distribution.

How ``J_l`` is found without one backward pass per output coordinate: n is the
last position, so by causality a change of ``x^l_n`` reaches no other
position, and ``x^m_n = x^{m-1}_n + f_m(x^{m-1}_{<=n})`` with the prefix fixed.
The total derivative is therefore the product of the blocks' full Jacobians

    d x^L_n / d x^l_n = (I + J^L) (I + J^{L-1}) ... (I + J^{l+1}),

``J^m`` the residual-branch block Jacobian at n with every other position held
fixed, which the Jacobian engine computes exactly on one query token
(docs/engine.md). :func:`jacobian_products` forms the L + 1 products of one
document with L matrix products; the fit is their mean over the fitted
documents (`lm_coupling.plugins.builtin.jacobian_lens`).
"""

from __future__ import annotations

import torch

from lm_coupling.metrics import work_dtype

__all__ = ["jacobian_products", "transport"]


def jacobian_products(block_jacobians: torch.Tensor) -> torch.Tensor:
    """Total Jacobians from every state to the last one, from the blocks' residual-branch Jacobians.

    ``J_L = I`` and ``J_l = J_{l+1} (I + J^{l+1})`` for l = L-1..0, so that
    ``J_l = (I + J^L) ... (I + J^{l+1}) = d x^L_n / d x^l_n`` at the last
    position n (exact there by causality; at an earlier position the product
    leaves out the paths through later positions).

    Reference: Gurnee et al. (2026), the Jacobian lens ``J_l``; the block
    Jacobian ``J^l`` of docs/design.md ("Metric definitions", coupling).

    Args:
        block_jacobians: ``[..., L, d, d]`` ``J^l`` for blocks l = 1..L
            (rows: output coordinates), as the engine returns them.

    Returns:
        ``[..., L+1, d, d]`` ``J_l`` for states l = 0..L, float32 (float64 for
        float64 input); a non-finite block Jacobian makes the products of
        every earlier state non-finite.
    """
    if not isinstance(block_jacobians, torch.Tensor) or not block_jacobians.is_floating_point():
        raise TypeError("block_jacobians must be a floating-point torch.Tensor [..., L, d, d]")
    shape = tuple(block_jacobians.shape)
    if block_jacobians.dim() < 3 or shape[-1] != shape[-2] or shape[-3] < 1:
        raise ValueError(f"block_jacobians must have shape [..., L, d, d], L >= 1, found {shape}")
    dtype = work_dtype(block_jacobians)
    blocks = block_jacobians.to(dtype)
    n_layers, d = blocks.shape[-3], blocks.shape[-1]
    eye = torch.eye(d, dtype=dtype, device=blocks.device)
    out = torch.empty(*blocks.shape[:-3], n_layers + 1, d, d, dtype=dtype, device=blocks.device)
    out[..., n_layers, :, :] = eye
    for layer in range(n_layers - 1, -1, -1):
        step = blocks[..., layer, :, :] + eye
        out[..., layer, :, :] = out[..., layer + 1, :, :] @ step
    return out


def transport(jacobians: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Map each state to the last layer's space: ``J_l x^l`` for l = 0..L.

    Args:
        jacobians: ``[L+1, d, d]`` the fitted ``J_l``.
        states: ``[B, L+1, d]`` the states ``x^l_n`` of B documents.

    Returns:
        ``[B, L+1, d]`` in the jacobians' dtype; the caller applies the
        model's final norm and unembedding (the lens read-out).
    """
    if jacobians.dim() != 3 or jacobians.shape[-1] != jacobians.shape[-2]:
        raise ValueError(f"jacobians must have shape [L+1, d, d], found {tuple(jacobians.shape)}")
    if states.dim() != 3 or tuple(states.shape[1:]) != tuple(jacobians.shape[:2]):
        raise ValueError(
            f"states must have shape [B, {jacobians.shape[0]}, {jacobians.shape[1]}] to match "
            f"jacobians {tuple(jacobians.shape)}, found {tuple(states.shape)}"
        )
    return torch.einsum("lij,blj->bli", jacobians, states.to(jacobians.dtype))
