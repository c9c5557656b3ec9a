"""The Jacobian engine at scale: routes on flat spectra, linear memory, batched documents,
the function lm-eval scores (ALiBi Falcon), the swapped matrix B, GPU placement.

References: the exact dense route (d JVPs + full SVD) with the dense coupling
formulas of ``lm_coupling.metrics.coupling``; central finite differences of
the model's own block (its own attention implementation) for ALiBi Falcon.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from fixtures.tiny import tiny_config
from fixtures.transformers_range import require_fixed

from lm_coupling.geometry import GeometryRunner
from lm_coupling.jacobian.engine import JacobianEngine, JacobianMismatchError
from lm_coupling.metrics.coupling import (
    coupling_matrices_dense,
    coupling_score,
    miscoupling,
)
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.builtin.coupling import pair_reduction
from lm_coupling.plugins.manager import get_registry, new_plugin_manager
from lm_coupling.selection import make_selection

F64 = torch.float64
IDS = torch.tensor([5, 17, 42, 99, 3, 250, 77, 310, 8, 21])
K = 4
# Float64 models that compute in float64 throughout vs those that upcast to
# float32 inside (RMSNorm, softmax): tolerance of agreements between routes.
ROUTE_ATOL = {"gpt2": 1e-6, "llama": 1e-6, "gpt_neox": 1e-6}
BATCH_ATOL = {"gpt2": 1e-10, "llama": 1e-6, "gpt_neox": 1e-6}
# JVP products vs products with the dense J: float32 round-off inside Llama/NeoX.
PRODUCT_ATOL = {"gpt2": 1e-10, "llama": 1e-7, "gpt_neox": 1e-7}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(ROUTE_ATOL))
def small(request, tiny_model):
    """A float64 tiny model, its parts and its exact dense factors (B included)."""
    model = tiny_model(request.param, dtype=F64, n_layers=3)
    parts = locate_model_parts(model)
    engine = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, keep_dense=True, swapped=True
    )
    return request.param, model, parts, engine.factors(IDS)


def _relative_gaps(S: torch.Tensor) -> torch.Tensor:
    """Smallest distance between consecutive top K+1 values, over s_1, per layer."""
    return (S[:, :-1] - S[:, 1:]).amin(dim=1) / S[:, 0]


@pytest.mark.parametrize("method", ["gram", "krylov"])
def test_flat_spectrum_routes_give_the_dense_coupling(small, method):
    name, model, parts, dense = small
    # Random tiny models have flat spectra (gap s_K/s_{K+1} near 1) but
    # well-separated values: the singular vectors are defined (checked).
    assert bool((_relative_gaps(dense.S) > 1e-3).all())
    assert not bool(dense.ill_defined.any())
    factors = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method=method, swapped=True
    ).factors(IDS)
    # A layer the Krylov iteration leaves unconverged (its basis is capped at d/2 = 16
    # here) is recomputed exactly and recorded as gram; either way the values agree.
    assert set(factors.method) <= {method, "gram"}
    atol = ROUTE_ATOL[name]
    torch.testing.assert_close(
        miscoupling(factors.A, factors.S), miscoupling(dense.A, dense.S), rtol=0, atol=atol
    )
    torch.testing.assert_close(
        miscoupling(factors.B, factors.S), miscoupling(dense.B, dense.S), rtol=0, atol=atol
    )
    torch.testing.assert_close(factors.S, dense.S, rtol=atol, atol=0)
    # The route's own products are exact whatever its vectors.
    A = coupling_matrices_dense(dense.dense, factors.U, factors.V)
    torch.testing.assert_close(factors.A, A, rtol=0, atol=PRODUCT_ATOL[name])


def test_swapped_matrices_equal_the_dense_formula(small):
    _, _, _, dense = small
    B = coupling_matrices_dense(dense.dense, dense.V, dense.U)  # swapped: V_m^T J^l U_m
    torch.testing.assert_close(dense.B, B, rtol=0, atol=1e-12)
    A = coupling_matrices_dense(dense.dense, dense.U, dense.V)
    torch.testing.assert_close(dense.A, A, rtol=0, atol=1e-12)
    assert not torch.allclose(dense.A, dense.B)


def test_products_by_jvp_equal_the_kept_jacobians_and_memory_is_linear_in_L(tiny_model):
    peaks = {}
    for n_layers in (2, 4):
        model = tiny_model("gpt2", dtype=F64, n_layers=n_layers)
        parts = locate_model_parts(model)
        kept = JacobianEngine(
            model, parts, pair_reduction=pair_reduction, k_max=K, swapped=True
        ).factors(IDS)
        lean = JacobianEngine(
            model, parts, pair_reduction=pair_reduction, k_max=K, swapped=True, keep_bytes=0
        ).factors(IDS)
        torch.testing.assert_close(lean.A, kept.A, rtol=0, atol=1e-12)
        torch.testing.assert_close(lean.B, kept.B, rtol=0, atol=1e-12)
        peaks[n_layers] = lean.peak_bytes
    # Held: triplets, gathered U/V and one product group per layer, all O(L d K).
    assert peaks[4] == 2 * peaks[2] > 0


def test_ill_defined_layer_is_flagged_and_stops_early(tiny_model):
    model = tiny_model("gpt2", dtype=F64, n_layers=2)
    parts = locate_model_parts(model)
    dense = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method="dense"
    ).factors(IDS)
    gap = _relative_gaps(dense.S)
    # A threshold above the actual gaps makes every layer ill-defined.
    ill_gap = float(gap.max()) * 2
    flagged = JacobianEngine(
        model,
        parts,
        pair_reduction=pair_reduction,
        k_max=K,
        method="krylov",
        ill_gap=ill_gap,
        max_iters=200,
    ).factors(IDS)
    assert bool(flagged.ill_defined.all())
    assert max(flagged.iterations) < 200
    strict = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method="dense", ill_gap=ill_gap
    ).factors(IDS)
    assert bool(strict.ill_defined.all())
    assert not bool(dense.ill_defined.any())


@pytest.mark.parametrize("model_type", list(BATCH_ATOL))
def test_batched_documents_equal_one_at_a_time(tiny_model, model_type):
    model = tiny_model(model_type, dtype=F64, n_layers=2)
    parts = locate_model_parts(model)
    prompts = [IDS, IDS[:3], IDS[:1], IDS[4:]]
    atol = BATCH_ATOL[model_type]
    # The iterative route freezes each document once it converges: batch-independent.
    for method in ("dense", "krylov") if model_type == "gpt2" else ("dense",):
        engine = JacobianEngine(
            model,
            parts,
            pair_reduction=pair_reduction,
            k_max=K,
            method=method,
            swapped=True,
            docs_per_batch=3,
        )
        batched = engine.factors_batch(prompts)
        for prompt, got in zip(prompts, batched, strict=True):
            alone = engine.factors(prompt)
            assert got.method == alone.method
            torch.testing.assert_close(got.S, alone.S, rtol=atol, atol=0)
            for a, b in ((got.A, alone.A), (got.B, alone.B)):
                torch.testing.assert_close(
                    miscoupling(a, got.S), miscoupling(b, alone.S), rtol=0, atol=atol
                )


def _runner(model, metrics: str, args: str):
    pm = new_plugin_manager(load_entry_points=False)
    return GeometryRunner(model, make_selection(metrics, args, registry=get_registry(pm)), pm)


def test_runner_batch_equals_compute_sampled_and_reports_swapped(tiny_model):
    model = tiny_model("gpt2", dtype=F64, n_layers=3)
    runner = _runner(model, "coupling,coupling_swapped,alignment_ratio", "k=4,alignment_k=3")
    prompts = [IDS, IDS[:4], IDS[3:]]
    batched = runner.compute_sampled_batch(prompts)
    for prompt, doc in zip(prompts, batched, strict=True):
        (alone,) = runner.compute_sampled_batch([prompt], errors="raise")
        assert set(doc.values) == {"coupling", "coupling_swapped", "alignment_ratio"}
        for name, value in alone.values.items():
            assert math.isclose(doc.values[name], value, rel_tol=0, abs_tol=1e-10)
        assert doc.profiles["coupling_swapped"].shape == (3, 3)
        assert doc.profiles["jacobian_iterations"].tolist() == [0, 0, 0]
        assert doc.profiles["jacobian_ill_defined"].shape == (3,)
        assert doc.jacobian_methods == ["gram"] * 3
    # The swapped value is the paper's formula on the dense B.
    parts = locate_model_parts(model)
    dense = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=4, keep_dense=True
    ).factors(IDS)
    B = coupling_matrices_dense(dense.dense, dense.V, dense.U)  # swapped: V_m^T J^l U_m
    expected = coupling_score(miscoupling(B, dense.S[:, :4]))
    # Per-document values are reported in float32.
    assert math.isclose(batched[0].values["coupling_swapped"], float(expected), abs_tol=1e-6)


def _alibi_falcon(attn: str) -> transformers.PreTrainedModel:
    config = tiny_config("falcon", 512, d_model=32, n_layers=2, n_heads=4, alibi=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(F64).eval()


def _block_finite_difference(model, block, ids, h=1e-5):
    """d block(X)_n / d x_n - I by central differences, through the model's own block call."""
    seen = {}
    handle = block.register_forward_pre_hook(
        lambda m, a, k: seen.setdefault("call", (a, k)), with_kwargs=True
    )
    with torch.no_grad():
        model(ids[None], use_cache=False)
    handle.remove()
    args, kwargs = seen["call"]
    X = args[0] if args else kwargs.pop("hidden_states")
    rest = args[1:]
    n, d = X.shape[1] - 1, X.shape[2]

    def call(Y):
        out = block(Y, *rest, **kwargs) if args else block(hidden_states=Y, **kwargs)
        return (out[0] if isinstance(out, tuple) else out)[0, n]

    cols = []
    with torch.no_grad():
        for i in range(d):
            plus, minus = X.clone(), X.clone()
            plus[0, n, i] += h
            minus[0, n, i] -= h
            cols.append((call(plus) - call(minus)) / (2 * h))
    return torch.stack(cols, dim=1) - torch.eye(d, dtype=X.dtype)


def test_alibi_falcon_differentiates_the_function_the_model_runs():
    model = _alibi_falcon("sdpa")
    parts = locate_model_parts(model)
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K)
    J = engine.dense_jacobians(IDS)
    reference = _block_finite_difference(model, parts.blocks[1], IDS)
    scale = reference.abs().max()
    torch.testing.assert_close(J[1], reference, rtol=0, atol=1e-6 * float(scale))
    assert model.config._attn_implementation == "sdpa"
    assert all(math.isfinite(v) for v in engine.factors(IDS).S.flatten().tolist())


def test_replay_that_changes_the_function_is_refused():
    require_fixed("falcon attention fixed at construction")  # before it, no replay changes it
    model = _alibi_falcon("sdpa")
    parts = locate_model_parts(model)
    # transformers' eager ALiBi path adds the bias twice: a different function.
    engine = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, attn_implementation="eager"
    )
    with pytest.raises(JacobianMismatchError, match="differs from the model's own forward"):
        engine.factors(IDS)
    results = engine.factors_batch([IDS, IDS[:5]], errors="return")
    assert all(isinstance(r, JacobianMismatchError) for r in results)
    runner = _runner(model, "coupling", "k=4")
    runner._engine = engine
    assert all(isinstance(r, JacobianMismatchError) for r in runner.compute_sampled_batch([IDS]))


def _cuda_model(n_devices: int):
    config = tiny_config("llama", 512, d_model=64, n_layers=4, n_heads=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(torch.bfloat16).eval()
    if n_devices == 1:
        return model.to("cuda:0")
    dispatch_model = pytest.importorskip("accelerate").dispatch_model

    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "lm_head": 1, "model.norm": 1}
    device_map.update({f"model.layers.{i}": i * 2 // 4 for i in range(4)})
    return dispatch_model(model, device_map=device_map)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bfloat16_routes_agree():
    model = _cuda_model(1)
    parts = locate_model_parts(model)
    ids = IDS.cuda()
    dense = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=K, method="dense"
    ).factors(ids)
    assert dense.A.device.type == "cuda" and dense.A.dtype == torch.float32
    for method in ("gram", "krylov"):
        factors = JacobianEngine(
            model, parts, pair_reduction=pair_reduction, k_max=K, method=method
        ).factors(ids)
        if bool(factors.ill_defined.any()):
            continue
        torch.testing.assert_close(
            miscoupling(factors.A, factors.S), miscoupling(dense.A, dense.S), rtol=0, atol=1e-3
        )
    batched = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=K).factors_batch(
        [ids, ids[:5]]
    )
    torch.testing.assert_close(batched[0].A, dense.A, rtol=0, atol=1e-4)
    assert dense.peak_bytes > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_device_split_keeps_blocks_on_their_devices():
    split = _cuda_model(2)
    parts = locate_model_parts(split)
    devices = {next(b.parameters()).device for b in parts.blocks}
    assert len(devices) == 2
    factors = JacobianEngine(
        split, parts, pair_reduction=pair_reduction, k_max=K, swapped=True
    ).factors(IDS.cuda(0))
    single = _cuda_model(1)
    alone = JacobianEngine(
        single, locate_model_parts(single), pair_reduction=pair_reduction, k_max=K, swapped=True
    ).factors(IDS.cuda(0))
    torch.testing.assert_close(factors.A.cpu(), alone.A.cpu(), rtol=0, atol=1e-4)
    torch.testing.assert_close(factors.B.cpu(), alone.B.cpu(), rtol=0, atol=1e-4)
