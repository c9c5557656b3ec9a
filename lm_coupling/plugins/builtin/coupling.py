"""Built-in coupling metrics: block coupling, swapped coupling and the alignment ratio.

All need the block Jacobians at the target position, so they run on the
coupling sample of documents (``coupling_docs``) only.

- ``coupling``: ``1 - m_K`` of ``A^{l,l'} = U_{l'}^T J^l V_{l'}`` (ICLR 2025 eq. 9).
- ``coupling_swapped`` (opt-in): the same score of the swapped matrices
  ``B^{l,l'} = V_{l'}^T J^l U_{l'}`` (left and right singular vectors
  exchanged, the paper's second comparison), with its own L x L matrix; same
  options as ``coupling``. Selecting it makes the engine compute B as well.
- ``alignment_ratio``: mean |off-diagonal| / mean |diagonal| of A at K = 30.

Per layer the coupling profiles also carry the engine's diagnostics
(``jacobian_iterations``, ``jacobian_residual``, ``jacobian_ill_defined``).
The plugin hands the engine its pair reduction (``U_m^T J^l V_m``) through
``lmc_jacobian_request`` and writes the geometry file's ``coupling`` section
through ``lmc_aggregate_task``, as a third-party plugin would.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.options import (
    parse_bool,
    parse_doc_count,
    parse_k,
    parse_optional_float,
    parse_optional_int,
)
from lm_coupling.plugins.specs import (
    UNIT_INTERVAL,
    JacobianRequest,
    MetricSpec,
    OptionSpec,
    ProfileSpec,
    used_k,
)

if TYPE_CHECKING:
    import torch

    from lm_coupling.states import GeometryStates, JacobianFactors

OWN = ("coupling", "coupling_swapped", "alignment_ratio")
"""The metrics this plugin computes."""

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
K_SELECT = OptionSpec(
    "k_select",
    "fixed",
    "fixed (K = k, the paper's) or largest_gap (per document, the K in [k_min, k] where the "
    "smallest s_K/s_K+1 over blocks is largest: a subspace the spectrum determines)",
    choices=("fixed", "largest_gap"),
)
K_MIN = OptionSpec("k_min", 2, "smallest K that k_select=largest_gap considers", int)


def _min_gap(text: str) -> float:
    value = float(text)
    if not value >= 1:
        raise ValueError("a ratio s_K/s_K+1 >= 1 is needed (1: the numerical flag alone)")
    return value


MIN_GAP = OptionSpec(
    "subspace_min_gap",
    1.05,
    "a block whose s_K/s_K+1 is below this is flagged ill-defined (docs/metrics.md)",
    _min_gap,
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
    "Jacobian route: auto, dense (exact), gram (exact, J^T J eigensolver), krylov "
    "(matrix-free, to tolerance)",
    choices=("auto", "dense", "gram", "krylov"),
    method_only=True,
)
# The engine's settings a user could want (lm_coupling.jacobian.config.JacobianConfig),
# each as a jacobian_<field> option; None lets the engine choose.
ENGINE_OPTIONS = (
    OptionSpec(
        "jacobian_tol",
        None,
        "accuracy target of the iterative routes (none: 1e-5 in float32, 1e-9 in float64)",
        parse_optional_float,
        method_only=True,
    ),
    OptionSpec(
        "jacobian_max_iters",
        None,
        "iteration budget of the iterative routes (none: the engine's)",
        parse_optional_int,
        method_only=True,
    ),
    OptionSpec(
        "jacobian_ill_gap",
        1e-3,
        "singular values closer than this times s_1 make a layer ill-defined (flagged)",
        float,
        method_only=True,
    ),
    OptionSpec(
        "jacobian_check",
        True,
        "check every replayed block against the model's own output (false: not advised)",
        parse_bool,
        method_only=True,
    ),
    OptionSpec(
        "jacobian_seed", 0, "seed of the iterative routes' start blocks", int, method_only=True
    ),
    OptionSpec(
        "jacobian_docs_per_batch",
        None,
        "documents per batched engine pass (none: from free GPU memory; one on a CPU)",
        parse_optional_int,
        method_only=True,
    ),
    OptionSpec(
        "jacobian_chunk_size",
        None,
        "tangents per vectorized product batch (none: from a memory budget)",
        parse_optional_int,
        method_only=True,
    ),
    OptionSpec(
        "jacobian_keep_bytes",
        None,
        "bytes of dense Jacobians kept between the engine's passes (none: 1 GiB on CPU, "
        "a quarter of free memory on a GPU)",
        parse_optional_int,
        method_only=True,
    ),
)
ALIGNMENT_K = OptionSpec(
    "alignment_k", 30, "singular vectors for the alignment ratio (Picking paper: 30)", parse_k
)
_NEEDS = frozenset({"jacobian"})


DIAGNOSTICS = ("jacobian_iterations", "jacobian_residual", "jacobian_ill_defined")
"""Per-layer engine diagnostics stored with the coupling profiles."""

_COUPLING_PROFILES = (
    ProfileSpec("coupling", "matrix", "coupling c_K(l, l')", UNIT_INTERVAL),
    ProfileSpec(
        "singular_values",
        "blocks",
        "top singular values s_1..s_{K+1} of J^l",
        axes=("blocks", None),
    ),
    ProfileSpec("spectral_gap", "blocks", "spectral gap s_K / s_{K+1}"),
    ProfileSpec("k_selected", "blocks", "K used (k_select)", plot=False),
    *(ProfileSpec(name, "blocks", name.replace("_", " "), plot=False) for name in DIAGNOSTICS),
)


@hookimpl
def lmc_declare_metrics():
    """Declare coupling, coupling_swapped and alignment_ratio."""
    shared = (DOCS, METHOD, *ENGINE_OPTIONS)
    return [
        MetricSpec(
            "coupling",
            "mean coupling 1 - m_K(l,l') of the blocks' top-K singular vectors at n",
            _NEEDS,
            (K, NORM, ABS, PAIRS, K_SELECT, K_MIN, MIN_GAP, *shared),
            _COUPLING_PROFILES,
            k_option="k",
            sampled=True,
            higher_is_better=True,
            label="coupling 1 - m_K",
            bounds=UNIT_INTERVAL,
            primary=True,
        ),
        MetricSpec(
            "coupling_swapped",
            "mean coupling 1 - m_K(l,l') of B = V_l'^T J^l U_l' (singular vectors swapped)",
            _NEEDS,
            (K, NORM, ABS, PAIRS, *shared),
            (ProfileSpec("coupling_swapped", "matrix", "swapped coupling", UNIT_INTERVAL),),
            k_option="k",
            sampled=True,
            higher_is_better=True,
            opt_in=True,
            label="swapped coupling 1 - m_K(B)",
            bounds=UNIT_INTERVAL,
        ),
        MetricSpec(
            "alignment_ratio",
            "mean |off-diagonal| / mean |diagonal| of the coupling matrices (K=30)",
            _NEEDS,
            (ALIGNMENT_K, *shared),
            (ProfileSpec("alignment_ratio", "matrix", "alignment ratio"),),
            k_option="alignment_k",
            sampled=True,
            higher_is_better=False,
            label="alignment ratio",
        ),
    ]


@hookimpl
def lmc_jacobian_request(selected, options, d_model: int) -> JacobianRequest | None:
    """Factors with the largest K the selected coupling metrics read.

    K follows `used_k` (an integer K capped at d_model - 1, which leaves
    ``s_{K+1}`` for the spectral gap; a fraction of d_model rounded down).
    """
    wanted = set(OWN) & set(selected)
    if not wanted:
        return None
    ks = []
    if wanted & {"coupling", "coupling_swapped"}:
        ks.append(used_k(options.get("k", K.default), d_model))
    if "alignment_ratio" in wanted:
        ks.append(used_k(options.get("alignment_k", ALIGNMENT_K.default), d_model))
    return JacobianRequest(
        k=max(ks),
        swapped="coupling_swapped" in wanted,
        method=options.get("jacobian_method", METHOD.default),
        pair_reduction=pair_reduction,
        settings={
            spec.name.removeprefix("jacobian_"): options[spec.name]
            for spec in ENGINE_OPTIONS
            if spec.name in options
        },
    )


def pair_reduction(left: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
    """The coupling matrices of one block l, handed to the engine (``JacobianRequest``).

    ``A[b, m] = left_m^T (J^l right_m)``: with ``left = U``, ``right = V`` the
    coupling matrices ``U_m^T J^l V_m``; exchanged, the swapped ``V_m^T J^l U_m``
    (``metrics.coupling.coupling_matrices``).

    Args:
        left: ``[B, M, d, K]`` singular vectors of M blocks m.
        products: ``[B, M, d, K]`` ``J^l right_m`` for the same blocks.

    Returns:
        ``[B, M, K, K]``.
    """
    from lm_coupling.metrics.coupling import coupling_matrices

    return coupling_matrices(left, products[:, None])[:, 0]


@hookimpl
def lmc_aggregate_task(selected, profiles, options, documents) -> dict[str, Any] | None:
    """The geometry file's ``coupling`` section: options, sample size, spectra, routes.

    Per layer: the most common Jacobian route over the sampled documents, the
    mean iterations and residual, and whether the layer was ill-defined in any
    of them (see ``lm_coupling.jacobian.engine``).
    """
    if "coupling" not in selected:
        return None
    methods = [doc.jacobian_methods for doc in documents if doc.jacobian_methods]
    per_layer = [Counter(layer).most_common(1)[0][0] for layer in zip(*methods, strict=False)]
    n_sampled = sum(math.isfinite(doc.values.get("coupling", math.nan)) for doc in documents)
    return {
        "coupling": {
            "k": options["k"],
            "norm": options["norm"],
            "elementwise_abs": options["elementwise_abs"],
            "pairs": options["pairs"],
            "k_select": options.get("k_select", "fixed"),
            "k_selected": profiles.get("k_selected", {}).get("mean"),
            "n_sampled": int(n_sampled),
            "singular_values": profiles.get("singular_values", {}).get("mean"),
            "spectral_gap": profiles.get("spectral_gap", {}).get("mean"),
            "method": per_layer,
            "route": per_layer,
            "iterations": profiles.get("jacobian_iterations", {}).get("mean"),
            "residual": profiles.get("jacobian_residual", {}).get("mean"),
            "subspace_min_gap": options.get("subspace_min_gap"),
            "ill_defined": [
                None if v is None else bool(v > 0)
                for v in profiles.get("jacobian_ill_defined", {}).get("mean") or []
            ],
        }
    }


def _score(M: torch.Tensor, S: torch.Tensor, options) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coupling score, [L, L] coupling matrix 1 - m)`` of K x K matrices M."""
    from lm_coupling.metrics.coupling import coupling_score, miscoupling

    m = miscoupling(M, S, norm=options["norm"], elementwise_abs=options["elementwise_abs"])
    return coupling_score(m, pairs=options["pairs"]), 1 - m


def _coupling_one(factors: JacobianFactors, options, d_model: int) -> dict[str, torch.Tensor]:
    import torch

    from lm_coupling.metrics.coupling import (
        SUBSPACE_MIN_GAP,
        spectral_gap,
        subspace_ill_defined,
    )

    k = min(used_k(options["k"], d_model), factors.U.shape[-1])
    if options.get("k_select", "fixed") == "largest_gap" and factors.S.shape[1] > k:
        from lm_coupling.metrics.coupling import largest_gap_k

        k = largest_gap_k(factors.S, min(max(1, options.get("k_min", 2)), k), k)
    score, matrix = _score(factors.A[..., :k, :k], factors.S[:, :k], options)
    gap = spectral_gap(factors.S, k) if factors.S.shape[1] > k else factors.spectral_gap
    out = {
        "coupling": score,
        "coupling_matrix": matrix,
        "singular_values": factors.S[:, : k + 1],
        "spectral_gap": gap,
        "k_selected": torch.full((factors.S.shape[0],), float(k), dtype=torch.float64),
        "jacobian_iterations": torch.tensor(factors.iterations, dtype=torch.float64),
        "jacobian_residual": factors.residual.detach().to("cpu", torch.float64),
        "jacobian_ill_defined": subspace_ill_defined(
            gap, factors.ill_defined, options.get("subspace_min_gap", SUBSPACE_MIN_GAP)
        ),
    }
    if factors.B is not None:
        out["swapped"], out["swapped_matrix"] = _score(
            factors.B[..., :k, :k], factors.S[:, :k], options
        )
    return out


def _offdiag_mean(matrix: torch.Tensor) -> torch.Tensor:
    import torch

    off = ~torch.eye(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    return matrix[off].mean() if off.any() else torch.tensor(math.nan)


def _coupling_rows(jacobians, options, L: int, d: int) -> dict[str, list]:
    """Per-document coupling values and profiles (NaN for documents outside the sample)."""
    import torch

    k = used_k(options.get("k", K.default), d)
    blank = {
        "coupling": torch.tensor(math.nan),
        "coupling_matrix": torch.full((L, L), math.nan),
        "singular_values": torch.full((L, k + 1), math.nan),
        "spectral_gap": torch.full((L,), math.nan),
        "k_selected": torch.full((L,), math.nan),
        "swapped": torch.tensor(math.nan),
        "swapped_matrix": torch.full((L, L), math.nan),
        **{name: torch.full((L,), math.nan) for name in DIAGNOSTICS},
    }
    rows: dict[str, list] = {name: [] for name in blank}
    for factors in jacobians:
        one = _coupling_one(factors, options, d) if factors is not None else {}
        for name, empty in blank.items():
            rows[name].append(one[name].detach().cpu() if name in one else empty)
    return rows


@hookimpl
def lmc_compute_batch(selected, states: GeometryStates, options):
    """Coupling, swapped coupling and alignment ratio of each sampled document (NaN elsewhere)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    wanted = set(OWN) & set(selected)
    if not wanted or not states.jacobians:
        return None
    L, d = states.n_layers, states.d_model
    values, profiles = {}, {}
    if wanted & {"coupling", "coupling_swapped"}:
        rows = _coupling_rows(states.jacobians, options, L, d)
        if "coupling" in wanted:
            values["coupling"] = torch.stack(rows["coupling"]).float()
            profiles["coupling"] = torch.stack(rows["coupling_matrix"]).float()
            ragged = [row.T.float() for row in rows["singular_values"]]  # [k_i + 1, L] each
            profiles["singular_values"] = pad_sequence(
                ragged, batch_first=True, padding_value=math.nan
            ).transpose(1, 2)  # NaN-padded to the widest k_i + 1
            profiles["spectral_gap"] = torch.stack(rows["spectral_gap"]).float()
            profiles["k_selected"] = torch.stack(rows["k_selected"]).double()
            for name in DIAGNOSTICS:
                profiles[name] = torch.stack(rows[name]).double()
        if "coupling_swapped" in wanted:
            values["coupling_swapped"] = torch.stack(rows["swapped"]).float()
            profiles["coupling_swapped"] = torch.stack(rows["swapped_matrix"]).float()
    if "alignment_ratio" in wanted:
        from lm_coupling.metrics.coupling import alignment_ratio

        k = used_k(options["alignment_k"], d)
        matrices = [
            alignment_ratio(f.A[..., :k, :k]).cpu()
            if f is not None
            else torch.full((L, L), math.nan)
            for f in states.jacobians
        ]
        values["alignment_ratio"] = torch.stack([_offdiag_mean(m) for m in matrices]).float()
        profiles["alignment_ratio"] = torch.stack(matrices).float()
    return {"values": values, "profiles": profiles}
