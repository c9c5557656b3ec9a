"""Restarted block Krylov (block Lanczos) top-K SVD of batched block maps, matrix-free.

Subspace iteration converges like ``(s_{p+1} / s_i)^2`` per step, which is
slow on the flat spectra of wide models; a block Krylov space of ``J^T J``
converges like ``exp(-2 t sqrt(gap))`` (Musco and Musco, "Randomized block
Krylov methods for stronger and faster approximate singular value
decomposition", NeurIPS 2015). This module keeps the whole Krylov basis W,
``JW = J W`` and ``Z = J^T J W`` (one JVP and one VJP batch of p vectors per
step), so the Rayleigh-Ritz step and the residuals cost no further products;
when the basis reaches ``MAX_BASIS`` columns it restarts from the top p Ritz
vectors (again without products: ``W C``, ``JW C``, ``Z C``).
"""

from __future__ import annotations

import torch

from lm_coupling.jacobian.linalg import (
    PRODUCTS,
    Clock,
    Map,
    StopTest,
    TopK,
    _orthonormal,
    jvp_columns,
    start_block,
    vjp_rows,
)

__all__ = ["block_krylov_svd"]

MAX_BASIS = 512
"""Basis columns before a restart (capped at d / 2, where the Krylov space stays orthonormal)."""


def _products(f: Map, x, X, chunk: int, clock: Clock):
    """``J X`` and ``J^T J X`` (p JVPs and p VJPs), timed under ``PRODUCTS``."""
    with clock.span(PRODUCTS):
        JX = jvp_columns(f, x, X, chunk)
        return JX, vjp_rows(f, x, JX, chunk).transpose(-2, -1)


def _expand(f: Map, x, W, last, chunk: int, clock: Clock):
    """New orthonormal block from ``last [B, d, p]`` against W, with ``J X`` and ``J^T J X``."""
    X = last - W @ (W.transpose(-2, -1) @ last)
    X = X - W @ (W.transpose(-2, -1) @ X)  # twice: full reorthogonalisation
    X = _orthonormal(X)
    return X, *_products(f, x, X, chunk, clock)


def _ritz(W, JW, Z, r: int):
    """Top-r Ritz triplets of J on span(W), their coefficients and residuals."""
    G = W.transpose(-2, -1) @ Z
    G = (G + G.transpose(-2, -1)) / 2
    evals, evecs = torch.linalg.eigh(G)
    C = evecs.flip(-1)
    S = evals.flip(-1).clamp_min(0).sqrt()
    Cr, Sr = C[..., :r], S[..., :r]
    safe = torch.where(Sr > 0, Sr, torch.ones_like(Sr))
    V = W @ Cr
    U = (JW @ Cr) / safe[:, None, :]
    res = torch.linalg.vector_norm((Z @ Cr) / safe[:, None, :] - V * Sr[:, None, :], dim=1)
    return U, S, V, C, res


def block_krylov_svd(
    f: Map,
    x: torch.Tensor,
    k: int,
    *,
    block: int,
    max_iters: int,
    tol: float,
    ill_gap: float,
    chunk: int,
    generator: torch.Generator,
    warm_start: torch.Tensor | None,
    clock: Clock,
) -> TopK:
    """Top K+1 singular triplets by restarted block Krylov iteration on ``J^T J``.

    Convergence, stagnation and ill-definedness tests of ``jacobian.linalg.StopTest``
    (the error of ``v_i`` is about ``r_i`` over the distance of ``s_i`` to its
    neighbours; converged or stopped documents are frozen while the others
    iterate), with the residual
    ``r_i = ||J^T u_i - s_i v_i||`` (``J v_i = s_i u_i`` holds by construction).

    Reference: Musco and Musco, NeurIPS 2015 (block Krylov); Golub and Van
    Loan, "Matrix Computations" (4th ed.), section 10.3 (block Lanczos with
    full reorthogonalisation and restarts).

    Args:
        f: batched block map ``[B, d] -> [B, d]``.
        x: ``[B, d]`` point.
        k: K; K+1 triplets are returned.
        block: p, columns added per step (>= K+1).
        max_iters: steps at most (each: p JVPs and p VJPs).
        tol: vector accuracy target.
        ill_gap: see ``jacobian_linalg.ill_defined``.
        chunk: tangents per vectorized batch.
        generator: random generator (on x's device).
        warm_start: ``[B, d, r]`` start columns (the previous layer's V), or None.
        clock: adds the products' seconds under ``PRODUCTS``.

    Returns:
        ``TopK``.
    """
    B, d = x.shape
    p, r = min(d, max(block, k + 1)), k + 1
    limit = max(p, min(MAX_BASIS, d // 2))
    W = _orthonormal(start_block(x, p, generator, warm_start))
    JW, Z = _products(f, x, W, chunk, clock)
    last = Z
    out = TopK.empty(B, d, r, x)
    active = torch.ones(B, dtype=torch.bool, device=x.device)
    test = StopTest(k, tol, ill_gap, x)
    for it in range(1, max(1, max_iters) + 1):
        U, S, V, C, res = _ritz(W, JW, Z, r)
        good, done, worst = test.step(S, res)
        stop = active & (torch.ones_like(good) if it >= max_iters else done)
        if bool(stop.any()):
            out.record(stop, U, S, V, it, worst, good, k, ill_gap)
            active &= ~stop
        if not bool(active.any()):
            break
        if W.shape[2] + p > limit:
            Cp = C[..., :p]
            W, JW, Z = W @ Cp, JW @ Cp, Z @ Cp
            last = Z
        X, JX, ZX = _expand(f, x, W, last[..., -p:], chunk, clock)
        W, JW, Z = torch.cat([W, X], 2), torch.cat([JW, JX], 2), torch.cat([Z, ZX], 2)
        last = ZX
    return out
