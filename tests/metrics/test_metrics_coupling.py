"""Closed forms, invariances and dense references for block coupling."""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling.metrics.coupling import (
    alignment_ratio,
    coupling_matrices,
    coupling_matrices_dense,
    coupling_score,
    miscoupling,
    spectral_gap,
    top_k_svd,
)
from lm_coupling.plugins.specs import used_k

F64 = torch.float64
NORMS = ("l1", "l2", "offdiag")


def _random_jacobians(n_layers=3, d=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n_layers, d, d, generator=gen, dtype=F64)


def _factors(J, k):
    U, S, V = top_k_svd(J, k)
    return U, S, V, coupling_matrices_dense(J, U, V)


def _rotation(d, theta):
    R = torch.eye(d, dtype=F64)
    c, s = math.cos(theta), math.sin(theta)
    R[0, 0], R[0, 1], R[1, 0], R[1, 1] = c, -s, s, c
    return R


def test_top_k_svd_reconstructs_and_orders():
    J = _random_jacobians(2, 5)
    U, S, V = top_k_svd(J, 5)
    torch.testing.assert_close(U @ torch.diag_embed(S) @ V.transpose(-2, -1), J)
    assert (S[:, :-1] >= S[:, 1:]).all()
    U2, S2, V2 = top_k_svd(J, 2)
    assert U2.shape == (2, 5, 2) and S2.shape == (2, 2) and V2.shape == (2, 5, 2)
    assert top_k_svd(J.float(), 2)[1].dtype == torch.float32


def test_products_route_equals_dense_route():
    J = _random_jacobians(3, 6)
    U, S, V = top_k_svd(J, 3)
    JV = torch.einsum("lde,mek->lmdk", J, V)
    A = coupling_matrices(U, JV)
    torch.testing.assert_close(A, coupling_matrices_dense(J, U, V))
    # Explicit definition for one pair.
    torch.testing.assert_close(A[0, 2], U[2].T @ J[0] @ V[2])
    # JV with more columns than K: the first K are used.
    torch.testing.assert_close(coupling_matrices(U[..., :2], JV), A[..., :2, :2])


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("elementwise_abs", [False, True])
def test_identical_jacobians_are_perfectly_coupled(norm, elementwise_abs):
    J = _random_jacobians(1, 6).expand(4, 6, 6).clone()
    U, S, V, A = _factors(J, 3)
    diag = torch.diag_embed(S).expand(4, 4, 3, 3)
    torch.testing.assert_close(A, diag)
    m = miscoupling(A, S, norm=norm, elementwise_abs=elementwise_abs)
    torch.testing.assert_close(m, torch.zeros(4, 4, dtype=F64), rtol=0, atol=1e-12)
    for pairs in ("offdiag", "all", "adjacent"):
        assert coupling_score(m, pairs=pairs).item() == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(alignment_ratio(A), torch.zeros(4, 4, dtype=F64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("theta", [0.3, 1.0, -2.2])
def test_rotated_singular_vectors_closed_form(theta):
    """Layer 2 = layer 1 with U and V rotated by theta in the top-2 plane.

    J1 = diag(s1, s2, e1, e2), U1 = V1 = I; J2 = R J1 R^T so U2 = V2 = R (top 2).
    A^{1,2} = R_2^T diag(s1, s2) R_2 = [[c^2 s1 + s^2 s2, -cs(s1-s2)],
                                        [-cs(s1-s2), s^2 s1 + c^2 s2]].
    A - diag(s1, s2) = (s1-s2) [[-s^2, -cs], [-cs, s^2]], whose Frobenius norm is
    sqrt(2) |s1 - s2| |sin theta|. The off-diagonal part alone has norm
    sqrt(2) |cs| (s1 - s2), and ||A||_F = ||diag(s1, s2)||_F.
    (With s1 = s2 the blocks would be identical on the plane, coupling 1.)
    """
    s1, s2 = 3.0, 1.0
    J1 = torch.diag(torch.tensor([s1, s2, 0.2, 0.1], dtype=F64))
    R = _rotation(4, theta)
    J = torch.stack([J1, R @ J1 @ R.T])
    U, S, V, A = _factors(J, 2)
    sin, cos = abs(math.sin(theta)), abs(math.cos(theta))
    expected = {
        "l1": math.sqrt(2) * (s1 - s2) * sin / (s1 + s2),
        "l2": math.sqrt(2) * (s1 - s2) * sin / math.hypot(s1, s2),
        "offdiag": math.sqrt(2) * (s1 - s2) * sin * cos / math.hypot(s1, s2),
    }
    for norm, value in expected.items():
        m = miscoupling(A, S, norm=norm)
        target = torch.tensor([[0.0, value], [value, 0.0]], dtype=F64)
        torch.testing.assert_close(m, target, rtol=0, atol=1e-12)
        c = 1 - value
        assert coupling_score(m, "offdiag").item() == pytest.approx(c, abs=1e-12)
        assert coupling_score(m, "adjacent").item() == pytest.approx(c, abs=1e-12)
        assert coupling_score(m, "all").item() == pytest.approx(1 - value / 2, abs=1e-12)
    # mean |off| = |cs| (s1 - s2); the diagonal is positive and sums to s1 + s2.
    ratio = sin * cos * (s1 - s2) / ((s1 + s2) / 2)
    assert alignment_ratio(A)[0, 1].item() == pytest.approx(ratio, abs=1e-12)


def test_elementwise_abs_matters_for_anti_aligned_blocks():
    # J2 = -J1: A^{1,2} = -diag(s). |A| compares equal to diag(s), A does not:
    # ||-s - s||_2 / ||s||_1 = 2 ||s||_2 / ||s||_1. Negative off-diagonal
    # entries alone would not change the l1/l2 value (|a_ij - 0| = ||a_ij| - 0|).
    J1 = _random_jacobians(1, 5, seed=4)[0]
    J = torch.stack([J1, -J1])
    U, S, V, A = _factors(J, 3)
    plain = miscoupling(A, S, norm="l1")
    absolute = miscoupling(A, S, norm="l1", elementwise_abs=True)
    s = S[0]
    assert plain[0, 1].item() == pytest.approx(2 * s.norm().item() / s.sum().item(), rel=1e-10)
    assert absolute[0, 1].item() == pytest.approx(0.0, abs=1e-10)
    rotated_J = torch.stack([J1, _rotation(5, 0.7) @ J1 @ _rotation(5, 0.7).T])
    _, S2, _, A2 = _factors(rotated_J, 3)
    assert (A2[0, 1] < 0).any()  # negative entries are present here too
    torch.testing.assert_close(
        miscoupling(A2, S2, "offdiag"), miscoupling(A2, S2, "offdiag", elementwise_abs=True)
    )


def test_sign_flips_of_singular_pairs_do_not_change_coupling():
    J = _random_jacobians(3, 6, seed=7)
    U, S, V, A = _factors(J, 4)
    gen = torch.Generator().manual_seed(11)
    signs = torch.randint(0, 2, (3, 1, 4), generator=gen).to(F64) * 2 - 1
    A_flipped = coupling_matrices_dense(J, U * signs, V * signs)
    assert not torch.allclose(A_flipped, A)  # the matrices themselves change sign
    for norm in NORMS:
        for elementwise_abs in (False, True):
            torch.testing.assert_close(
                miscoupling(A_flipped, S, norm, elementwise_abs),
                miscoupling(A, S, norm, elementwise_abs),
            )
    torch.testing.assert_close(alignment_ratio(A_flipped), alignment_ratio(A))


def test_coupling_score_pair_selection_by_hand():
    m = torch.tensor([[0.0, 0.2, 0.4], [0.1, 0.0, 0.3], [0.5, 0.6, 0.0]], dtype=F64)
    assert coupling_score(m).item() == pytest.approx(1 - 2.1 / 6)
    assert coupling_score(m, "all").item() == pytest.approx(1 - 2.1 / 9)
    assert coupling_score(m, "adjacent").item() == pytest.approx(1 - 1.2 / 4)
    assert math.isnan(coupling_score(torch.zeros(1, 1), "offdiag").item())
    with pytest.raises(ValueError, match="pairs"):
        coupling_score(m, "diag")


def test_alignment_ratio_by_hand_and_k1():
    A = torch.tensor([[2.0, -1.0], [0.5, -4.0]], dtype=F64).expand(1, 1, 2, 2)
    assert alignment_ratio(A).item() == pytest.approx(0.75 / 3.0)
    assert torch.isnan(alignment_ratio(torch.ones(2, 2, 1, 1))).all()  # K = 1: no off-diagonal


def test_miscoupling_degenerate_and_errors():
    A = torch.zeros(2, 2, 2, 2)
    m = miscoupling(A, torch.zeros(2, 3))
    assert torch.isnan(m).all()
    with pytest.raises(ValueError, match="norm"):
        miscoupling(A, torch.ones(2, 2), norm="l3")
    with pytest.raises(ValueError, match=r"\[L, >=K\]"):
        miscoupling(A, torch.ones(2, 1))


@pytest.mark.parametrize(
    ("k", "d", "expected"),
    [
        (10, 768, 10),
        (0.1, 768, 76),
        (0.1, 5, 1),
        (0.3, 10, 3),
        (0.29, 100, 29),
        (1, 1, 1),
        (769, 768, 767),  # capped at d - 1: s_{K+1} is left for the spectral gap
        (100, 48, 47),
    ],
)
def test_used_k_is_the_one_resolver(k, d, expected):
    assert used_k(k, d) == expected


@pytest.mark.parametrize("k", [0, -3, 1.0, 1.5, -0.1])
def test_used_k_rejects(k):
    with pytest.raises(ValueError, match="k"):
        used_k(k, 768)


def test_used_k_rejects_bool():
    with pytest.raises(TypeError):
        used_k(True, 768)


def test_spectral_gap():
    S = torch.tensor([[4.0, 2.0, 1.0], [3.0, 3.0, 0.0]])
    torch.testing.assert_close(spectral_gap(S, 1), torch.tensor([2.0, 1.0]))
    assert spectral_gap(S, 2)[1].item() == math.inf
