"""The plugin-facing records: capture/ and the engine fill them, plugins read them.

Shapes as in docs/design.md (B documents, T positions, L blocks, d, V, K);
tensors are float32 (float64 for a float64 model) on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, get_args

if TYPE_CHECKING:  # annotations only: importing the records loads no torch
    import numpy as np
    import torch

Need = Literal[
    "hidden_states",
    "lens",
    "attentions",
    "jacobian",
    "tokenwise_jacobian",
    "lens_jacobian",
    "authors_jacobian",
]
"""What a metric reads (``MetricSpec.needs``; an unknown need is a ``PluginError``).

Streamed from the benchmark's forward pass to the plugin's reducer (`LayerView`):
``hidden_states`` (``x^l``, l = 0..L), ``lens`` (the final norm of ``x^l_n`` and
the logits at n of the lens the metric names), ``attentions`` (block l's
attention probabilities, eager attention). From the Jacobian engine on the
sampled documents (`GeometryStates`): ``jacobian``, ``tokenwise_jacobian``,
``lens_jacobian``, ``authors_jacobian``. What each holds: docs/plugins.md.
"""

NEEDS: tuple[str, ...] = get_args(Need)
"""Every need, in the order of `Need`."""

STREAMED_NEEDS = frozenset({"hidden_states", "lens", "attentions"})
"""Needs served layer by layer from the benchmark's forward pass to a reducer."""

ENGINE_NEEDS = frozenset(NEEDS) - STREAMED_NEEDS
"""Needs the Jacobian engine serves, on the sampled documents."""


class DocumentRef(NamedTuple):
    """The identity of one benchmark document: its task and lm-eval ``doc_id``."""

    task: str
    doc_id: int


@dataclass(frozen=True)
class BatchInfo:
    """What a reducer knows of its batch before the first layer arrives (``lmc_layer_reducer``).

    Tensors live on the device of the reduced states (``LayerView``).

    Attributes:
        n_layers: L, the number of blocks (states 0..L arrive).
        d_model: d.
        vocab_size: V.
        size: B, the measured rows of one forward pass.
        n_tokens: T, positions of the (padded) rows: ``0 .. max(last_index)``
            (positions after every row's n, an answer's tokens, are not served).
        last_index: ``[B]`` int64, the target position n of each row.
        first_index: ``[B]`` int64, the first real token of each row (the
            number of left pads; 0 for right padding).
        token_mask: ``[B, T]`` bool, the measured tokens: the context tokens
            ``first_index + 1 .. n`` (position 0 skipped, as the trajectory
            metrics do; docs/metrics.md).
        target_tokens: ``[B]`` int64, the gold next token at n (-1: none).
        documents: per row, the documents it measures (several documents can
            share one prompt; empty for rows that are no document).
        lens: the name of the lens the plugin's metrics read (``"logit"``).
        dtype: the dtype of the reduced states (float32, float64 in tests).
        final_norm: the model's own final norm N, ``[..., d] -> [..., d]`` in
            float32 (float64 stays), for a metric that reads the post-norm
            last state as transformers' ``hidden_states[-1]`` does; None
            where capture has no model parts.
    """

    n_layers: int
    d_model: int
    vocab_size: int
    size: int
    n_tokens: int
    last_index: torch.Tensor
    first_index: torch.Tensor
    token_mask: torch.Tensor
    target_tokens: torch.Tensor
    documents: tuple[tuple[DocumentRef, ...], ...] = ()
    lens: str = "logit"
    dtype: Any = None
    final_norm: Any = None


class LayerView:
    """One state ``x^l`` of a batch, as a reducer's ``update`` receives it.

    A field is None when no selected metric declared the need that fills it.
    A reducer keeps what it reduces, never the view.

    Attributes:
        layer: l, 0..L (0: the input of block 1; l: the output of block l).
        hidden: ``[B, T, d]`` ``x^l`` at every position, before the final norm,
            float32 (float64 for a float64 model); need ``hidden_states``.
        at_n: ``[B, d]`` ``x^l_n``, the rows at the target positions (with
            any of the streamed needs).
        normed: ``[B, d]`` the final norm of ``x^l_n``; need ``lens``.
        logits: ``[B, V]`` the logits at n of the lens the plugin's metrics
            name; need ``lens``. Both are computed when first read.
        attentions: ``[B, H, T, T]`` block l's attention probabilities (rows:
            queries, columns: keys); None at l = 0; need ``attentions``.
    """

    __slots__ = ("layer", "hidden", "at_n", "attentions", "_normed", "_logits", "_lens")

    def __init__(
        self,
        layer: int,
        hidden: torch.Tensor | None = None,
        at_n: torch.Tensor | None = None,
        attentions: torch.Tensor | None = None,
        lens: Any = None,
    ) -> None:
        self.layer, self.hidden, self.at_n, self.attentions = layer, hidden, at_n, attentions
        self._normed = self._logits = None
        self._lens = lens  # capture's ``() -> (normed, logits)``, called on the first read

    def _read_lens(self) -> None:
        read, self._lens = self._lens, None
        if read is not None:
            self._normed, self._logits = read()

    @property
    def normed(self) -> torch.Tensor | None:
        """``[B, d]`` the final norm of ``x^l_n`` (need ``lens``)."""
        self._read_lens()
        return self._normed

    @property
    def logits(self) -> torch.Tensor | None:
        """``[B, V]`` the lens's logits at n (need ``lens``)."""
        self._read_lens()
        return self._logits

    def __repr__(self) -> str:
        return f"LayerView(layer={self.layer})"


class LayerReducer(Protocol):
    """What a plugin's ``lmc_layer_reducer`` returns: a reducer of one batch.

    ``update`` is called once per state, l = 0..L in order, during the
    forward pass; ``finalize`` once after ``x^L``, its answer reaching the
    plugin's ``lmc_compute_batch`` as ``reduced``. Optional: ``update_lens(logits)``
    receives the lens logits of every state, ``[B, L+1, V]``, before ``finalize``.
    """

    def update(self, view: LayerView) -> None:
        """Reduce one state ``x^l`` (``view.layer``)."""

    def finalize(self) -> Any:
        """The batch's reductions, handed to ``lmc_compute_batch(reduced=...)``."""


class Lens(Protocol):
    """A lens: the next-token logits read from an intermediate state.

    The built-in is the logit lens, ``W_U N(x^l) + b`` (``lm_coupling.capture.lens``);
    a plugin adds another beside it (``lmc_lens``), read by the metrics naming it.

    Attributes:
        name: the name metrics read it by (``MetricSpec.lens``; ``"logit"``).
    """

    name: str

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of state ``x^layer`` at n, ``hidden [B, d]`` (before the final norm).

        Computed in float32 (float64 for float64 states), on ``hidden``'s device.
        """


@dataclass
class TrajectoryStates:
    """Per-token trajectory summaries: what the built-in trajectory reducer keeps of a batch.

    Attributes:
        norms: ``[B, L+1, T]`` state norms ``||x^l_t||``.
        step_lengths: ``[B, L, T]`` step lengths ``||x^l_t - x^{l-1}_t||``.
        lss: ``[B, T]`` line-shape score of each token's whole trajectory.
        windowed_lss: ``[B, L, T]`` windowed LSS at depth l = 1..L (window 11).
        token_mask: ``[B, T]`` bool; the tokens a per-document value averages
            over (context tokens 1..n; with ``tokens=last``, T = 1: n alone).
    """

    norms: torch.Tensor
    step_lengths: torch.Tensor
    lss: torch.Tensor
    windowed_lss: torch.Tensor
    token_mask: torch.Tensor


@dataclass
class LensStates:
    """Lens quantities at the target position n, l = 0..L: what the built-in lens reducer keeps.

    Attributes:
        entropy: ``[B, L+1]`` normalized entropy ``H(P^l) / ln V``.
        target_prob: ``[B, L+1]`` ``P^l(target)``; NaN where no target token.
        top1: ``[B, L+1]`` int64, argmax token of ``P^l``; None when no
            selected metric reads it (``fixation_depth`` does).
    """

    entropy: torch.Tensor
    target_prob: torch.Tensor
    top1: torch.Tensor | None


@dataclass
class JacobianFactors:
    """Top-K factors of the block Jacobians ``J^l`` at n for one document.

    ``J^l = d(block_l(X)_n - x^{l-1}_n) / d x^{l-1}_n`` (residual branch only).

    Attributes:
        U: ``[L, d, K_max]`` top left singular vectors of each ``J^l``.
        S: ``[L, K_max + 1]`` top singular values (one extra for the gap).
        V: ``[L, d, K_max]`` top right singular vectors.
        A: ``[L, L, ...]`` the pair reduction of ``(U_m, J^l V_m)`` for every
            block pair (l, m) (the coupling plugin's: ``A[l, m] = U_m^T J^l V_m``,
            ``[L, L, K_max, K_max]``, whose ``[..., :k, :k]`` is the coupling
            matrix at any k <= K_max); None when no request carries a reduction.
        B: the same reduction of ``(V_m, J^l U_m)`` (the swapped matrices
            ``B[l, m] = V_m^T J^l U_m``), when a request asks ``swapped``;
            otherwise None.
        method: per layer, the route used (``"dense"``, ``"gram"``,
            ``"krylov"``).
        spectral_gap: ``[L]`` ``s_K / s_{K+1}`` at K_max.
        iterations: per layer, iterations of the iterative route (0: direct).
        residual: ``[L]`` ``max_{i<=K} ||J v_i - s_i u_i|| / s_1`` of the
            returned triplets.
        ill_defined: ``[L]`` bool; two of the top K+1 singular values are so
            close that the singular vectors are not determined (see
            ``jacobian.linalg.ill_defined``).
        peak_bytes: peak memory the engine held for this document's batch.
        dense: ``[L, d, d]`` the Jacobians themselves (rows: output
            coordinates), when a request asks ``dense=True`` (the engine's
            ``keep_dense``: the dense route on every layer); otherwise None.
        seconds: this document's share of the engine's wall seconds:
            ``"forward"`` (float) and, per layer, ``"jacobian_products"``,
            ``"factorisation"`` and ``"reduction"`` (docs/engine.md).
        replay: how the blocks were replayed at n: ``"cache"`` (token n
            against the frozen prefix) or ``"sequence"`` (docs/engine.md).
    """

    U: torch.Tensor
    S: torch.Tensor
    V: torch.Tensor
    A: torch.Tensor | None
    B: torch.Tensor | None
    method: list[str]
    spectral_gap: torch.Tensor
    iterations: list[int] = field(default_factory=list)
    residual: torch.Tensor | None = None
    ill_defined: torch.Tensor | None = None
    peak_bytes: int = 0
    dense: torch.Tensor | None = None
    seconds: dict[str, float | list[float]] = field(default_factory=dict)
    replay: str = "cache"


@dataclass
class GeometryStates:
    """What a plugin's ``lmc_compute_batch`` reads for one batch of B documents.

    Attributes:
        n_layers: L.
        d_model: d.
        vocab_size: V.
        size: B, the rows of the batch.
        documents: per row, the documents it measures (`DocumentRef`s; empty
            for rows that are no document).
        jacobians: per row, its `JacobianFactors` (need ``jacobian``), None
            outside the sample; empty when no metric needs them.
        tokenwise: per row, ``{(layer, t_in, t_out): [d, d]}`` (need
            ``tokenwise_jacobian``); empty when no metric needs them.
        lens_jacobians: per row, its Jacobian-lens fit term ``[L+1, d, d]``
            (need ``lens_jacobian``), None where the estimator skips the
            document (too short) or outside the sample.
        model_identity: the model and unembedding the terms belong to (need
            ``lens_jacobian``; ``jacobian.lens_fit.model_identity``).
        authors_jacobians: per row, ``[L, d, d]`` block Jacobians at n with the
            last one through the final norm (need ``authors_jacobian``).
    """

    n_layers: int
    d_model: int
    vocab_size: int
    size: int = 0
    documents: tuple[tuple[DocumentRef, ...], ...] = ()
    jacobians: list[JacobianFactors | None] = field(default_factory=list)
    tokenwise: list[dict | None] = field(default_factory=list)
    lens_jacobians: list[torch.Tensor | None] = field(default_factory=list)
    model_identity: dict = field(default_factory=dict)
    authors_jacobians: list[torch.Tensor | None] = field(default_factory=list)


@dataclass(slots=True)
class DocumentGeometry:
    """The geometry of one document.

    Attributes:
        values: per-document scalar of each metric (NaN when undefined).
        profiles: per-layer vectors and L x L matrices, as float64 arrays.
        jacobian_methods: the Jacobian route per layer, for sampled documents.
        timings: seconds spent on this document's geometry: scalars
            (``forward_capture``, ``jacobian_products``, ``factorisation``,
            ``metrics``) and per-layer lists (``jacobian_products_per_layer``,
            ``factorisation_per_layer``).
        summaries: per-document summaries a plugin keeps for its
            ``lmc_aggregate_task`` (never written to a file).
        failures: ``{"plugin", "metrics", "error"}`` of each plugin whose
            answer failed on this document (its metrics are NaN here).
    """

    values: dict[str, float] = field(default_factory=dict)
    profiles: dict[str, np.ndarray] = field(default_factory=dict)
    jacobian_methods: list[str] | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    summaries: dict[str, np.ndarray] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def copy(self) -> DocumentGeometry:
        """An independent copy (a later merge into one document's geometry leaves the other's)."""
        return DocumentGeometry(
            values=dict(self.values),
            profiles=dict(self.profiles),
            jacobian_methods=None if self.jacobian_methods is None else list(self.jacobian_methods),
            timings=dict(self.timings),
            summaries=dict(self.summaries),
            failures=[dict(failure) for failure in self.failures],
        )

    def without_profiles(self) -> DocumentGeometry:
        """This geometry without its profiles (the other parts shared, not copied)."""
        return replace(self, profiles={})

    def merge(self, other: DocumentGeometry) -> None:
        """Add ``other``'s values, profiles, summaries, failures and timings to this document's."""
        self.values.update(other.values)
        self.profiles.update(other.profiles)
        self.summaries.update(other.summaries)
        self.failures.extend(f for f in other.failures if f not in self.failures)
        self.timings.update(other.timings)
        if other.jacobian_methods is not None:
            self.jacobian_methods = other.jacobian_methods
