"""Hook specifications of lm-coupling metric plugins.

Hooks are called with keyword arguments; an implementation takes only the
arguments it uses, so specifications can grow without breaking plugins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lm_coupling.plugins.markers import hookspec
from lm_coupling.plugins.specs import MetricSpec
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

    Called after each captured forward pass (and once per sampled document
    for metrics that need Jacobians). Not firstresult: results are merged.

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
    selected: Sequence[str], profiles: Mapping[str, Any], options: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """Add per-task records to the geometry file.

    Called once per task when the run's geometry files are written, after
    the built-in aggregation (mean, stderr and n of every profile). Not
    firstresult: the returned mappings are merged into the file.

    Args:
        selected: every selected metric name.
        profiles: the task's aggregated profiles and any per-task extras the
            capture kept (e.g. ``"jacobian_records"``).
        options: parsed ``--metric_args``.

    Returns:
        Extra top-level entries for the geometry file, or None.
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
