"""Transformer block coupling: coupling matrices, mis-coupling, scores, alignment ratio.

Block Jacobians ``J^l = U_l S_l V_l^T`` (l = 1..L, indexed 0..L-1 here) at the
target position. The coupling matrix of block l against the top-K singular
vectors of block l' is ``A^{l,l'} = U_{l',K}^T J^l V_{l',K}`` (K x K); when the
blocks share singular vectors it is ``diag(s_{l,K})``.

Sign convention: singular vectors are defined up to a sign flip of each
(u_i, v_i) pair. Such a flip of block l' multiplies ``A^{l,l'}_{ij}`` by
``sigma_i sigma_j``: the diagonal is unchanged and off-diagonal entries only
change sign, so every quantity here is invariant and SVD routes need no
common sign convention.

Every function computes in float32, or float64 when given float64.
"""

from __future__ import annotations

import math

import torch

from lm_coupling.metrics import as_work

__all__ = [
    "alignment_ratio",
    "coupling_matrices",
    "coupling_matrices_dense",
    "coupling_score",
    "miscoupling",
    "spectral_gap",
    "subspace_ill_defined",
    "top_k_svd",
]

_NORMS = ("l1", "l2", "offdiag")
_PAIRS = ("offdiag", "all", "adjacent")


def _check_factor(name: str, x: torch.Tensor, dims: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-d tensor, found {_shape(x)}")


def coupling_matrices(U: torch.Tensor, JV: torch.Tensor) -> torch.Tensor:
    """Coupling matrices from Jacobian-vector products (the one implementation of A).

    ``A^{l,m} = U_{m,K}^T (J^l V_{m,K})``. The coupling plugin hands it to the
    engine as its pair reduction (``plugins.builtin.coupling.pair_reduction``),
    called per layer with a document axis in front; the dense forms below and
    the tests call it too.

    Reference: Aubry et al., "Transformer Block Coupling and its Correlation
    with Generalization in LLMs", ICLR 2025, coupling-matrix definition (precedes eq. 9).

    Args:
        U: ``[..., M, d, K]`` top-K left singular vectors of each of M blocks.
        JV: ``[..., L, M, d, K']`` with ``JV[..., l, m] = J^l V_m`` and K' >= K
            (the first K columns are used); the leading dims ``...`` match U's.

    Returns:
        ``A [..., L, M, K, K]`` with ``A[..., l, m] = U_m^T J^l V_m``.
    """
    if not isinstance(U, torch.Tensor) or U.dim() < 3:
        raise ValueError(f"U must be a [..., M, d, K] tensor, found {_shape(U)}")
    if not isinstance(JV, torch.Tensor) or JV.dim() != U.dim() + 1:
        raise ValueError(f"JV must be a [..., L, M, d, K'] tensor, found {_shape(JV)}")
    *lead, n_blocks, d, k = U.shape
    if list(JV.shape[: len(lead)]) != lead or JV.shape[-3:-1] != (n_blocks, d) or JV.shape[-1] < k:
        raise ValueError(
            f"JV must have shape [..., L, M, d, >=K] with [..., M, d, K] = "
            f"{tuple(U.shape)} (U's), found {tuple(JV.shape)}"
        )
    return torch.einsum("...mdi,...lmdj->...lmij", as_work(U), as_work(JV[..., :k]))


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def coupling_matrices_dense(J: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Coupling matrices from dense Jacobians: :func:`coupling_matrices` of ``J^l V_m``.

    ``A^{l,m} = U_{m,K}^T J^l V_{m,K}``.

    Reference: Aubry et al., ICLR 2025, coupling-matrix definition (precedes eq. 9).

    Args:
        J: ``[L, d, d]`` block Jacobians.
        U: ``[L, d, K]`` top-K left singular vectors.
        V: ``[L, d, K]`` top-K right singular vectors.

    Returns:
        ``A [L, L, K, K]``.
    """
    _check_factor("J", J, 3)
    if U.shape != V.shape or U.dim() != 3 or U.shape[:2] != J.shape[:2]:
        raise ValueError(
            f"U and V must both be [L, d, K] matching J {tuple(J.shape)}; found U "
            f"{tuple(U.shape)}, V {tuple(V.shape)}"
        )
    return coupling_matrices(U, as_work(J)[:, None] @ as_work(V)[None])


def miscoupling(
    A: torch.Tensor,
    S: torch.Tensor,
    norm: str = "l1",
    elementwise_abs: bool = False,
) -> torch.Tensor:
    """Mis-coupling of every block pair.

    ``m_K(l,l') = ||M^{l,l'} - diag(s_{l,K})||_F / ||s_{l,K}||_p`` with p = 1
    (``norm="l1"``) or 2 (``"l2"``); ``"offdiag"`` gives
    ``||M - Diag(M)||_F / ||M||_F``. ``M = |A|`` element-wise when
    ``elementwise_abs`` (only changes the result where a diagonal entry of A is
    negative, i.e. anti-aligned blocks), else ``M = A``. Coupling is ``1 - m``.

    Reference: Aubry et al., ICLR 2025, eq. 9 (p = 1); ``offdiag`` is the arXiv
    version's normalisation; ``elementwise_abs`` is what the authors'
    released code does (not in the printed formula).

    Args:
        A: ``[L, L, K, K]`` coupling matrices, ``A[l, l'] = U_{l'}^T J^l V_{l'}``.
        S: ``[L, >=K]`` singular values of each block, descending.
        norm: ``"l1"``, ``"l2"`` or ``"offdiag"``.
        elementwise_abs: compare ``|A|`` instead of A.

    Returns:
        ``[L, L]`` float32 (float64 if given float64); NaN where the
        denominator is 0 or an input is non-finite.
    """
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, found {norm!r}")
    _check_factor("A", A, 4)
    n_layers, _, k, _ = A.shape
    if A.shape != (n_layers, n_layers, k, k):
        raise ValueError(f"A must have shape [L, L, K, K], found {tuple(A.shape)}")
    if S.dim() != 2 or S.shape[0] != n_layers or S.shape[1] < k:
        raise ValueError(
            f"S must have shape [L, >=K] = [{n_layers}, >={k}], found {tuple(S.shape)}"
        )
    M = as_work(A).abs() if elementwise_abs else as_work(A)
    if norm == "offdiag":
        off = M - torch.diag_embed(torch.diagonal(M, dim1=-2, dim2=-1))
        num, den = _fro(off), _fro(M)
    else:
        s = as_work(S[:, :k]).to(M.dtype)
        num = _fro(M - torch.diag_embed(s)[:, None])
        den = torch.linalg.vector_norm(s, ord=1 if norm == "l1" else 2, dim=-1)[:, None]
        den = den.expand_as(num)
    ok = (den > 0) & torch.isfinite(den) & torch.isfinite(num)
    safe = torch.where(ok, den, torch.ones_like(den))
    return torch.where(ok, num / safe, torch.full_like(num, math.nan))


def _fro(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(x, ord="fro")


def coupling_score(m: torch.Tensor, pairs: str = "offdiag") -> torch.Tensor:
    """Mean coupling ``c_K = 1 - m_K`` over a set of block pairs.

    ``offdiag``: ordered pairs l != l' (default); ``all``: every pair,
    diagonal included (the paper's average); ``adjacent``: |l - l'| = 1.

    Reference: Aubry et al., ICLR 2025, eq. 9 and the layer average.

    Args:
        m: ``[L, L]`` mis-coupling (see :func:`miscoupling`).
        pairs: ``"offdiag"``, ``"all"`` or ``"adjacent"``.

    Returns:
        0-dim tensor; NaN if no pair is selected (one block with ``offdiag`` or
        ``adjacent``) or a selected entry is NaN.
    """
    if pairs not in _PAIRS:
        raise ValueError(f"pairs must be one of {_PAIRS}, found {pairs!r}")
    if m.dim() != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"m must have shape [L, L], found {tuple(m.shape)}")
    idx = torch.arange(m.shape[0], device=m.device)
    gap = (idx[:, None] - idx[None, :]).abs()
    select = {"offdiag": gap != 0, "all": gap >= 0, "adjacent": gap == 1}[pairs]
    c = 1 - as_work(m)
    if not bool(select.any()):
        return torch.tensor(math.nan, dtype=c.dtype, device=c.device)
    return c[select].mean()


def alignment_ratio(A: torch.Tensor) -> torch.Tensor:
    """Mean absolute off-diagonal entry of A over its mean absolute diagonal entry.

    ``r(A^{l,l'}) = mean_{i != j} |A_ij| / mean_i |A_ii|``; small when block l
    maps block l''s singular directions onto themselves.

    Reference: Aubry et al., "Picking an LLM's Brain: Thought and Fixation in
    Hidden Representations" (2024), alignment ratio with K = 30.

    Args:
        A: ``[L, L, K, K]`` coupling matrices.

    Returns:
        ``[L, L]`` float32 (float64 if given float64); NaN where K = 1 (no
        off-diagonal entry) or the diagonal is all zero.
    """
    _check_factor("A", A, 4)
    M = as_work(A).abs()
    k = M.shape[-1]
    diag = torch.diagonal(M, dim1=-2, dim2=-1)
    diag_mean = diag.mean(dim=-1)
    if k < 2:
        return torch.full_like(diag_mean, math.nan)
    off_mean = (M.sum(dim=(-2, -1)) - diag.sum(dim=-1)) / (k * k - k)
    ok = diag_mean > 0
    safe = torch.where(ok, diag_mean, torch.ones_like(diag_mean))
    return torch.where(ok, off_mean / safe, torch.full_like(diag_mean, math.nan))


def top_k_svd(J: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k singular triplets of dense matrices (the exact reference route).

    ``J = U S V^T``; returns the first k columns of U and V and the first k
    singular values, descending. Signs follow ``torch.linalg.svd`` (no
    convention needed: coupling quantities are sign-invariant).

    Reference: Aubry et al., ICLR 2025 (full SVD of the block Jacobians).

    Args:
        J: ``[..., d_out, d_in]`` matrices.
        k: number of triplets, at most ``min(d_out, d_in)``.

    Returns:
        ``(U [..., d_out, k], S [..., k], V [..., d_in, k])`` in float32
        (float64 if given float64).
    """
    if J.dim() < 2:
        raise ValueError(f"J must have shape [..., d, d], found {tuple(J.shape)}")
    limit = min(J.shape[-2:])
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= limit:
        raise ValueError(f"k must be an int in [1, {limit}], found {k!r}")
    U, S, Vh = torch.linalg.svd(as_work(J), full_matrices=False)
    return U[..., :k], S[..., :k], Vh[..., :k, :].transpose(-2, -1)


def spectral_gap(S: torch.Tensor, k: int) -> torch.Tensor:
    """Spectral gap at K, ``s_K / s_{K+1}``.

    Reference: Halko, Martinsson and Tropp, 2011 (randomized SVD accuracy
    depends on this gap); docs/design.md, "Metric definitions".

    Args:
        S: ``[..., >=K+1]`` singular values, descending.
        k: K.

    Returns:
        ``[...]``; inf where ``s_{K+1} = 0 < s_K``, NaN where both are 0.
    """
    if S.shape[-1] < k + 1:
        raise ValueError(f"S needs at least K+1 = {k + 1} values, found {tuple(S.shape)}")
    return as_work(S[..., k - 1]) / as_work(S[..., k])


SUBSPACE_MIN_GAP = 1.05
"""Default threshold of :func:`subspace_ill_defined` (docs/metrics.md, the ill-defined subspace)."""


def subspace_ill_defined(
    gap: torch.Tensor, numerical: torch.Tensor | None, min_gap: float = SUBSPACE_MIN_GAP
) -> torch.Tensor:
    """Whether each block's top-K subspace is ill-defined: ``s_K / s_{K+1} < min_gap`` or numerical.

    By Wedin's theorem (Stewart and Sun 1990, V.4), a perturbation ``E`` of
    ``J`` turns the top-K singular subspaces by at most
    ``sin theta <= ||E||_2 / (s_K - s_{K+1})``; with ``||E|| = eps s_K`` that
    is ``eps / (1 - 1 / g)``, ``g = s_K / s_{K+1}``. At the default
    ``min_gap = 1.05`` a 1% perturbation of the Jacobian (another document of
    the task, the model's quantisation) may turn the subspace by up to
    ``sin theta = 0.21``; below it the coupling at K reads a subspace the
    spectrum does not pin down. ``numerical`` is the engine's flag (two of the
    top K+1 singular values within ``jacobian_ill_gap * s_1``: what its routes
    cannot separate); a NaN gap (``s_K = s_{K+1} = 0``) counts as ill-defined.

    Args:
        gap: ``[L]`` ``s_K / s_{K+1}`` (:func:`spectral_gap`).
        numerical: ``[L]`` the engine's flag (bool or 0/1; NaN: unknown), or None.
        min_gap: the threshold (> 1; 1 keeps the numerical flag alone).

    Returns:
        ``[L]`` float64, 1.0 where ill-defined, 0.0 elsewhere.
    """
    if not min_gap >= 1:
        raise ValueError(f"min_gap must be >= 1, found {min_gap!r}")
    gap = gap.detach().to("cpu", torch.float64)
    flag = torch.isnan(gap) | (gap < min_gap)
    if numerical is not None:
        numerical = numerical.detach().to("cpu", torch.float64)
        flag = flag | (torch.nan_to_num(numerical, nan=0.0) > 0)
    return flag.to(torch.float64)


def largest_gap_k(S: torch.Tensor, k_min: int, k_max: int) -> int:
    """The K in ``[k_min, k_max]`` whose worst layer's spectral gap is largest.

    ``K* = argmax_K min_l s^l_K / s^l_{K+1}``: the number of singular vectors
    at which every block's top-K subspace is best determined by its spectrum,
    so that the coupling at K* does not depend on an arbitrary choice inside
    a cluster of equal singular values (docs/metrics.md, "The ill-defined
    subspace"). Ties go to the smaller K.

    Args:
        S: ``[L, >= k_max + 1]`` singular values of every block, descending.
        k_min: smallest K considered (>= 1).
        k_max: largest K considered.

    Returns:
        K*; a NaN gap (``s_K = s_{K+1} = 0``) counts as the smallest.
    """
    if not 1 <= k_min <= k_max or S.shape[-1] < k_max + 1:
        raise ValueError(
            f"need 1 <= k_min <= k_max and S with k_max + 1 values, found k_min={k_min}, "
            f"k_max={k_max}, S {tuple(S.shape)}"
        )
    gaps = torch.stack([spectral_gap(S, k).amin() for k in range(k_min, k_max + 1)])
    gaps = torch.where(torch.isnan(gaps), torch.full_like(gaps, -math.inf), gaps)
    return k_min + int(torch.argmax(gaps))
