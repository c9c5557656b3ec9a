"""Token-wise coupling: the coupling formula applied to Jacobians between positions.

Position Jacobians ``J^l_{t1 t2} = d block_l(X)_{t2} / d x^{l-1}_{t1}`` (input
token t1, output token t2, t1 <= t2) are passed as a mapping
``{(layer, t_in, t_out): [d, d] tensor}``, the shape
``JacobianEngine.position_jacobian`` returns them in. Every function here
compares a small set of such matrices pairwise with the mis-coupling of
:func:`lm_coupling.metrics.coupling.miscoupling`: for matrices ``J_i, J_j``,
``A^{i,j} = U_{j,K}^T J_i V_{j,K}`` and ``c(i, j) = 1 - m_K(i, j)``.

- self-coupling: ``J^l_{tt}`` against ``J^{l'}_{t't'}`` over (layer, token) pairs;
- context coupling, fixed input token t1: ``J^l_{t1 t2}`` across output tokens t2;
- context coupling, fixed output token t2: ``J^l_{t1 t2}`` across input tokens t1.

Meant for a small sample (N matrices cost N SVDs and N^2 K x K products).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lm_coupling.metrics.coupling import coupling_matrices_dense, miscoupling, top_k_svd

__all__ = [
    "PositionJacobians",
    "context_coupling_fixed_input",
    "context_coupling_fixed_output",
    "mean_offdiagonal",
    "pairwise_coupling",
    "self_coupling",
]

PositionJacobians = Mapping[tuple[int, int, int], torch.Tensor]
"""``{(layer, t_in, t_out): J^layer_{t_in t_out} [d, d]}`` with t_in <= t_out."""


def pairwise_coupling(
    jacobians: torch.Tensor, k: int, *, norm: str = "l1", elementwise_abs: bool = False
) -> torch.Tensor:
    """Coupling of every ordered pair of N matrices.

    ``c(i, j) = 1 - m_K(i, j)``, ``A^{i,j} = U_{j,K}^T J_i V_{j,K}`` compared
    with ``diag(s_{i,K})`` as in ICLR 2025 eq. 9.

    Reference: Aubry et al., "Transformer Block Coupling and its Correlation
    with Generalization in LLMs", ICLR 2025, eq. 9 and the token-wise coupling
    analysis.

    Args:
        jacobians: ``[N, d, d]`` matrices.
        k: number of singular vectors K (at most d).
        norm: ``"l1"``, ``"l2"`` or ``"offdiag"`` (see ``miscoupling``).
        elementwise_abs: compare ``|A|`` instead of A.

    Returns:
        ``[N, N]`` coupling, 1 on the diagonal; float32 (float64 if given
        float64); NaN where a matrix is zero or non-finite.
    """
    if not isinstance(jacobians, torch.Tensor) or jacobians.dim() != 3:
        found = tuple(jacobians.shape) if isinstance(jacobians, torch.Tensor) else jacobians
        raise ValueError(f"jacobians must have shape [N, d, d], found {found}")
    U, S, V = top_k_svd(jacobians, k)
    A = coupling_matrices_dense(jacobians, U, V)
    return 1 - miscoupling(A, S, norm=norm, elementwise_abs=elementwise_abs)


def _stack(jacobians: PositionJacobians, keys: list[tuple[int, int, int]], what: str):
    if not keys:
        available = sorted(jacobians)
        raise ValueError(f"no position Jacobian matches {what}; available keys: {available}")
    return torch.stack([jacobians[key] for key in keys])


def self_coupling(
    jacobians: PositionJacobians, k: int, *, norm: str = "l1", elementwise_abs: bool = False
) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """Self-coupling of the diagonal position Jacobians ``J^l_{tt}``.

    ``c((l, t), (l', t'))`` = coupling of ``J^l_{tt}`` against the top-K
    singular vectors of ``J^{l'}_{t't'}``.

    Reference: Aubry et al., ICLR 2025, token-wise coupling (eq. 9 applied to
    position Jacobians).

    Args:
        jacobians: mapping ``(layer, t_in, t_out) -> [d, d]``; entries with
            ``t_in == t_out`` are used.
        k: number of singular vectors K.
        norm: ``"l1"``, ``"l2"`` or ``"offdiag"`` (see ``miscoupling``).
        elementwise_abs: compare ``|A|`` instead of A.

    Returns:
        ``(labels, c)``: the sorted ``(layer, t)`` labels and the ``[N, N]``
        coupling in that order.
    """
    keys = sorted(key for key in jacobians if key[1] == key[2])
    c = pairwise_coupling(
        _stack(jacobians, keys, "t_in == t_out"), k, norm=norm, elementwise_abs=elementwise_abs
    )
    return [(layer, t) for layer, t, _ in keys], c


def _context_coupling(
    jacobians: PositionJacobians,
    layer: int,
    fixed_axis: int,
    fixed_token: int,
    k: int,
    norm: str,
    elementwise_abs: bool,
) -> tuple[list[int], torch.Tensor]:
    """Couple ``J^l_{t1 t2}`` over the free token, the token at ``fixed_axis`` held fixed.

    ``fixed_axis`` indexes the ``(layer, t_in, t_out)`` key: 1 fixes t_in, 2 fixes t_out.
    """
    free_axis = 3 - fixed_axis
    keys = sorted(k_ for k_ in jacobians if k_[0] == layer and k_[fixed_axis] == fixed_token)
    name = "t_in" if fixed_axis == 1 else "t_out"
    stacked = _stack(jacobians, keys, f"layer={layer}, {name}={fixed_token}")
    c = pairwise_coupling(stacked, k, norm=norm, elementwise_abs=elementwise_abs)
    return [key[free_axis] for key in keys], c


def context_coupling_fixed_input(
    jacobians: PositionJacobians,
    layer: int,
    t_in: int,
    k: int,
    *,
    norm: str = "l1",
    elementwise_abs: bool = False,
) -> tuple[list[int], torch.Tensor]:
    """Coupling of ``J^l_{t1 t2}`` across output tokens t2, input token t1 fixed.

    Reference: Aubry et al., ICLR 2025, token-wise (context) coupling.

    Args:
        jacobians: mapping ``(layer, t_in, t_out) -> [d, d]``.
        layer: the block l.
        t_in: the fixed input token t1.
        k: number of singular vectors K.
        norm: ``"l1"``, ``"l2"`` or ``"offdiag"`` (see ``miscoupling``).
        elementwise_abs: compare ``|A|`` instead of A.

    Returns:
        ``(t_outs, c)``: sorted output tokens t2 >= t1 and the ``[N, N]`` coupling.
    """
    return _context_coupling(jacobians, layer, 1, t_in, k, norm, elementwise_abs)


def context_coupling_fixed_output(
    jacobians: PositionJacobians,
    layer: int,
    t_out: int,
    k: int,
    *,
    norm: str = "l1",
    elementwise_abs: bool = False,
) -> tuple[list[int], torch.Tensor]:
    """Coupling of ``J^l_{t1 t2}`` across input tokens t1, output token t2 fixed.

    Reference: Aubry et al., ICLR 2025, token-wise (context) coupling.

    Args:
        jacobians: mapping ``(layer, t_in, t_out) -> [d, d]``.
        layer: the block l.
        t_out: the fixed output token t2.
        k: number of singular vectors K.
        norm: ``"l1"``, ``"l2"`` or ``"offdiag"`` (see ``miscoupling``).
        elementwise_abs: compare ``|A|`` instead of A.

    Returns:
        ``(t_ins, c)``: sorted input tokens t1 <= t2 and the ``[N, N]`` coupling.
    """
    return _context_coupling(jacobians, layer, 2, t_out, k, norm, elementwise_abs)


def mean_offdiagonal(c: torch.Tensor) -> torch.Tensor:
    """Mean of the finite off-diagonal entries of ``[..., N, N]`` coupling matrices.

    The per-document value of the token-wise coupling metrics: the mean of
    ``c(i, j)`` over ordered pairs ``i != j`` (and over any leading axes, e.g.
    layers), NaN entries (positions a short prompt lacks) left out.

    Reference: Aubry et al., ICLR 2025, token-wise coupling (the pairwise
    average used for the layer coupling, applied to positions).

    Args:
        c: ``[..., N, N]`` coupling matrices.

    Returns:
        0-d tensor; NaN when no off-diagonal entry is finite (N < 2).
    """
    n = c.shape[-1]
    off = ~torch.eye(n, dtype=torch.bool, device=c.device)
    entries = c[..., off]
    finite = entries[torch.isfinite(entries)]
    if finite.numel() == 0:
        return torch.tensor(float("nan"), dtype=c.dtype)
    return finite.mean()
