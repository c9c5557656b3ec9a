"""Mis-coupling as the ICLR 2025 authors' released code reports it: six L x L matrices.

Aubry et al., "Transformer Block Coupling and its Correlation with
Generalization in LLMs" (ICLR 2025); released code sugolov/coupling,
``coupling/metrics.py``. From the full SVD ``J_i = U_i S_i V_i^T`` of every
block's residual Jacobian at the last token,

    M_K(i, j) = U_{j,K}^T J_i V_{j,K}                      (K x K)
    m_K(i, j) = || |M_K(i, j)| - diag(s_{i,1..K}) ||_F / c_K(i)

with ``|.|`` elementwise, for K in {10, 30, 50} and two normalisations:
``trace``, ``c = sum_k s_{i,k}`` (= the l1 norm, eq. 9 of the paper) and
``norm``, ``c = ||s_{i,1..K}||_2``. The orientation is the paper's
``A^{l,l'} = U_{l'}^T J^l V_{l'}`` (the code's ``ujv``; ``vju`` swaps U and V).

How it differs from :mod:`lm_coupling.metrics.coupling` (this package's
``coupling``), each a documented option there: the authors take ``|M|``
(``elementwise_abs``); they report ``m`` (mis-coupling, lower = more coupled)
as L x L matrices, the diagonal included (``pairs=all``), not ``1 - m``
averaged; and their last block's Jacobian includes the final norm
(``jacobian.authors``).
"""

from __future__ import annotations

import torch

from lm_coupling.metrics import work_dtype

__all__ = ["AUTHORS_KS", "NORMALISATIONS", "authors_miscoupling"]

AUTHORS_KS = (10, 30, 50)
"""The K the authors' code reports (``num_sing_vecs``)."""

NORMALISATIONS = ("trace", "norm")
"""``trace``: divided by ``sum s`` (l1); ``norm``: by ``||s||_2`` (the code's ``p = 2``)."""


def authors_miscoupling(
    jacobians: torch.Tensor, ks: tuple[int, ...] = AUTHORS_KS
) -> dict[tuple[int, str], torch.Tensor]:
    """The authors' mis-coupling matrices ``m_K(i, j)`` for every K and normalisation.

    Args:
        jacobians: ``[L, d, d]`` residual Jacobians ``J_i`` (rows: output
            coordinates), float32 or float64.
        ks: the K values; each is capped at d (a model narrower than K uses
            all its singular vectors).

    Returns:
        ``{(K, "trace" | "norm"): [L, L]}`` with rows i (the Jacobian) and
        columns j (the singular vectors), in the input's dtype (float32 for
        other dtypes). A layer whose top-K singular values sum to 0 gives NaN
        in its row.
    """
    if jacobians.dim() != 3 or jacobians.shape[-1] != jacobians.shape[-2]:
        raise ValueError(f"jacobians must be [L, d, d], found {tuple(jacobians.shape)}")
    dtype = work_dtype(jacobians)
    J = jacobians.to(dtype)
    U, S, Vh = torch.linalg.svd(J)  # full SVD, as the authors' torch.linalg.svd
    d = J.shape[-1]
    out: dict[tuple[int, str], torch.Tensor] = {}
    for k in ks:
        k_used = min(int(k), d)
        Uk, Vk, s = U[..., :k_used], Vh[..., :k_used, :].transpose(-1, -2), S[:, :k_used]
        JV = torch.einsum("iab,jbk->ijak", J, Vk)  # J_i V_j
        M = torch.einsum("jak,ijal->ijkl", Uk, JV)  # U_j^T J_i V_j
        diff = torch.linalg.matrix_norm(M.abs() - torch.diag_embed(s)[:, None])
        out[(k, "trace")] = diff / s.sum(dim=-1)[:, None]
        out[(k, "norm")] = diff / torch.linalg.vector_norm(s, dim=-1)[:, None]
    return out
