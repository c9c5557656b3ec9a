"""Matrix-free linear algebra on a block map: batched JVP/VJP, dense Jacobian, randomized SVD.

A block map is ``f: R^d -> R^d`` at a point x (see ``jacobian_calls``); its
Jacobian J is never formed here except by :func:`dense_jacobian`. Products use
``torch.func``: ``J T`` by ``vmap`` over ``jvp`` (forward mode), ``C^T J`` by
``vmap`` over the pullback of one ``vjp`` (reverse mode), in chunks of
tangents to bound memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "chunk_size_for",
    "dense_jacobian",
    "jvp_columns",
    "randomized_svd",
    "vjp_rows",
]

Map = Callable[[torch.Tensor], torch.Tensor]


def chunk_size_for(d: int, context: int, device: torch.device, dtype: torch.dtype) -> int:
    """Tangents per vectorized batch, so that one batch stays within a memory budget.

    Each tangent carries a few ``[context, d]`` activations (keys/values of the
    prefix with their tangents), so the budget (1 GiB on CPU, 4 GiB on GPU)
    is divided by ``8 * context * d * itemsize``.
    """
    budget = (4 if device.type == "cuda" else 1) << 30
    per_tangent = 8 * max(context, 1) * d * torch.finfo(dtype).bits // 8
    return max(1, budget // per_tangent)


def jvp_columns(f: Map, x: torch.Tensor, tangents: torch.Tensor, chunk: int) -> torch.Tensor:
    """Jacobian-vector products ``J T`` for many tangents at once.

    Args:
        f: block map ``R^d -> R^d``.
        x: ``[d]`` point.
        tangents: ``[d, m]`` columns.
        chunk: tangents per vectorized batch.

    Returns:
        ``[d, m]`` ``J @ tangents``.
    """

    def push(t: torch.Tensor) -> torch.Tensor:
        return torch.func.jvp(f, (x,), (t,))[1]

    return torch.func.vmap(push, in_dims=1, out_dims=1, chunk_size=chunk)(tangents)


def vjp_rows(f: Map, x: torch.Tensor, cotangents: torch.Tensor, chunk: int) -> torch.Tensor:
    """Vector-Jacobian products ``C^T J`` for many cotangents at once.

    Args:
        f: block map ``R^d -> R^d``.
        x: ``[d]`` point.
        cotangents: ``[d, m]`` columns c_i.
        chunk: cotangents per vectorized batch.

    Returns:
        ``[m, d]`` rows ``c_i^T J``.
    """
    _, pull = torch.func.vjp(f, x)

    def back(c: torch.Tensor) -> torch.Tensor:
        return pull(c)[0]

    return torch.func.vmap(back, in_dims=1, out_dims=0, chunk_size=chunk)(cotangents)


def dense_jacobian(f: Map, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The dense Jacobian ``J = df/dx [d, d]`` by forward mode (d JVPs, vectorized)."""
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    return jvp_columns(f, x, eye, chunk)


def _orthonormal(Y: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of ``Y [d, p]`` (reduced QR)."""
    return torch.linalg.qr(Y, mode="reduced")[0]


def randomized_svd(
    f: Map,
    x: torch.Tensor,
    rank: int,
    *,
    oversample: int,
    power_iters: int,
    chunk: int,
    generator: torch.Generator,
    warm_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top singular triplets of J by randomized SVD with power iterations.

    ``Y = J Omega``, then ``power_iters`` times ``Q = orth(Y)``, ``Y = J orth(J^T Q)``;
    finally ``Q = orth(Y)``, ``B = Q^T J`` (one VJP batch), ``B = U_B S V^T`` and
    ``U = Q U_B``. Omega has ``p = min(d, rank + oversample)`` columns; its first
    columns are ``warm_start`` (e.g. the neighbouring layer's right singular
    vectors), the rest Gaussian. The error of the i-th triplet shrinks like
    ``(s_{p+1} / s_i)^(2 power_iters + 1)``: accurate only where the spectrum
    has a clear gap.

    Reference: Halko, Martinsson and Tropp, "Finding structure with
    randomness", SIAM Review 2011, Algorithms 4.4 (randomized subspace
    iteration) and 5.1 (direct SVD).

    Args:
        f: block map ``R^d -> R^d``.
        x: ``[d]`` point.
        rank: number of triplets returned (K_max + 1).
        oversample: extra columns in the sketch.
        power_iters: number of power (subspace) iterations.
        chunk: tangents per vectorized batch.
        generator: random generator (on x's device) for reproducible sketches.
        warm_start: ``[d, r]`` columns placed first in the sketch, or None.

    Returns:
        ``(U [d, rank], S [rank], V [d, rank])`` in x's dtype.
    """
    d = x.shape[-1]
    p = min(d, rank + oversample)
    omega = torch.randn(d, p, generator=generator, device=x.device, dtype=x.dtype)
    if warm_start is not None:
        r = min(p, warm_start.shape[1])
        omega[:, :r] = warm_start[:, :r].to(omega)
    Y = jvp_columns(f, x, omega, chunk)
    for _ in range(power_iters):
        Z = vjp_rows(f, x, _orthonormal(Y), chunk).T
        Y = jvp_columns(f, x, _orthonormal(Z), chunk)
    Q = _orthonormal(Y)
    B = vjp_rows(f, x, Q, chunk)
    U_B, S, Vh = torch.linalg.svd(B, full_matrices=False)
    U = Q @ U_B
    return U[:, :rank], S[:rank], Vh[:rank].T
