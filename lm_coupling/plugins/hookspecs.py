"""Hook specifications of lm-coupling metric plugins.

Hooks are called with keyword arguments; an implementation takes only the
arguments it uses, so specifications can grow without breaking plugins.

The per-batch hooks (``lmc_layer_reducer``, ``lmc_compute_batch``) are called
for each plugin on its own, and only for plugins that own a metric being
computed: an exception, or an answer of the wrong shape or length, makes that
plugin's metrics NaN on the documents it failed on (a failing batch is
retried row by row; one warning naming plugin, metric and documents; the
geometry file's ``failures`` names the plugin) and changes no other value.
The contract in prose, with a worked example package: docs/plugins.md.
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
    """Declare the metrics this plugin provides.

    Called once, when the plugin manager is built. Not firstresult: every
    plugin answers. A name claimed by two plugins is an error naming both.

    Returns:
        The plugin's metric specifications.
    """


@hookspec
def lmc_layer_reducer(
    selected: Sequence[str], options: Mapping[str, Any], batch: BatchInfo
) -> LayerReducer | None:
    """Start a reducer of the streamed states of one batch.

    Called once per captured batch, before ``x^0`` is served, for each plugin
    that owns a selected metric needing ``hidden_states``, ``lens`` or
    ``attentions``. A batch is the measured rows of one forward pass. The
    reducer's ``update(view)`` then receives ``x^0 .. x^L`` one `LayerView`
    at a time (the reducer keeps what it reduces, never the view),
    and its ``finalize()`` result reaches this plugin's ``lmc_compute_batch``
    as ``reduced``. Not firstresult: each plugin's reducer is its own.

    Args:
        selected: the metric names being computed (answer for your own).
        options: parsed ``--metric_args``.
        batch: the batch's shape, token mask, target tokens and documents.

    Returns:
        An object with ``update(view)`` and ``finalize()`` (`LayerReducer`), or
        None.
    """


@hookspec
def lmc_lens(
    selected: Sequence[str], options: Mapping[str, Any], model: torch.nn.Module, parts: ModelParts
) -> Lens | None:
    """Supply the lens the lens metrics read (default: the built-in logit lens).

    Called once per run, when the runner is built, if a selected metric needs
    ``lens``. At most one plugin may answer (two lenses are a
    ``ConfigurationError`` naming both); answer only when your own option or
    metric asks for your lens.

    Args:
        selected: every selected metric name.
        options: parsed ``--metric_args``.
        model: the measured model.
        parts: its located blocks, final norm and unembedding
            (``ModelParts.final_norm_fp32``, ``ModelParts.unembed_fp32``).

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
    """Compute per-document values for one batch of documents.

    Called after each captured batch (the measured rows of lm-eval's forward
    pass, or of several pooled: ``lmc_layer_reducer``),
    and once per batch of sampled documents for metrics that need Jacobians
    (``states.jacobians`` holds one entry per document, None outside the
    sample). Called for each plugin on its own, with the metric names it owns
    among those being computed.

    Args:
        selected: the metric names being computed (a plugin computes only
            the names it owns).
        states: the batch: ``size``, ``documents`` (per row, its
            `DocumentRef`s), and the engine's products.
        options: parsed ``--metric_args`` with defaults filled in.
        reduced: what this plugin's own reducer's ``finalize()`` returned for
            this batch (None without a reducer, and on sampled batches).

    Returns:
        ``{"values": {name: [B] tensor}, "profiles": {name: [B, ...] tensor},
        "summaries": {name: [B, ...] tensor}}``: each metric it owns mapped
        to its per-document values (NaN for degenerate documents), each
        declared profile to its per-document profiles (per-layer vectors,
        L x L matrices), and optional per-document summaries that are kept
        for ``lmc_aggregate_task`` (``DocumentGeometry.summaries``) but never
        written; or None. A value of the wrong shape makes that metric NaN
        on the batch (reported, naming the plugin).
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
    """Write the plugin's own sections of a task's geometry file.

    Called once per task when the run ends, after the common aggregation
    (mean, stderr and n of every declared profile). Not firstresult: the
    returned mappings are merged into the file's top level, so a plugin owns
    the keys it returns (the built-in coupling plugin writes ``"coupling"``).
    A task-level measure (one number from all of a task's documents) is
    computed here from the documents' ``summaries``.

    Args:
        selected: every selected metric name.
        profiles: the task's aggregated profiles, ``{name: {"mean", "stderr", "n"}}``.
        options: parsed ``--metric_args`` as used on the model (each K capped
            to what the model's width allows).
        documents: only the task's sampled documents whole (those carrying a
            sampled metric's values: at most ``coupling_docs`` per task, the
            seeded sample of docs/design.md; their values, profiles, summaries
            and Jacobian route per layer), plus, for every other scored
            document that has plugin ``summaries``, a document holding those
            summaries alone. The other documents' values and profiles reach
            the plugin only through ``profiles`` (streamed, so a run's memory
            stays flat in N).
        task: the task's name.
        doc_ids: lm-eval's ``doc_id`` of each of ``documents`` (same order).
        output_dir: the folder the task's geometry file is written to (None
            when the run writes no files: no ``--output_path``); a plugin's
            own files go there, named with ``run_id``.
        run_id: the timestamp in the run's file names
            (``geometry_<task>_<run_id>.json``).

    Returns:
        Extra top-level entries for the geometry file, or None. A
        task-level metric (`MetricSpec.task_level`) returns its value as
        ``{name: {"value": float, "n": documents used, ...}}``: lm-eval's
        results and table get that value once per task.
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
    """Compute the deferred metrics' per-document values once a task is measured.

    Called once per task, for each plugin owning a selected deferred metric
    (`MetricSpec.deferred`), after every document of the task has been
    measured (lm-eval runs every request before it scores any document) and
    before lm-eval scores the first one, so the values still reach lm-eval
    per document. For read-outs through a quantity fitted on the task's own
    sample (the Jacobian lens): the sampled documents' summaries are there
    for every document's read.

    Args:
        selected: the plugin's deferred metrics among those being computed.
        options: parsed ``--metric_args``.
        documents: every measured document of the task (values, profiles,
            summaries, the sampled ones' too). A plugin may delete its own
            summaries from them once used (they are then not kept).
        task: the task's name.
        doc_ids: lm-eval's ``doc_id`` of each of ``documents``.
        parts: the model's located blocks, final norm and unembedding.

    Returns:
        ``{"values": {name: [N]}, "profiles": {name: [N, ...]}}`` in the order
        of ``documents`` (checked as ``lmc_compute_batch``'s answer), or None.
    """


@hookspec
def lmc_jacobian_request(
    selected: Sequence[str], options: Mapping[str, Any], d_model: int
) -> JacobianRequest | None:
    """Ask the Jacobian engine for block Jacobian factors at the target position.

    Called once per run, when the engine is built, if a selected metric needs
    ``jacobian`` (and, for the ``lens_jacobian`` need, before its fit terms are
    computed: `JacobianRequest.lens_terms`). Not firstresult: the engine serves the union of the
    requests (the largest K; the swapped reduction and the dense Jacobians if
    any request wants them; the routes, and the pair reductions, must agree).
    The factors reach ``lmc_compute_batch`` as ``states.jacobians``
    (`lm_coupling.states.JacobianFactors`).

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
