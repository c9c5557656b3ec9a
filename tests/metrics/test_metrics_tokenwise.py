"""Token-wise coupling: key selection and the shared coupling formula."""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling.metrics.coupling import coupling_matrices_dense, miscoupling, top_k_svd
from lm_coupling.metrics.tokenwise import (
    context_coupling_fixed_input,
    context_coupling_fixed_output,
    pairwise_coupling,
    self_coupling,
)

F64 = torch.float64


def _position_jacobians(n_layers=2, n_tokens=3, d=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        (layer, t_in, t_out): torch.randn(d, d, generator=gen, dtype=F64)
        for layer in range(n_layers)
        for t_out in range(n_tokens)
        for t_in in range(t_out + 1)
    }


def test_pairwise_coupling_equals_coupling_formula():
    J = torch.stack(list(_position_jacobians().values())[:4])
    U, S, V = top_k_svd(J, 2)
    expected = 1 - miscoupling(coupling_matrices_dense(J, U, V), S, norm="l2")
    torch.testing.assert_close(pairwise_coupling(J, 2, norm="l2"), expected)
    torch.testing.assert_close(torch.diagonal(expected), torch.ones(4, dtype=F64))


def test_pairwise_coupling_rotation_closed_form():
    # Same closed form as in test_metrics_coupling: m = sqrt(2)(s1-s2)|sin|/(s1+s2).
    theta, s1, s2 = 0.4, 2.0, 1.0
    J1 = torch.diag(torch.tensor([s1, s2, 0.1], dtype=F64))
    R = torch.eye(3, dtype=F64)
    R[:2, :2] = torch.tensor(
        [[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]], dtype=F64
    )
    c = pairwise_coupling(torch.stack([J1, R @ J1 @ R.T]), 2)
    value = 1 - math.sqrt(2) * (s1 - s2) * math.sin(theta) / (s1 + s2)
    assert c[0, 1].item() == pytest.approx(value, abs=1e-12)
    assert c[1, 0].item() == pytest.approx(value, abs=1e-12)


def test_self_coupling_uses_diagonal_jacobians():
    jac = _position_jacobians()
    labels, c = self_coupling(jac, 2)
    assert labels == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    stacked = torch.stack([jac[(layer, t, t)] for layer, t in labels])
    torch.testing.assert_close(c, pairwise_coupling(stacked, 2))


def test_self_coupling_of_identical_jacobians_is_one():
    J = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    jac = {(layer, t, t): J for layer in range(2) for t in range(2)}
    _, c = self_coupling(jac, 3, elementwise_abs=True)
    torch.testing.assert_close(c, torch.ones(4, 4, dtype=F64))


def test_context_coupling_selects_tokens():
    jac = _position_jacobians(n_tokens=4)
    t_outs, c_in = context_coupling_fixed_input(jac, layer=1, t_in=1, k=2)
    assert t_outs == [1, 2, 3]
    expected = pairwise_coupling(torch.stack([jac[(1, 1, t)] for t in t_outs]), 2)
    torch.testing.assert_close(c_in, expected)
    t_ins, c_out = context_coupling_fixed_output(jac, layer=0, t_out=2, k=2, norm="offdiag")
    assert t_ins == [0, 1, 2]
    expected = pairwise_coupling(torch.stack([jac[(0, t, 2)] for t in t_ins]), 2, norm="offdiag")
    torch.testing.assert_close(c_out, expected)


def test_missing_keys_raise_with_available_keys():
    jac = _position_jacobians(n_layers=1, n_tokens=2)
    with pytest.raises(ValueError, match="available keys"):
        context_coupling_fixed_input(jac, layer=3, t_in=0, k=2)
