"""Hook specifications of lm-coupling metric plugins.

Hooks are called with keyword arguments; an implementation takes only the
arguments it uses, so specifications can grow without breaking plugins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lm_coupling.plugins.markers import hookspec
from lm_coupling.plugins.specs import JacobianRequest, MetricSpec

if TYPE_CHECKING:  # annotations only: declaring plugins loads no torch
    import torch

    from lm_coupling.geometry import DocumentGeometry
    from lm_coupling.states import GeometryStates


@hookspec
def lmc_declare_metrics() -> Sequence[MetricSpec]:
    """Declare the metrics this plugin provides.

    Called once, when the plugin manager is built. Not firstresult: every
    plugin answers. A name claimed by two plugins is an error naming both.

    Returns:
        The plugin's metric specifications.
    """


@hookspec
def lmc_compute_batch(
    selected: Sequence[str], states: GeometryStates, options: Mapping[str, Any]
) -> Mapping[str, Mapping[str, torch.Tensor]] | None:
    """Compute per-document values for one batch of documents.

    Called after each captured forward pass (for the rows of lm-eval's batch
    that are documents), and once per batch of sampled documents for metrics
    that need Jacobians (``states.jacobians`` holds one entry per document,
    None outside the sample). Not firstresult: results are merged.

    Args:
        selected: every metric name the user selected (a plugin computes
            only the names it owns).
        states: what capture kept for the batch of B documents.
        options: parsed ``--metric_args`` with defaults filled in.

    Returns:
        ``{"values": {name: [B] tensor}, "profiles": {name: [B, ...] tensor}}``:
        each selected metric name the plugin owns mapped to its per-document
        values (NaN for degenerate documents), and each declared profile to
        its per-document profiles (per-layer vectors, L x L matrices); or None
        when the plugin owns none of the selected metrics.
    """


@hookspec
def lmc_aggregate_task(
    selected: Sequence[str],
    profiles: Mapping[str, Any],
    options: Mapping[str, Any],
    documents: Sequence[DocumentGeometry],
) -> Mapping[str, Any] | None:
    """Write the plugin's own sections of a task's geometry file.

    Called once per task when the run ends, after the common aggregation
    (mean, stderr and n of every declared profile). Not firstresult: the
    returned mappings are merged into the file's top level, so a plugin owns
    the keys it returns (the built-in coupling plugin writes ``"coupling"``).

    Args:
        selected: every selected metric name.
        profiles: the task's aggregated profiles, ``{name: {"mean", "stderr", "n"}}``.
        options: parsed ``--metric_args`` as used on the model (each K capped
            to what the model's width allows).
        documents: the task's scored documents (their values, profiles and,
            for sampled documents, the Jacobian route per layer).

    Returns:
        Extra top-level entries for the geometry file, or None.
    """


@hookspec
def lmc_jacobian_request(
    selected: Sequence[str], options: Mapping[str, Any], d_model: int
) -> JacobianRequest | None:
    """Ask the Jacobian engine for block Jacobian factors at the target position.

    Called once per run, when the engine is built, if a selected metric needs
    ``jacobian``. Not firstresult: the engine serves the union of the
    requests (the largest K, the swapped matrix if any request wants it; the
    routes must agree). The factors reach ``lmc_compute_batch`` as
    ``states.jacobians`` (`lm_coupling.states.JacobianFactors`).

    Args:
        selected: every selected metric name (answer only for your own).
        options: parsed ``--metric_args``.
        d_model: the model's width (resolve a fractional K with
            `lm_coupling.plugins.specs.used_k`).

    Returns:
        A `JacobianRequest`, or None when none of the plugin's metrics is selected.
    """


@hookspec
def lmc_position_jacobian_keys(
    selected: Sequence[str], options: Mapping[str, Any], n_layers: int, n_tokens: int
) -> Sequence[tuple[int, int, int]] | None:
    """Ask for Jacobians between positions of a sampled document.

    Called once per sampled document when a selected metric needs
    ``tokenwise_jacobian``. The union of the answers is computed
    (``JacobianEngine.position_jacobian``) and handed to
    ``lmc_compute_batch`` as ``states.tokenwise[0]``, a mapping
    ``{(layer, t_in, t_out): [d, d] tensor}``. Not firstresult.

    Args:
        selected: every selected metric name.
        options: parsed ``--metric_args``.
        n_layers: the model's number of blocks L.
        n_tokens: the prompt's length T (positions 0..T-1, n = T - 1).

    Returns:
        ``(layer, t_in, t_out)`` keys with ``0 <= t_in <= t_out < T``, or None.
    """
