"""The engine's settings record, its per-layer timings, and the float64 Gram linear algebra."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lm_coupling.errors import ConfigurationError
from lm_coupling.jacobian.config import METHODS, JacobianConfig
from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.jacobian.linalg import gram_top, svd_top, top_eigh
from lm_coupling.model.architecture import locate_model_parts

F64 = torch.float64
IDS = torch.tensor([5, 17, 42, 99, 3, 250, 77, 310])
K = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def test_config_is_one_frozen_validated_record(tiny_model):
    model = tiny_model("gpt2", dtype=F64, n_layers=2)
    parts = locate_model_parts(model)
    config = JacobianConfig(k_max=K, method="gram", tol=1e-7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.k_max = 3
    assert config.route == "gram" and config.replace(keep_dense=True).route == "dense"
    assert config.block == 2 * (K + 1)
    # A config, keywords, or a config with keyword changes: one record either way.
    assert JacobianEngine(model, parts, config).config == config
    assert JacobianEngine(model, parts, k_max=K, method="gram", tol=1e-7).config == config
    assert JacobianEngine(model, parts, config, method="dense").config.method == "dense"
    for bad, field in [
        ({"method": "lanczos"}, "method"),
        ({"k_max": 0}, "k_max"),
        ({"max_iters": 0}, "max_iters"),
        ({"chunk_size": 1.5}, "chunk_size"),
        ({"ill_gap": -1.0}, "ill_gap"),
        ({"docs_per_batch": True}, "docs_per_batch"),
    ]:
        with pytest.raises(ConfigurationError, match=f"JacobianConfig.{field}"):
            JacobianConfig(**{"k_max": K, **bad})
    with pytest.raises(ConfigurationError, match="below the model width"):
        JacobianEngine(model, parts, k_max=parts.d_model)
    assert "auto" in METHODS and "gram" in METHODS


@pytest.mark.parametrize("method", ["gram", "krylov"])
def test_factors_report_seconds_per_layer_and_batch_shares(tiny_model, method):
    model = tiny_model("gpt2", dtype=F64, n_layers=3)
    parts = locate_model_parts(model)
    engine = JacobianEngine(model, parts, k_max=K, method=method, docs_per_batch=2)
    first, second = engine.factors_batch([IDS, IDS[:5]])
    for factors in (first, second):
        seconds = factors.seconds
        assert set(seconds) == {"forward", "jacobian_products", "factorisation", "reduction"}
        assert isinstance(seconds["forward"], float) and seconds["forward"] > 0
        for key in ("jacobian_products", "factorisation", "reduction"):
            assert len(seconds[key]) == 3
            assert all(isinstance(s, float) and s >= 0 for s in seconds[key])
        assert all(s > 0 for s in seconds["jacobian_products"])
    # One batch: each document carries the same share of it.
    assert first.seconds == second.seconds


def test_top_eigh_is_the_top_of_the_full_eigendecomposition():
    torch.manual_seed(0)
    X = torch.randn(3, 40, 40, dtype=F64)
    G = X @ X.transpose(-2, -1)
    values, vectors = top_eigh(G, 5)
    full_values, full_vectors = torch.linalg.eigh(G)
    torch.testing.assert_close(values, full_values[:, -5:].flip(-1), rtol=1e-12, atol=0)
    overlap = (vectors.transpose(-2, -1) @ full_vectors[:, :, -5:].flip(-1)).abs()
    eye = torch.eye(5, dtype=F64).expand(3, 5, 5)
    torch.testing.assert_close(overlap, eye, rtol=0, atol=1e-10)
    # Each document alone: a batch of one gives the same values, bit for bit.
    alone = top_eigh(G[1:2], 5)[0]
    assert torch.equal(alone[0], values[1])


def test_gram_route_in_float64_keeps_the_float32_jacobians_accuracy():
    """s_{K+1} / s_1 = 1e-3: a float32 Gram matrix loses the small values; float64 does not."""
    torch.manual_seed(1)
    d = 64
    Q1 = torch.linalg.qr(torch.randn(d, d, dtype=F64))[0]
    Q2 = torch.linalg.qr(torch.randn(d, d, dtype=F64))[0]
    s = torch.cat(
        [torch.tensor([1.0]), torch.linspace(3e-3, 1e-3, K), torch.full((d - K - 1,), 1e-4)]
    )
    J = (Q1 * s.to(F64)) @ Q2.T
    J32 = J.float()[None]
    reference = svd_top(J32.double(), K, 1e-6)  # the float32 matrix's exact SVD
    top = gram_top(J32, K, 1e-6)
    assert top.U.dtype == torch.float32
    torch.testing.assert_close(top.S.double(), reference.S, rtol=1e-6, atol=0)
    overlap = (top.V.double().transpose(-2, -1) @ reference.V).abs().diagonal(dim1=-2, dim2=-1)
    assert bool((overlap[:, :K] > 1 - 1e-6).all())
    # The same eigensolver on a float32 Gram matrix misses s_{K+1} by far more.
    G32 = J32.transpose(-2, -1) @ J32
    s32 = torch.linalg.eigvalsh(G32)[:, -(K + 1) :].flip(-1).clamp_min(0).sqrt().double()
    assert float(((s32 - reference.S) / reference.S).abs().max()) > 1e-4
