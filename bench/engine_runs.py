"""The Jacobian engine's routes and the authors' route, on random models, for the bench scripts.

One document's coupling cost is what the ``coupling`` metric pays per sampled
document: ``JacobianEngine.factors`` on every block, then the L x L coupling
matrix ``1 - m_K`` from the factors. The authors' route (Aubry et al., ICLR
2025, released code) builds each block Jacobian with d backward passes through
the whole sequence, takes a full SVD and the coupling matrix from the dense
Jacobians.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import transformers
from tiny_models import tiny_config

from lm_coupling.jacobian.config import METHODS, JacobianConfig
from lm_coupling.jacobian.engine import JacobianEngine, naive_block_jacobians
from lm_coupling.metrics.coupling import coupling_matrices_dense, miscoupling
from lm_coupling.model.architecture import ModelParts, locate_model_parts
from lm_coupling.plugins.builtin.coupling import pair_reduction

LLAMA_7B = {"d_model": 4096, "d_ff": 11008, "n_heads": 32, "n_layers": 32}
GPT2_SMALL = {"d_model": 768, "d_ff": 3072, "n_heads": 12, "n_layers": 12}


def engine_routes() -> tuple[str, ...]:
    """Every ``method=`` the engine offers (``jacobian.config.METHODS``)."""
    return METHODS


def default_route() -> str:
    """The engine's default ``method`` (what ``--metrics coupling`` uses unless told)."""
    return JacobianConfig.__dataclass_fields__["method"].default


def build_random_model(
    model_type: str,
    *,
    vocab: int,
    max_len: int,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
    **sizes,
) -> tuple[transformers.PreTrainedModel, ModelParts]:
    """A seeded random causal LM built directly on ``device`` in ``dtype``, and its parts.

    Args:
        model_type: ``gpt2``, ``llama``, ``gpt_neox``, ... (``tests/fixtures/tiny.py``).
        vocab: vocabulary size.
        max_len: largest prompt length.
        device: where the weights are created.
        dtype: weight dtype (the engine computes in float32 whatever it is).
        seed: torch seed of the initialisation.
        **sizes: ``d_model``, ``n_layers``, ``n_heads``, ``d_ff``.
    """
    config = tiny_config(model_type, vocab, max_len=max(max_len, 128), **sizes)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, locate_model_parts(model)


def random_prompt(vocab: int, tokens: int, device: str, seed: int = 0) -> torch.Tensor:
    """``[tokens]`` seeded random token ids on ``device``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (tokens,), generator=generator).to(device)


def coupling_of(factors, k: int) -> torch.Tensor:
    """The ``[L, L]`` mis-coupling ``m_K`` from the engine's factors, as the metric computes it."""
    return miscoupling(factors.A[..., :k, :k], factors.S[:, :k])


def engine_coupling(model, parts, ids, k: int, method: str, seed: int = 0):
    """One document's coupling by the engine's ``method``: ``(m_K [L, L], factors)``."""
    engine = JacobianEngine(
        model, parts, pair_reduction=pair_reduction, k_max=k, method=method, seed=seed
    )
    factors = engine.factors(ids)
    return coupling_of(factors, k), factors


def engine_coupling_batch(model, parts, prompts: list[torch.Tensor], k: int, method: str):
    """Several documents' coupling in the engine's batched passes: ``m_K`` of each, in order."""
    engine = JacobianEngine(model, parts, pair_reduction=pair_reduction, k_max=k, method=method)
    return [coupling_of(factors, k) for factors in engine.factors_batch(prompts)]


def authors_coupling(model, parts, ids, k: int, layers: int | None = None) -> torch.Tensor:
    """The authors' route on the first ``layers`` blocks: d backward passes, full SVD, dense A.

    Returns:
        ``[layers, layers]`` mis-coupling matrix ``m_K`` of those blocks.
    """
    if layers is not None:
        parts = dataclasses.replace(parts, blocks=parts.blocks[:layers])
    J = naive_block_jacobians(model, parts, ids)
    U_full, S_full, Vh = torch.linalg.svd(J)
    U, V = U_full[..., :k], Vh[..., :k, :].transpose(-2, -1)
    return miscoupling(coupling_matrices_dense(J, U, V), S_full[:, :k])


def route_summary(factors) -> str:
    """The per-layer routes the engine took, e.g. ``gram x2 krylov x30 (ill-defined 1)``."""
    counts = collections.Counter(factors.method)
    text = " ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
    ill = getattr(factors, "ill_defined", None)
    if ill is not None and bool(ill.any()):
        text += f" (ill-defined {int(ill.sum())})"
    return text


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` on the common top-left block (NaN when either is not finite)."""
    n = min(a.shape[0], b.shape[0])
    return float((a[:n, :n].double().cpu() - b[:n, :n].double().cpu()).abs().max())
