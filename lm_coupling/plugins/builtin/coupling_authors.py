"""Built-in: the ICLR 2025 authors' six mis-coupling columns, as their released code computes them.

``iclr2025_miscoupling_k{10,30,50}_{trace,norm}`` (math:
``lm_coupling.metrics.coupling_authors``; Jacobians:
``lm_coupling.jacobian.authors``): per sampled document the L x L
matrix ``m_K(i, j) = || |U_{j,K}^T J_i V_{j,K}| - diag(s_{i,K}) ||_F / c`` from a
full SVD of every block's residual Jacobian at the last token, the last block
through the final norm, ``c`` the trace (l1) or the 2-norm of ``s_{i,K}``; the
document's value is the mean of the L x L entries (the diagonal included).
Lower is more coupled. Selecting any of the six computes all of them from the
same Jacobians (one full SVD per block), on the coupling sample
(``coupling_docs``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lm_coupling.plugins.builtin.coupling import DOCS
from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.specs import MetricSpec, ProfileSpec

if TYPE_CHECKING:
    from lm_coupling.states import GeometryStates

KS = (10, 30, 50)
NORMS = {"trace": "trace (l1) of s_K", "norm": "2-norm of s_K"}
NAMES = {(k, norm): f"iclr2025_miscoupling_k{k}_{norm}" for k in KS for norm in NORMS}
"""(K, normalisation) -> metric name."""


@hookimpl
def lmc_declare_metrics():
    """Declare the six columns."""
    return [
        MetricSpec(
            name,
            f"authors' mis-coupling m_K (K={k}, over the {NORMS[norm]}), mean of the L x L "
            "matrix, last block through the final norm (sugolov/coupling)",
            frozenset({"authors_jacobian"}),
            (DOCS,),
            (ProfileSpec(name, "matrix", f"mis-coupling K={k} ({norm})"),),
            sampled=True,
            higher_is_better=False,
            opt_in=True,
            label=f"authors' mis-coupling K={k} ({norm})",
        )
        for (k, norm), name in NAMES.items()
    ]


@hookimpl
def lmc_compute_batch(selected, states: GeometryStates):
    """The six matrices and their means for each sampled document (NaN elsewhere)."""
    wanted = {key: name for key, name in NAMES.items() if name in selected}
    if not wanted or not states.authors_jacobians:
        return None
    import torch

    from lm_coupling.metrics.coupling_authors import authors_miscoupling

    L = states.n_layers
    values = {name: [] for name in wanted.values()}
    profiles = {name: [] for name in wanted.values()}
    for J in states.authors_jacobians:
        matrices = authors_miscoupling(J, KS) if J is not None else {}
        for key, name in wanted.items():
            m = matrices.get(key, torch.full((L, L), math.nan)).double().cpu()
            values[name].append(m.mean())
            profiles[name].append(m)
    return {
        "values": {name: torch.stack(v) for name, v in values.items()},
        "profiles": {name: torch.stack(v) for name, v in profiles.items()},
    }
