"""Built-in Layer by Layer measures: prompt entropy, curvature, effective rank, dataset entropy.

Skean et al., "Layer by Layer" (ICML 2025). A plugin like any other, written
against the public contract only: it declares ``hidden_states``, and its
reducer receives the states ``x^0 .. x^L`` of a batch one layer at a time,
reduces each with ``lm_coupling.metrics.layer_by_layer`` over the measured
tokens (``BatchInfo.token_mask``) and keeps ``[B, L+1]`` profiles and, for
``dataset_entropy``, one pooled vector per document and state. Definitions,
conventions and options: docs/metrics.md ("Layer by Layer's measures").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.options import parse_bool
from lm_coupling.plugins.specs import UNIT_INTERVAL, MetricSpec, OptionSpec

if TYPE_CHECKING:  # the math (and torch) load when a batch is computed, not on declaring
    from lm_coupling.states import BatchInfo, LayerView

_NEEDS = frozenset({"hidden_states"})
PROFILED = ("prompt_entropy", "curvature", "effective_rank")
MIN_LAYER = {"prompt_entropy_min_layer": "prompt_entropy", "curvature_min_layer": "curvature"}
DATASET = "dataset_entropy"
OWN = (*PROFILED, *MIN_LAYER, DATASET)

ALPHA = OptionSpec(
    "lbl_alpha", 1.0, "order alpha of prompt_entropy and dataset_entropy (1: von Neumann)", float
)
STANDARDIZE = OptionSpec(
    "lbl_standardize",
    False,
    "centre each document's tokens and scale each to unit norm first (the authors' code)",
    parse_bool,
)
NORMALIZED = OptionSpec(
    "lbl_normalized", False, "prompt_entropy divided by ln min(T, d) (the authors' figures)",
    parse_bool,
)  # fmt: skip
CURVATURE_ABS = OptionSpec(
    "curvature_abs", False, "fold angles to [0, pi/2] with |cos| (the authors' code)", parse_bool
)
TOKENS = OptionSpec(
    "lbl_tokens",
    "context",
    "tokens measured: context (1..n, position 0 left out) or all (0..n, the authors' code)",
    choices=("context", "all"),
)
CLAMP = OptionSpec(
    "lbl_clamp",
    False,
    "set negative Gram entries to zero before the trace normalisation (the authors' code)",
    parse_bool,
)
LAST_STATE = OptionSpec(
    "lbl_last_state",
    "pre_norm",
    "the last state: pre_norm (x^L, this package's) or post_norm (N(x^L), transformers' "
    "hidden_states[-1], the authors' code)",
    choices=("pre_norm", "post_norm"),
)
ZERO_STEPS = OptionSpec(
    "curvature_zero_steps",
    "skip",
    "a pair with a zero-length step: skip (left out) or zero (angle 0, the authors' code)",
    choices=("skip", "zero"),
)
COMMON = (TOKENS, LAST_STATE)
"""Options every Layer by Layer measure reads."""
POOLING = OptionSpec(
    "dataset_pooling",
    "mean",
    "one vector per document for dataset_entropy: mean (the paper) or last (the target token)",
    choices=("mean", "last"),
)


@hookimpl
def lmc_declare_metrics():
    """Declare the Layer by Layer measures (opt-in: selected by name, not by `all`)."""
    return [
        MetricSpec(
            "prompt_entropy",
            "mean over states of the matrix-based alpha-entropy of the token states' Gram matrix",
            _NEEDS,
            opt_in=True,
            options=(ALPHA, STANDARDIZE, NORMALIZED, CLAMP, *COMMON),
            profiles=("prompt_entropy",),
            label="prompt entropy",
            unit="nats",
        ),
        MetricSpec(
            "prompt_entropy_min_layer",
            "l/L of the state with the lowest prompt entropy",
            _NEEDS,
            opt_in=True,
            options=(ALPHA, STANDARDIZE, NORMALIZED, CLAMP, *COMMON),
            label="prompt entropy: lowest state (l/L)",
            bounds=UNIT_INTERVAL,
        ),
        MetricSpec(
            "curvature",
            "mean over states of the mean angle between consecutive token steps (radians)",
            _NEEDS,
            opt_in=True,
            options=(STANDARDIZE, CURVATURE_ABS, ZERO_STEPS, *COMMON),
            profiles=("curvature",),
            label="curvature",
            unit="radians",
        ),
        MetricSpec(
            "curvature_min_layer",
            "l/L of the state with the lowest curvature",
            _NEEDS,
            opt_in=True,
            options=(STANDARDIZE, CURVATURE_ABS, ZERO_STEPS, *COMMON),
            label="curvature: lowest state (l/L)",
            bounds=UNIT_INTERVAL,
        ),
        MetricSpec(
            "effective_rank",
            "mean over states of exp(entropy of the normalised singular values of the tokens)",
            _NEEDS,
            opt_in=True,
            options=(STANDARDIZE, *COMMON),
            profiles=("effective_rank",),
            label="effective rank",
        ),
        MetricSpec(
            DATASET,
            "task-level alpha-entropy of the Gram matrix of the documents' pooled states",
            _NEEDS,
            opt_in=True,
            options=(ALPHA, STANDARDIZE, POOLING, CLAMP, *COMMON),
            label="dataset entropy",
            unit="nats",
            task_level=True,
        ),
    ]


class LayerByLayerReducer:
    """Per state, the selected measures of every document's measured tokens.

    Args:
        batch: the batch (its token mask).
        profiles: which of ``prompt_entropy``, ``curvature``, ``effective_rank``.
        pooled: keep one pooled vector per document and state (``dataset_entropy``).
        options: the run's parsed options.
    """

    def __init__(self, batch: BatchInfo, profiles: set[str], pooled: bool, options):
        self.mask = batch.token_mask
        if options.get(TOKENS.name, TOKENS.default) == "all":  # position 0 included
            from lm_coupling.metrics.layer_by_layer_authors import tokens_from_first

            self.mask = tokens_from_first(batch.first_index, batch.last_index, batch.n_tokens)
        self.final_norm, self.n_layers = None, batch.n_layers
        if options.get(LAST_STATE.name, LAST_STATE.default) == "post_norm":
            if batch.final_norm is None:
                raise ValueError("lbl_last_state=post_norm needs the model's final norm")
            self.final_norm = batch.final_norm
        self.clamp = bool(options.get(CLAMP.name, CLAMP.default))
        self.zero_steps = options.get(ZERO_STEPS.name, ZERO_STEPS.default)
        self.profiles = profiles
        self.pooled = pooled
        self.alpha = float(options.get(ALPHA.name, ALPHA.default))
        self.standardize = bool(options.get(STANDARDIZE.name, STANDARDIZE.default))
        self.normalized = bool(options.get(NORMALIZED.name, NORMALIZED.default))
        self.absolute = bool(options.get(CURVATURE_ABS.name, CURVATURE_ABS.default))
        self.pooling = options.get(POOLING.name, POOLING.default)
        self.columns: dict[str, list] = {name: [] for name in profiles}
        self.vectors: list = []

    def update(self, view: LayerView) -> None:
        """Reduce state ``x^l`` (``view.hidden [B, T, d]``) to one number per document."""
        import torch

        from lm_coupling.metrics import layer_by_layer as lbl

        mask = self.mask.to(view.hidden.device)
        hidden = view.hidden
        if self.final_norm is not None and view.layer == self.n_layers:  # hidden_states[-1]
            hidden = self.final_norm(hidden).to(hidden.device)
        states = lbl.standardize_tokens(hidden, mask) if self.standardize else hidden
        dtype = torch.float64 if states.dtype == torch.float64 else torch.float32
        if {"prompt_entropy", "effective_rank"} & self.profiles:  # one spectrum for both
            eigenvalues = lbl.gram_eigenvalues(states, mask)
        if "prompt_entropy" in self.profiles:
            if self.clamp:
                from lm_coupling.metrics.layer_by_layer_authors import clamped_gram_eigenvalues

                value = lbl.spectrum_entropy(clamped_gram_eigenvalues(states, mask), self.alpha)
            else:
                value = lbl.spectrum_entropy(eigenvalues, self.alpha)
            if self.normalized:
                value = lbl.normalize_entropy(value, mask.sum(dim=1), states.shape[-1])
            self.columns["prompt_entropy"].append(value.to(dtype))
        if "curvature" in self.profiles:
            self.columns["curvature"].append(
                lbl.curvature(states, mask, absolute=self.absolute, zero_steps=self.zero_steps)
            )
        if "effective_rank" in self.profiles:
            rank = lbl.effective_rank_from_eigenvalues(eigenvalues)
            self.columns["effective_rank"].append(rank.to(dtype))
        if self.pooled:
            self.vectors.append(lbl.pool_tokens(states, mask, self.pooling).float())

    def finalize(self) -> dict[str, Any]:
        """``{name: [B, L+1] profile}`` and, with dataset_entropy, ``"pooled": [B, L+1, d]``."""
        import torch

        out = {name: torch.stack(cols, dim=1) for name, cols in self.columns.items()}
        if self.pooled:
            out["pooled"] = torch.stack(self.vectors, dim=1)
        return out


@hookimpl
def lmc_layer_reducer(selected, options, batch: BatchInfo) -> LayerByLayerReducer | None:
    """Start the batch's reducer when one of this plugin's metrics is selected."""
    profiles = {m for m in PROFILED if m in selected}
    profiles |= {MIN_LAYER[m] for m in selected if m in MIN_LAYER}  # the minimum of a profile
    if not profiles and DATASET not in selected:
        return None
    return LayerByLayerReducer(batch, profiles, DATASET in selected, options)


def _min_layer(profile):
    """``argmin_l profile[:, l] / L``, NaN where the profile has a NaN."""
    import torch

    depth = profile.shape[1] - 1
    out = profile.argmin(dim=1).to(profile.dtype) / depth
    return torch.where(torch.isnan(profile).any(dim=1), torch.nan, out)


@hookimpl
def lmc_compute_batch(selected, reduced):
    """Per document: the mean over states, the layer of the minimum, the profiles."""
    if not reduced:
        return None
    values, profiles, summaries = {}, {}, {}
    for name in PROFILED:
        if name in selected:
            values[name] = reduced[name].mean(dim=1)
            profiles[name] = reduced[name]
    for name, source in MIN_LAYER.items():
        if name in selected:
            values[name] = _min_layer(reduced[source])
    if DATASET in selected and "pooled" in reduced:
        summaries[DATASET] = reduced["pooled"]
    return {"values": values, "profiles": profiles, "summaries": summaries}


@hookimpl
def lmc_aggregate_task(selected, options, documents, doc_ids):
    """``dataset_entropy``: the task's profile over states, its mean, and its estimate vs n."""
    if DATASET not in selected:
        return None
    import math

    import numpy as np
    import torch

    from lm_coupling.metrics.layer_by_layer import DatasetGram

    alpha = float(options.get(ALPHA.name, ALPHA.default))
    clamp = bool(options.get(CLAMP.name, CLAMP.default))
    order = sorted(range(len(documents)), key=lambda i: doc_ids[i])
    rows = [documents[i].summaries.get(DATASET) for i in order]
    kept = [np.asarray(r, dtype=np.float64) for r in rows if r is not None]
    kept = [r for r in kept if np.isfinite(r).all()]
    section = {
        "alpha": alpha,
        "pooling": options.get(POOLING.name, POOLING.default),
        "standardize": bool(options.get(STANDARDIZE.name, STANDARDIZE.default)),
        "clamp": clamp,
        "tokens": options.get(TOKENS.name, TOKENS.default),
        "last_state": options.get(LAST_STATE.name, LAST_STATE.default),
        "n": len(kept),
        "left_out": len(rows) - len(kept),
    }
    if not kept:
        return {DATASET: {**section, "value": math.nan, "min_layer": math.nan, "profile": []}}
    pooled = torch.from_numpy(np.stack(kept))
    counts = sorted({min(2**i, len(kept)) for i in range(len(kept).bit_length() + 1)})
    profiles = []  # on the first n documents, n = 1, 2, 4, ..., N: the estimate vs n
    for n in counts:
        gram = DatasetGram(pooled.shape[1], pooled.shape[2])
        gram.update(pooled[:n])
        profiles.append(gram.entropy(alpha, clamp))
    profile = profiles[-1]
    section.update(
        value=float(profile.mean()),
        min_layer=float(_min_layer(profile[None])[0]),
        profile=[float(v) for v in profile],
        by_count={"n": counts, "value": [float(torch.nanmean(p)) for p in profiles]},
    )
    return {DATASET: section}
