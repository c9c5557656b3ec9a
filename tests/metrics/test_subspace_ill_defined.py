"""The ill-defined subspace rule: a gap s_K/s_{K+1} below the threshold, or the engine's flag.

The threshold's reading (docs/metrics.md, "The ill-defined subspace") is Wedin's
bound: a perturbation of relative size eps turns the top-K subspace by at most
sin theta = eps / (1 - 1/g). Checked here on a matrix built with a chosen gap:
a perturbation of 1% turns its top-K subspace by about that much when g is
below the default threshold, and hardly at all when g is well above it.
"""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling.metrics.coupling import SUBSPACE_MIN_GAP, spectral_gap, subspace_ill_defined
from lm_coupling.selection import make_selection


def test_flags_gaps_below_the_threshold_nan_and_the_engines_flag():
    gap = torch.tensor([1.003, 1.0499, 1.05, 1.2, math.nan, 2.0], dtype=torch.float64)
    engine = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    got = subspace_ill_defined(gap, engine)
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert subspace_ill_defined(gap, None, min_gap=1.0).tolist() == [0, 0, 0, 0, 1, 0]
    assert subspace_ill_defined(gap, torch.full((6,), math.nan)).tolist()[-1] == 0.0
    with pytest.raises(ValueError, match="min_gap"):
        subspace_ill_defined(gap, None, min_gap=0.5)


def _subspace_turn(g: float, eps: float, k: int = 3, d: int = 12) -> float:
    """sin of the largest angle between the top-k left subspaces of J and J + E, ||E|| = eps s_k."""
    gen = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    s = torch.tensor([4.0, 3.0, 2.0 * g] + [2.0] + [1.0] * (d - 4), dtype=torch.float64)
    J = U @ torch.diag(s) @ V.T
    worst = 0.0
    for _ in range(20):
        E = torch.randn(d, d, generator=gen, dtype=torch.float64)
        E = E / torch.linalg.matrix_norm(E, ord=2) * eps * s[k - 1]
        U2 = torch.linalg.svd(J + E)[0][:, :k]
        P = U[:, :k] @ U[:, :k].T
        worst = max(worst, float(torch.linalg.matrix_norm((torch.eye(d) - P) @ U2, ord=2)))
    assert float(spectral_gap(s[None], k)[0]) == pytest.approx(g)
    return worst


def test_below_the_threshold_a_one_percent_perturbation_turns_the_subspace():
    eps = 0.01
    bound = eps / (1 - 1 / SUBSPACE_MIN_GAP)
    assert bound == pytest.approx(0.21, abs=0.005)  # the documented reading of 1.05
    assert _subspace_turn(1.005, eps) > 0.2  # a SmolLM2-like gap: turned far
    assert _subspace_turn(1.5, eps) < 0.05  # a clear gap: hardly moved
    assert _subspace_turn(1.5, eps) <= eps / (1 - 1 / 1.5)  # Wedin's bound holds


def test_threshold_is_an_option_checked_before_any_model():
    assert make_selection("coupling").options["subspace_min_gap"] == SUBSPACE_MIN_GAP
    assert make_selection("coupling", "subspace_min_gap=1.2").options["subspace_min_gap"] == 1.2
    from lm_coupling.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="subspace_min_gap"):
        make_selection("coupling", "subspace_min_gap=0.9")
