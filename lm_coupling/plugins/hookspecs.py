"""Hook specifications of lm-coupling metric plugins (the contract: docs/plugins.md).

Hooks are called with keyword arguments; an implementation takes only the
arguments it uses, so specifications can grow without breaking plugins. The
per-batch hooks are called for each plugin on its own, for the plugins owning
a metric being computed; every answer is checked against its declaration, and
a failure makes only that plugin's metrics NaN on the documents it failed on.
A metric of the states at the measured token needs none of these hooks: it is
one function declared with ``lm_coupling.metric`` (`lm_coupling.plugins.short`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_coupling.plugins.markers import hookspec
from lm_coupling.plugins.specs import JacobianRequest, MetricSpec

if TYPE_CHECKING:  # annotations only: declaring plugins loads no torch
    import torch

    from lm_coupling.model.architecture import ModelParts
    from lm_coupling.states import BatchInfo, DocumentGeometry, GeometryStates, LayerReducer, Lens


@hookspec
def lmc_declare_metrics() -> Sequence[MetricSpec]:
    """Declare the plugin's metrics (once, when the manager is built; every plugin answers).

    Returns:
        The plugin's `MetricSpec` records; a name claimed by two plugins is an error.
    """


@hookspec
def lmc_layer_reducer(
    selected: Sequence[str], options: Mapping[str, Any], batch: BatchInfo
) -> LayerReducer | None:
    """Start a reducer of one batch's streamed states (per plugin with a streamed metric).

    Its ``update(view)`` receives ``x^0 .. x^L`` one `LayerView` at a time, its
    optional ``update_lens(logits [B, L+1, V])`` the lens logits of every
    state, and what its ``finalize()`` returns reaches this plugin's
    ``lmc_compute_batch`` as ``reduced``.

    Args:
        selected: the plugin's metrics being computed.
        options: parsed ``--metric_args``.
        batch: the batch's shape, token mask, target tokens, lens and documents.

    Returns:
        A `LayerReducer`, or None.
    """


@hookspec
def lmc_lens(
    selected: Sequence[str], options: Mapping[str, Any], model: torch.nn.Module, parts: ModelParts
) -> Lens | None:
    """Add a lens beside the built-in logit lens, under the lens's own ``name``.

    Called once per run if a selected metric needs ``lens``. The metrics that
    read it name it (``MetricSpec.lens``); two lenses of one name are a
    ``ConfigurationError``.

    Args:
        selected: every selected metric name.
        options: parsed ``--metric_args``.
        model: the measured model.
        parts: its located parts (``final_norm_fp32``, ``unembed_fp32``).

    Returns:
        A `Lens` (``name``, ``logits(layer, hidden [B, d]) -> [B, V]``), or None.
    """


@hookspec
def lmc_compute_batch(
    selected: Sequence[str],
    states: GeometryStates,
    options: Mapping[str, Any],
    reduced: Any,
) -> Mapping[str, Mapping[str, torch.Tensor]] | None:
    """Per-document values of a captured batch, or of sampled documents (engine products).

    Args:
        selected: the plugin's metrics being computed.
        states: the batch's size, documents and the engine's products.
        options: parsed ``--metric_args`` with defaults filled in.
        reduced: what this plugin's reducer's ``finalize()`` returned (None
            without a reducer, and on sampled batches).

    Returns:
        ``{"values": {name: [B]}, "profiles": {name: [B, ...]}, "summaries":
        {name: [B, ...]}}`` (NaN where a value is undefined; summaries are
        kept for ``lmc_aggregate_task``, never written), or None.
    """


@hookspec
def lmc_aggregate_task(
    selected: Sequence[str],
    profiles: Mapping[str, Any],
    options: Mapping[str, Any],
    documents: Sequence[DocumentGeometry],
    task: str,
    doc_ids: Sequence[int],
    output_dir: Path | None,
    run_id: str,
) -> Mapping[str, Any] | None:
    """The plugin's own top-level sections of a task's geometry file (once per task, at the end).

    Args:
        selected: every selected metric name.
        profiles: the task's aggregated profiles, ``{name: {"mean", "stderr", "n"}}``.
        options: parsed ``--metric_args`` as used (each K capped to the model's width).
        documents: the task's sampled documents whole, and of every other
            document its plugin ``summaries`` alone.
        task: the task's name.
        doc_ids: lm-eval's ``doc_id`` of each of ``documents``.
        output_dir: the geometry file's folder (None without ``--output_path``).
        run_id: the timestamp of the run's file names.

    Returns:
        Sections to merge into the file (a task-level metric's holds its
        ``"value"`` and ``"n"``), or None.
    """


@hookspec
def lmc_complete_task(
    selected: Sequence[str],
    options: Mapping[str, Any],
    documents: Sequence[DocumentGeometry],
    task: str,
    doc_ids: Sequence[int],
    parts: ModelParts,
) -> Mapping[str, Mapping[str, Any]] | None:
    """The deferred metrics' values once a task is measured, before lm-eval scores it.

    Args:
        selected: the plugin's deferred metrics among those being computed.
        options: parsed ``--metric_args``.
        documents: every measured document of the task (the plugin may delete
            its own summaries once used).
        task: the task's name.
        doc_ids: lm-eval's ``doc_id`` of each of ``documents``.
        parts: the model's located parts.

    Returns:
        ``{"values": {name: [N]}, "profiles": {name: [N, ...]}}`` in the order
        of ``documents`` (checked as ``lmc_compute_batch``'s), or None.
    """


@hookspec
def lmc_jacobian_request(
    selected: Sequence[str], options: Mapping[str, Any], d_model: int
) -> JacobianRequest | None:
    """What the Jacobian engine computes for this plugin (the engine serves the union).

    For the ``lens_jacobian`` need it is also asked before the lens's fit
    terms are computed (`JacobianRequest.lens_terms`).

    Args:
        selected: every selected metric name (answer only for your own).
        options: parsed ``--metric_args``.
        d_model: the model's width (resolve a fractional K with `used_k`).

    Returns:
        A `JacobianRequest`, or None.
    """


@hookspec
def lmc_position_jacobian_keys(
    selected: Sequence[str], options: Mapping[str, Any], n_layers: int, n_tokens: int
) -> Sequence[tuple[int, int, int]] | None:
    """Jacobians between positions of a sampled document (``states.tokenwise``).

    Args:
        selected: every selected metric name.
        options: parsed ``--metric_args``.
        n_layers: L.
        n_tokens: the prompt's length T.

    Returns:
        ``(layer, t_in, t_out)`` keys with ``0 <= t_in <= t_out < T``, or None.
    """
