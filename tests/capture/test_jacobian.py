"""The block-Jacobian engine against independent references.

References: central finite differences of the full-sequence block map (block l
called on its recorded whole-sequence input, x_n perturbed, row n read), the
papers' naive route (d backward passes through the whole sequence), and the
dense route itself for the matrix-free routes.

Precision note: GPT-2 and Falcon compute entirely in float64 when the model is
float64, so their checks run at float64 tolerances. Llama-family RMSNorms and
the eager attention softmax of GPT-NeoX, OPT, Phi, Qwen2 and Gemma upcast to
float32 *inside the model* even when it is float64, so for those the
references can only agree to float32 round-off (measured: naive vs dense
<= 2e-7 relative; central differences are limited by that noise to ~1e-4).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from fixtures.tiny import build_tiny_model, tiny_config

from lm_coupling.jacobian.calls import engine_mode
from lm_coupling.jacobian.engine import JacobianEngine, naive_block_jacobians
from lm_coupling.jacobian.linalg import dense_jacobian
from lm_coupling.jacobian.sequence import record_sequences
from lm_coupling.metrics.coupling import (
    coupling_matrices_dense,
    coupling_score,
    miscoupling,
)
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.builtin.coupling import pair_reduction

F64 = torch.float64
IDS = torch.tensor([5, 17, 42, 99, 3, 250, 77, 310])
# model_type -> (finite-difference rtol, naive rtol, step h); see the module docstring.
PURE_F64 = {"gpt2": (1e-6, 1e-8, 1e-5), "falcon": (1e-6, 1e-8, 1e-5)}
F32_INSIDE = {
    "llama": (1e-3, 1e-6, 1e-3),
    "gpt_neox": (1e-3, 1e-6, 1e-3),
    "opt": (1e-3, 1e-6, 1e-4),  # ReLU: a small step stays off its kinks
    "phi": (1e-3, 1e-6, 1e-3),
    "qwen2": (1e-3, 1e-6, 1e-3),
    "gemma": (1e-3, 1e-6, 1e-3),
}
K = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def _rel_close(actual, expected, rtol):
    """max |actual - expected| <= rtol * max |expected|."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=rtol * scale)


def _full_sequence_input(model, block, ids):
    """Block l's (args, kwargs) from a plain forward pass over the whole prompt."""
    seen = {}

    def hook(module, args, kwargs):
        seen["call"] = (args, kwargs)

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids[None], use_cache=False)
    finally:
        handle.remove()
    return seen["call"]


def _finite_difference(model, block, ids, h, t_in=None):
    """Central differences of d block(X)_n / d x_{t_in}, minus I when t_in = n."""
    args, kwargs = _full_sequence_input(model, block, ids)
    X = args[0]
    n, d = X.shape[1] - 1, X.shape[2]
    t_in = n if t_in is None else t_in
    cols = []
    with torch.no_grad():
        for i in range(d):
            plus, minus = X.clone(), X.clone()
            plus[0, t_in, i] += h
            minus[0, t_in, i] -= h
            out_p = block(plus, *args[1:], **kwargs)
            out_m = block(minus, *args[1:], **kwargs)
            out_p = out_p[0] if isinstance(out_p, tuple) else out_p
            out_m = out_m[0] if isinstance(out_m, tuple) else out_m
            cols.append((out_p[0, n] - out_m[0, n]) / (2 * h))
    J = torch.stack(cols, dim=1)
    return J - torch.eye(d, dtype=J.dtype) if t_in == n else J


@pytest.mark.parametrize("model_type", [*PURE_F64, *F32_INSIDE])
def test_dense_route_matches_finite_differences_and_naive(tiny_model, model_type):
    fd_rtol, naive_rtol, h = {**PURE_F64, **F32_INSIDE}[model_type]
    model = tiny_model(model_type, dtype=F64, n_layers=2)
    parts = locate_model_parts(model)
    J = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K).dense_jacobians(IDS)
    assert J.shape == (2, 32, 32) and J.dtype == F64
    _rel_close(J[1], _finite_difference(model, parts.blocks[1], IDS, h), fd_rtol)
    _rel_close(J, naive_block_jacobians(model, parts, IDS), naive_rtol)


def _gapped_gpt2():
    """GPT-2 whose MLP (width K) dominates: J^l has a clear gap at K."""
    config = tiny_config("gpt2", 512, d_model=32, n_layers=3, n_heads=4, d_ff=K)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.to(F64).eval()
    with torch.no_grad():
        for block in locate_model_parts(model).blocks:
            block.mlp.c_fc.weight.mul_(3)
            block.mlp.c_proj.weight.mul_(3)
            block.attn.c_proj.weight.mul_(0.5)
    return model


@pytest.fixture(scope="module")
def gapped():
    model = _gapped_gpt2()
    parts = locate_model_parts(model)
    dense = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method="dense", keep_dense=True
    ).factors(IDS)
    return model, parts, dense


def _coupling(factors):
    m = miscoupling(factors.A, factors.S)
    return m, coupling_score(m)


@pytest.mark.parametrize(
    ("method", "extra", "route"),
    [
        ("dense", {}, "dense"),
        ("gram", {}, "gram"),
        ("krylov", {}, "krylov"),
        ("auto", {}, "gram"),
        ("auto", {"dense_max_d": 0, "max_iters": 50}, "krylov"),
    ],
)
def test_every_route_gives_the_dense_coupling(gapped, method, extra, route):
    model, parts, dense = gapped
    S = torch.linalg.svdvals(dense.dense)
    # The constructed model has a clear gap at K (checked, not assumed).
    assert bool((S[:, K - 1] / S[:, K] > 2).all())
    torch.testing.assert_close(dense.spectral_gap, S[:, K - 1] / S[:, K], rtol=1e-10, atol=0)
    factors = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method=method, **extra
    ).factors(IDS)
    assert factors.method == [route] * 3
    m_ref, c_ref = _coupling(dense)
    m, c = _coupling(factors)
    atol = 1e-6
    torch.testing.assert_close(m, m_ref, rtol=0, atol=atol)
    torch.testing.assert_close(c, c_ref, rtol=0, atol=atol)
    torch.testing.assert_close(factors.S[:, :K], S[:, :K], rtol=1e-8, atol=0)
    torch.testing.assert_close(factors.S[:, K], S[:, K], rtol=1e-4, atol=0)
    torch.testing.assert_close(factors.spectral_gap, dense.spectral_gap, rtol=1e-4, atol=0)
    # A[l, m] = U_m^T J^l V_m with the route's own U, V.
    A = coupling_matrices_dense(dense.dense, factors.U, factors.V)
    torch.testing.assert_close(factors.A, A, rtol=0, atol=1e-10)
    assert not bool(factors.ill_defined.any())
    assert len(factors.iterations) == 3 and factors.residual.shape == (3,)
    if route in ("dense", "gram"):
        assert factors.iterations == [0, 0, 0]
    else:
        assert all(i >= 1 for i in factors.iterations)
    assert bool((factors.residual < 1e-8).all())


def test_krylov_products_match_dense_matrices_and_are_reproducible(gapped):
    model, parts, dense = gapped
    factors = JacobianEngine(
        model,
        parts,
        pair_reduction=pair_reduction,
        k_max=K,
        method="krylov",
        swapped=True,
        seed=3,
    ).factors(IDS)
    B = coupling_matrices_dense(dense.dense, factors.V, factors.U)  # swapped: V_m^T J^l U_m
    torch.testing.assert_close(factors.B, B, rtol=0, atol=1e-10)
    assert factors.dense is None
    again = JacobianEngine(
        model,
        parts,
        pair_reduction=pair_reduction,
        k_max=K,
        method="krylov",
        swapped=True,
        seed=3,
    ).factors(IDS)
    for a, b in [(factors.U, again.U), (factors.S, again.S), (factors.A, again.A)]:
        assert torch.equal(a, b)


def test_auto_falls_back_to_an_exact_route_where_the_iteration_does_not_converge(tiny_model):
    model = tiny_model("gpt2", dtype=F64, n_layers=2)
    parts = locate_model_parts(model)
    dense = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method="dense"
    ).factors(IDS)
    # One iteration cannot converge on this flat spectrum: auto recomputes exactly.
    auto = JacobianEngine(
        model,
        parts,
        pair_reduction=pair_reduction,
        k_max=K,
        method="auto",
        dense_max_d=0,
        max_iters=1,
    )
    factors = auto.factors(IDS)
    assert factors.method == ["gram", "gram"]
    torch.testing.assert_close(factors.A.abs(), dense.A.abs(), rtol=0, atol=1e-10)
    # Asked for by name, the iterative route never returns unconverged triplets either.
    alone = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method="krylov", max_iters=1
    ).factors(IDS)
    assert alone.method == ["gram", "gram"]
    torch.testing.assert_close(alone.A.abs(), dense.A.abs(), rtol=0, atol=1e-10)


def test_dense_factors_are_the_svd_of_the_dense_jacobians(gapped):
    _, _, dense = gapped
    U, S, Vh = torch.linalg.svd(dense.dense)
    torch.testing.assert_close(dense.S, S[:, : K + 1], rtol=1e-12, atol=0)
    # Same singular subspaces: |u_i . u_i'| = 1 (signs are free).
    overlap = torch.einsum("ldk,ldk->lk", dense.U, U[..., :K]).abs()
    torch.testing.assert_close(overlap, torch.ones_like(overlap), rtol=0, atol=1e-10)
    torch.testing.assert_close(
        dense.A, coupling_matrices_dense(dense.dense, dense.U, dense.V), rtol=0, atol=1e-12
    )


def test_position_jacobian_diagonal_and_off_diagonal(tiny_model):
    model = tiny_model("gpt2", dtype=F64, n_layers=2)
    parts = locate_model_parts(model)
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K)
    n = IDS.shape[0] - 1
    J = engine.dense_jacobians(IDS)
    torch.testing.assert_close(engine.position_jacobian(IDS, 1, n, n), J[1], rtol=0, atol=1e-12)
    off = engine.position_jacobian(IDS, 0, 2, n)
    _rel_close(off, _finite_difference(model, parts.blocks[0], IDS, 1e-5, t_in=2), 1e-6)
    assert off.abs().max() > 0
    with pytest.raises(ValueError, match="t_in must be <= t_out"):
        engine.position_jacobian(IDS, 0, 5, 3)


def _whole_sequence_position_jacobian(model, parts, ids, layer, t_in, t_out):
    """Reference: block l rerun on the whole recorded sequence per tangent (no frozen prefix)."""
    with engine_mode(model):
        call = record_sequences(model, parts, [ids], F64)[layer].docs[0]
        f, x = call.position_map(t_in, t_out)
        return dense_jacobian(f, x, 64)[0]


@pytest.mark.parametrize(
    ("model_type", "attn"),
    [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "sdpa"), ("gpt_neox", "eager")],
)
def test_position_jacobian_equals_the_whole_sequence_route(tokenizer, model_type, attn):
    """Rows t_in..t_out with the prefix frozen give the whole-sequence Jacobians."""
    model = build_tiny_model(model_type, len(tokenizer), dtype=F64, n_layers=2)
    model.set_attn_implementation(attn)
    parts = locate_model_parts(model)
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K)
    n = IDS.shape[0] - 1
    for layer, t_in, t_out in [(0, 0, 0), (1, 0, n), (0, 3, 5), (1, n - 1, n), (1, n, n)]:
        got = engine.position_jacobian(IDS, layer, t_in, t_out)
        expected = _whole_sequence_position_jacobian(model, parts, IDS, layer, t_in, t_out)
        assert expected.abs().max() > 0
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 * expected.abs().max())


def test_one_token_prompt(tiny_model):
    model = tiny_model("llama", dtype=F64, n_layers=2)
    parts = locate_model_parts(model)
    ids = IDS[:1]
    factors = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, keep_dense=True
    ).factors(ids)
    _rel_close(factors.dense, naive_block_jacobians(model, parts, ids), 1e-6)
    assert factors.A.shape == (2, 2, K, K)
    assert bool(torch.isfinite(factors.A).all())


def test_bfloat16_model_gives_float32_results_and_is_not_modified(tiny_model):
    model = tiny_model("gpt_neox", dtype=torch.bfloat16, n_layers=2)
    parts = locate_model_parts(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    factors = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, swapped=True
    ).factors(IDS)
    for t in (factors.U, factors.S, factors.V, factors.A, factors.B, factors.spectral_gap):
        assert t.dtype == torch.float32
        assert bool(torch.isfinite(t).all())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert next(model.parameters()).dtype == torch.bfloat16


def test_sdpa_model_restored_and_equal_to_eager():
    models = []
    for attn in ("sdpa", "eager"):
        # from_config shares the config object: one config per model.
        config = tiny_config("llama", 512, d_model=32, n_layers=2, n_heads=4)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        models.append(model.eval())
    sdpa, eager = models
    sdpa.train()
    J_sdpa = JacobianEngine(sdpa, locate_model_parts(sdpa), k_max=K).dense_jacobians(IDS)
    J_eager = JacobianEngine(eager, locate_model_parts(eager), k_max=K).dense_jacobians(IDS)
    torch.testing.assert_close(J_sdpa, J_eager, rtol=0, atol=1e-6)
    assert sdpa.config._attn_implementation == "sdpa"
    assert sdpa.training and all(m.training for m in sdpa.modules())


def test_bad_arguments_are_rejected(tiny_model):
    model = tiny_model("gpt2", dtype=F64, n_layers=2)
    parts = locate_model_parts(model)
    with pytest.raises(ValueError, match="k_max"):
        JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=32)
    with pytest.raises(ValueError, match="method"):
        JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K, method="lanczos")
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K)
    with pytest.raises(ValueError, match=r"shape \[T\]"):
        engine.factors(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor"):
        engine.factors([1, 2, 3])
