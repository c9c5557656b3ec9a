"""Matrix-free linear algebra on batched block maps: JVP/VJP, dense Jacobians, top-K solvers.

A block map is ``f: [B, d] -> [B, d]`` at a point ``x [B, d]``: B documents,
each its own independent map (see ``jacobian_calls``), so its Jacobian is
block-diagonal and only the per-document blocks ``J_b [d, d]`` are ever
formed. Products use ``torch.func``: ``J T`` by ``vmap`` over ``jvp``
(forward mode), ``C^T J`` by ``vmap`` over the pullback of one ``vjp``
(reverse mode), in chunks of tangents to bound memory.

Top-K solvers (every one returns K+1 triplets, the iterations it ran and the
relative residual ``max_i ||J v_i - s_i u_i|| / s_1`` over the top K):

- :func:`svd_top` on dense Jacobians: full SVD (exact reference).
- :func:`gram_top`: top K+1 eigenpairs of ``J^T J`` formed and solved in
  float64 (a partial symmetric eigensolver, :func:`top_eigh`), ``U = J V / S``;
  cheaper than a full SVD on either device, as accurate.
- ``jacobian.krylov.block_krylov_svd``: restarted block Krylov iteration on
  ``J^T J`` with the residual-based convergence test :class:`StopTest`;
  never forms J.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "Clock",
    "TopK",
    "chunk_size_for",
    "dense_jacobian",
    "gram_top",
    "start_block",
    "jvp_columns",
    "svd_top",
    "top_eigh",
    "vjp_rows",
]

Map = Callable[[torch.Tensor], torch.Tensor]

STALL = 6
"""`StopTest` stops a document whose residual has not halved in this many iterations."""


@dataclass
class Clock:
    """Wall seconds spent under named spans (CUDA work is waited for at both ends).

    Attributes:
        seconds: span name -> seconds summed over its spans.
        device: the device whose queued kernels a span waits for.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seconds: dict[str, float] = field(default_factory=dict)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``seconds[name]``."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def get(self, name: str) -> float:
        """Seconds under ``name`` (0 if none)."""
        return self.seconds.get(name, 0.0)


PRODUCTS = "jacobian_products"
"""``Clock`` span of the Jacobian products (JVPs and VJPs through a block)."""


@dataclass
class TopK:
    """Top singular triplets of B Jacobians and how they were found.

    Attributes:
        U: ``[B, d, r]`` left singular vectors (r = K + 1).
        S: ``[B, r]`` singular values, descending.
        V: ``[B, d, r]`` right singular vectors.
        iterations: ``[B]`` int, iterations each document ran (0: direct).
        residual: ``[B]`` ``max_{i<K} ||J v_i - s_i u_i|| / s_1``.
        converged: ``[B]`` bool, the convergence test passed (always for direct routes).
        ill_defined: ``[B]`` bool, two of the top K+1 singular values are closer
            than ``ill_gap * s_1`` (see :func:`ill_defined`).
    """

    U: torch.Tensor
    S: torch.Tensor
    V: torch.Tensor
    iterations: torch.Tensor
    residual: torch.Tensor
    converged: torch.Tensor
    ill_defined: torch.Tensor

    def record(self, stop, U, S, V, iteration: int, worst, good, k: int, ill_gap: float) -> None:
        """Keep the triplets (first r columns) of the documents in ``stop`` as they are now."""
        r = self.U.shape[2]
        self.U[stop], self.S[stop], self.V[stop] = U[stop, :, :r], S[stop, :r], V[stop, :, :r]
        self.iterations[stop] = iteration
        self.residual[stop] = worst[stop]
        self.converged[stop] = good[stop]
        self.ill_defined[stop] = ill_defined(S[stop], k, ill_gap)

    @classmethod
    def empty(cls, B: int, d: int, r: int, like: torch.Tensor) -> TopK:
        """Placeholders an iterative route fills in as its documents stop."""
        options = {"dtype": like.dtype, "device": like.device}
        return cls(
            torch.zeros(B, d, r, **options),
            torch.zeros(B, r, **options),
            torch.zeros(B, d, r, **options),
            torch.zeros(B, dtype=torch.long, device=like.device),
            torch.full((B,), torch.inf, **options),
            torch.zeros(B, dtype=torch.bool, device=like.device),
            torch.zeros(B, dtype=torch.bool, device=like.device),
        )


def start_block(
    x: torch.Tensor, p: int, generator: torch.Generator, warm_start: torch.Tensor | None
) -> torch.Tensor:
    """``[B, d, p]`` Gaussian start columns, the first ones those of ``warm_start``."""
    B, d = x.shape
    omega = torch.randn(B, d, p, generator=generator, device=x.device, dtype=x.dtype)
    if warm_start is not None:
        w = min(p, warm_start.shape[2])
        omega[:, :, :w] = warm_start[:, :, :w].to(omega)
    return omega


def chunk_size_for(d: int, context: int, device: torch.device, dtype: torch.dtype) -> int:
    """Tangents per vectorized batch, so that one batch stays within a memory budget.

    Each tangent carries the block's activations at one token per document
    (about ``32 d`` values with the MLP's) and, where the attention
    concatenates the frozen prefix's keys and values (see
    ``jacobian.frozen_attention``), a few ``[context, d]`` copies of them; the
    budget (1 GiB on CPU, 4 GiB on GPU) is divided by
    ``(8 * context + 32) * d * itemsize``. Pass ``context`` summed over the
    documents of a batch, or 0 where the prefix is not copied.
    """
    budget = (4 if device.type == "cuda" else 1) << 30
    per_tangent = (8 * context + 32) * d * torch.finfo(dtype).bits // 8
    return max(1, budget // per_tangent)


def jvp_columns(f: Map, x: torch.Tensor, tangents: torch.Tensor, chunk: int) -> torch.Tensor:
    """Jacobian-vector products ``J_b T_b`` for many tangents at once.

    Args:
        f: batched block map ``[B, d] -> [B, d]``.
        x: ``[B, d]`` point.
        tangents: ``[B, d, m]`` columns.
        chunk: tangents per vectorized batch.

    Returns:
        ``[B, d, m]``.
    """

    def push(t: torch.Tensor) -> torch.Tensor:
        return torch.func.jvp(f, (x,), (t,))[1]

    return torch.func.vmap(push, in_dims=2, out_dims=2, chunk_size=chunk)(tangents)


def vjp_rows(f: Map, x: torch.Tensor, cotangents: torch.Tensor, chunk: int) -> torch.Tensor:
    """Vector-Jacobian products ``C_b^T J_b`` for many cotangents at once.

    Args:
        f: batched block map ``[B, d] -> [B, d]``.
        x: ``[B, d]`` point.
        cotangents: ``[B, d, m]`` columns c_i.
        chunk: cotangents per vectorized batch.

    Returns:
        ``[B, m, d]`` rows ``c_i^T J_b``.
    """
    _, pull = torch.func.vjp(f, x)

    def back(c: torch.Tensor) -> torch.Tensor:
        return pull(c)[0]

    return torch.func.vmap(back, in_dims=2, out_dims=1, chunk_size=chunk)(cotangents)


def dense_jacobian(f: Map, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The dense Jacobians ``J_b = df_b/dx_b [B, d, d]`` by reverse mode (d VJPs, vectorized).

    Row i is ``e_i^T J``. Reverse mode is about 15% faster than d JVPs on a
    CPU (the forward pass is taken once, unbatched) and agrees to round-off.
    """
    B, d = x.shape
    eye = torch.eye(d, dtype=x.dtype, device=x.device).expand(B, d, d)
    return vjp_rows(f, x, eye, chunk)


def ill_defined(S: torch.Tensor, k: int, ill_gap: float) -> torch.Tensor:
    """Whether the top-K singular vectors are ill-defined: ``min_{i<K} delta_i < ill_gap s_1``.

    ``delta_i`` is the distance from ``s_i`` to its nearest neighbour among
    ``s_1 .. s_{K+1}``. Where two of these values (nearly) coincide, the
    corresponding singular vectors (and so the coupling matrices) are only
    defined up to a rotation within the pair: no route can reproduce another.

    Args:
        S: ``[B, >=K+1]`` singular values, descending.
        k: K.
        ill_gap: relative threshold.

    Returns:
        ``[B]`` bool.
    """
    top = S[:, : k + 1]
    diffs = (top[:, :-1] - top[:, 1:]).abs()
    return diffs.min(dim=1).values < ill_gap * top[:, 0]


def _direct(J, U, S, V, k: int, ill_gap: float) -> TopK:
    """``TopK`` of a direct route, with the residual ``max_{i<K} ||J v_i - s_i u_i|| / s_1``."""
    B = J.shape[0]
    res = torch.linalg.vector_norm(J @ V[:, :, :k] - U[:, :, :k] * S[:, None, :k], dim=1)
    residual = res.amax(dim=1) / S[:, 0].clamp_min(1e-300)
    zeros = torch.zeros(B, dtype=torch.long, device=J.device)
    ones = torch.ones(B, dtype=torch.bool, device=J.device)
    return TopK(U, S, V, zeros, residual, ones, ill_defined(S, k, ill_gap))


def svd_top(J: torch.Tensor, k: int, ill_gap: float) -> TopK:
    """Top K+1 triplets of dense ``J [B, d, d]`` by a full SVD (the exact reference)."""
    U_full, S_full, Vh = torch.linalg.svd(J)
    U, S, V = U_full[..., : k + 1], S_full[..., : k + 1], Vh[..., : k + 1, :].transpose(-2, -1)
    return _direct(J, U, S, V, k, ill_gap)


def top_eigh(G: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The r largest eigenpairs of symmetric ``G [B, n, n]``, descending.

    On a CPU, LAPACK's MRRR driver restricted to the top r indices
    (``scipy.linalg.eigh(subset_by_index=..., driver="evr")``): the
    tridiagonal reduction, then r eigenpairs instead of n, and r
    back-transformed vectors; about 2.4x cheaper than a full float64
    ``torch.linalg.eigh`` at n = 768 (``bench/jacobian.py`` prints both).
    Its BLAS is held to one thread: scipy's OpenBLAS threads keep spinning
    after a call returns and took the cores from torch's (the next layer's
    products ran at half speed at GPT-2-small shape on 2 cores). Elsewhere
    ``torch.linalg.eigh`` (one batched call on the device). Each document is
    solved alone, so its result does not depend on the batch.

    Reference: Dhillon, Parlett and Voemel, "The design and implementation
    of the MRRR algorithm", ACM TOMS 32 (2006); LAPACK ``dsyevr``.

    Args:
        G: ``[B, n, n]`` symmetric matrices.
        r: eigenpairs kept, 1 <= r <= n.

    Returns:
        ``(evals [B, r], evecs [B, n, r])``, eigenvalues descending.
    """
    n = G.shape[-1]
    if G.device.type != "cpu":
        evals, evecs = torch.linalg.eigh(G)
        return evals[..., n - r :].flip(-1), evecs[..., n - r :].flip(-1)
    import scipy.linalg
    from threadpoolctl import threadpool_limits

    values, vectors = [], []
    with threadpool_limits(limits=1, user_api="blas"):
        for g in G.numpy():
            w, v = scipy.linalg.eigh(
                g, subset_by_index=[n - r, n - 1], driver="evr", check_finite=False
            )
            values.append(torch.from_numpy(w[::-1].copy()))
            vectors.append(torch.from_numpy(v[:, ::-1].copy()))
    return torch.stack(values).to(G.dtype), torch.stack(vectors).to(G.dtype)


def gram_top(J: torch.Tensor, k: int, ill_gap: float) -> TopK:
    """Top K+1 triplets of dense ``J [B, d, d]`` from the eigenpairs of ``J^T J``, in float64.

    ``J^T J = V diag(s^2) V^T`` (:func:`top_eigh`, the top K+1 pairs only),
    ``U = J V / s``. The Gram matrix is formed and solved in float64 whatever
    J's dtype: squaring J squares its condition number, which float32 cannot
    carry (float32 Gram matrices moved values by 3e-5 with the round-off of
    the batch's composition), while float64 keeps the errors of the top
    vectors at ``O(eps_32 s_1 / (s_i - s_j))``, those of J itself, the same
    as a full SVD's. Columns with ``s = 0`` get ``U = 0`` (then the vectors
    are ill-defined anyway). Results are returned in J's dtype.
    """
    J64 = J.double()
    evals, V = top_eigh(J64.transpose(-2, -1) @ J64, k + 1)
    S = evals.clamp_min(0).sqrt()
    JV = J64 @ V
    U = JV / torch.where(S > 0, S, torch.ones_like(S))[:, None, :]
    U = torch.where(S[:, None, :] > 0, U, torch.zeros_like(U))
    return _direct(J, U.to(J.dtype), S.to(J.dtype), V.to(J.dtype), k, ill_gap)


def _orthonormal(Y: torch.Tensor) -> torch.Tensor:
    """Orthonormal bases of the columns of ``Y [B, d, p]`` (reduced QR)."""
    return torch.linalg.qr(Y, mode="reduced")[0]


def _neighbour_gaps(S: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, K+1]``: distance of each of the top K+1 Ritz values to its nearest other one."""
    diff = (S[:, : k + 1, None] - S[:, None, :]).abs()
    idx = torch.arange(k + 1, device=S.device)
    diff[:, idx, idx] = torch.inf
    return diff.amin(dim=2)


class StopTest:
    """Per-document stopping test of an iterative top-K route, one call per iteration.

    A document is done when every top-K residual ``||J^T u_i - s_i v_i||`` (or
    ``||J v_i - s_i u_i||``) is below ``tol`` times the distance of ``s_i`` to
    its neighbours (or at round-off level), when its top K+1 values are
    ill-defined (see :func:`ill_defined`) and have settled, or when the worst
    residual has not halved in ``STALL`` iterations.
    """

    def __init__(self, k: int, tol: float, ill_gap: float, like: torch.Tensor):
        self.k, self.tol, self.ill_gap = k, tol, ill_gap
        self.floor = 8 * like.shape[1] ** 0.5 * torch.finfo(like.dtype).eps
        self.tiny = torch.finfo(like.dtype).tiny
        self.previous: torch.Tensor | None = None
        B = like.shape[0]
        self.best = torch.full((B,), torch.inf, dtype=like.dtype, device=like.device)
        self.since = torch.zeros(B, dtype=torch.long, device=like.device)

    def step(
        self, S: torch.Tensor, res: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(converged, done, worst)`` per document for values ``S`` and residuals ``res``.

        ``worst`` is ``max_{i<K} res_i / s_1``.
        """
        k, r = self.k, self.k + 1
        s1 = S[:, :1].clamp_min(self.tiny)
        bound = torch.maximum(self.tol * _neighbour_gaps(S, k), self.floor * s1)
        good = (res[:, :k] <= bound[:, :k]).all(dim=1)
        good &= res[:, k] <= torch.maximum(self.tol**0.5 * s1[:, 0], self.floor * s1[:, 0])
        bad = ill_defined(S, k, self.ill_gap)
        if self.previous is None:
            bad = torch.zeros_like(bad)
        else:
            settled = (S[:, :r] - self.previous).abs().amax(dim=1) < 0.1 * self.ill_gap * s1[:, 0]
            bad &= settled
        self.previous = S[:, :r]
        worst = res[:, :k].amax(dim=1) / s1[:, 0]
        improved = worst < 0.5 * self.best
        self.best = torch.where(improved, worst, self.best)
        self.since = torch.where(improved, 0, self.since + 1)
        return good, good | bad | (self.since >= STALL), worst
