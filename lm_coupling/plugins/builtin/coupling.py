"""Built-in coupling metrics: block coupling and the alignment ratio.

Both need the block Jacobians at the target position, so they run on the
coupling sample of documents (``coupling_docs``) only.
"""

from __future__ import annotations

import math

import torch

from lm_coupling.metrics.coupling import (
    alignment_ratio,
    coupling_matrices,
    coupling_score,
    miscoupling,
    spectral_gap,
)
from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.options import parse_bool, parse_doc_count, parse_k
from lm_coupling.plugins.specs import MetricSpec, OptionSpec, used_k
from lm_coupling.states import GeometryStates, JacobianFactors

DEFAULT_COUPLING_DOCS = 25
K = OptionSpec("k", 10, "singular vectors per block: an integer, or a fraction of d_model", parse_k)
NORM = OptionSpec(
    "norm",
    "l1",
    "mis-coupling normalisation: l1 (ICLR 2025 eq. 9), l2, offdiag (arXiv version)",
    choices=("l1", "l2", "offdiag"),
)
ABS = OptionSpec(
    "elementwise_abs",
    False,
    "compare |A| instead of A (what the authors' released code does)",
    parse_bool,
)
PAIRS = OptionSpec(
    "pairs",
    "offdiag",
    "layer pairs averaged: offdiag (l != l'), all (diagonal included), adjacent",
    choices=("offdiag", "all", "adjacent"),
)
DOCS = OptionSpec(
    "coupling_docs",
    DEFAULT_COUPLING_DOCS,
    "documents per task that get Jacobian metrics: a number, or all",
    parse_doc_count,
)
METHOD = OptionSpec(
    "jacobian_method",
    "auto",
    "Jacobian route: auto, dense (exact), randomized (matrix-free top-K)",
    choices=("auto", "dense", "randomized"),
)
ALIGNMENT_K = OptionSpec(
    "alignment_k", 30, "singular vectors for the alignment ratio (Picking paper: 30)", parse_k
)
_NEEDS = frozenset({"jacobian"})


@hookimpl
def lmc_declare_metrics():
    """Declare coupling and alignment_ratio."""
    shared = (DOCS, METHOD)
    return [
        MetricSpec(
            "coupling",
            "mean coupling 1 - m_K(l,l') of the blocks' top-K singular vectors at n",
            _NEEDS,
            (K, NORM, ABS, PAIRS, *shared),
            ("coupling", "singular_values", "spectral_gap"),
            matrices=("coupling",),
            k_option="k",
            sampled=True,
            higher_is_better=True,
        ),
        MetricSpec(
            "alignment_ratio",
            "mean |off-diagonal| / mean |diagonal| of the coupling matrices (K=30)",
            _NEEDS,
            (ALIGNMENT_K, *shared),
            ("alignment_ratio",),
            matrices=("alignment_ratio",),
            k_option="alignment_k",
            sampled=True,
            higher_is_better=False,
        ),
    ]


def clamped_k(k: int | float, d_model: int) -> int:
    """K for a model of width ``d_model``: an integer K is capped at d_model - 1.

    One less than the width leaves ``s_{K+1}`` for the spectral gap; a small
    model is then measured with every singular vector but one, rather than
    failing.
    """
    return used_k(k, d_model)


def jacobian_k_max(options, d_model: int) -> int:
    """Largest K the selected coupling metrics need (at most d_model - 1)."""
    wanted = [clamped_k(options.get("k", K.default), d_model)]
    if "alignment_k" in options:
        wanted.append(clamped_k(options["alignment_k"], d_model))
    return max(wanted)


def _coupling_one(factors: JacobianFactors, options, d_model: int) -> dict[str, torch.Tensor]:
    k = min(clamped_k(options["k"], d_model), factors.U.shape[-1])
    A = coupling_matrices(factors.U[..., :k], factors.JV[..., :k])
    m = miscoupling(
        A, factors.S[:, :k], norm=options["norm"], elementwise_abs=options["elementwise_abs"]
    )
    gap = spectral_gap(factors.S, k) if factors.S.shape[1] > k else factors.spectral_gap
    return {
        "coupling": coupling_score(m, pairs=options["pairs"]),
        "coupling_matrix": 1 - m,
        "singular_values": factors.S[:, : k + 1],
        "spectral_gap": gap,
    }


def _alignment_one(factors: JacobianFactors, options, d_model: int) -> torch.Tensor:
    k = min(clamped_k(options["alignment_k"], d_model), factors.U.shape[-1])
    return alignment_ratio(coupling_matrices(factors.U[..., :k], factors.JV[..., :k]))


def _offdiag_mean(matrix: torch.Tensor) -> torch.Tensor:
    off = ~torch.eye(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    return matrix[off].mean() if off.any() else torch.tensor(math.nan)


@hookimpl
def lmc_compute_batch(selected, states: GeometryStates, options):
    """Coupling and alignment ratio of each sampled document (NaN elsewhere)."""
    wanted = {"coupling", "alignment_ratio"} & set(selected)
    if not wanted or not states.jacobians:
        return None
    L, d = states.n_layers, states.d_model
    rows = {
        name: []
        for name in (
            "coupling",
            "coupling_matrix",
            "singular_values",
            "spectral_gap",
            "alignment_ratio",
            "alignment_matrix",
        )
    }
    k = clamped_k(options.get("k", K.default), d)
    for factors in states.jacobians:
        nan_matrix = torch.full((L, L), math.nan)
        if "coupling" in wanted:
            one = _coupling_one(factors, options, d) if factors is not None else None
            rows["coupling"].append(one["coupling"].cpu() if one else torch.tensor(math.nan))
            rows["coupling_matrix"].append(one["coupling_matrix"].cpu() if one else nan_matrix)
            sv = one["singular_values"].cpu() if one else torch.full((L, k + 1), math.nan)
            rows["singular_values"].append(sv)
            gap = one["spectral_gap"].cpu() if one else torch.full((L,), math.nan)
            rows["spectral_gap"].append(gap)
        if "alignment_ratio" in wanted:
            ratio = _alignment_one(factors, options, d).cpu() if factors is not None else nan_matrix
            rows["alignment_matrix"].append(ratio)
            rows["alignment_ratio"].append(_offdiag_mean(ratio))
    values, profiles = {}, {}
    if "coupling" in wanted:
        values["coupling"] = torch.stack(rows["coupling"]).float()
        profiles["coupling"] = torch.stack(rows["coupling_matrix"]).float()
        profiles["singular_values"] = _stack_ragged(rows["singular_values"])
        profiles["spectral_gap"] = torch.stack(rows["spectral_gap"]).float()
    if "alignment_ratio" in wanted:
        values["alignment_ratio"] = torch.stack(rows["alignment_ratio"]).float()
        profiles["alignment_ratio"] = torch.stack(rows["alignment_matrix"]).float()
    return {"values": values, "profiles": profiles}


def _stack_ragged(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack ``[L, k_i]`` rows, NaN-padding to the widest."""
    width = max(r.shape[1] for r in rows)
    out = torch.full((len(rows), rows[0].shape[0], width), math.nan)
    for i, r in enumerate(rows):
        out[i, :, : r.shape[1]] = r
    return out
