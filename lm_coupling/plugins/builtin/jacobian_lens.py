"""Built-in Jacobian lens: fit ``J_l`` on a sample and read documents through it.

Gurnee et al. (2026): ``lens_l(h) = W_U N(J_l h) + b``, ``J_l = E[d x^L_n / d x^l_n]``
(math: ``lm_coupling.metrics.jacobian_lens``), written against the public contract:

1. **Fit** (``jlens_fit``, sampled; brought in by the reading metrics unless
   ``jlens_path`` is given): each of ``jlens_docs`` documents' term of the
   estimator ``jlens_estimator`` (``reference``: TransformerLens 4.3
   ``JacobianLens.fit``; ``last_position``: the target position alone), averaged.
2. **Read** (``jlens_entropy``, ``jlens_tv_to_target``, ``jlens_fixation_depth``):
   the lens named ``"jacobian"`` (`lm_coupling.capture.lens.JacobianLens`). A
   loaded lens (``jlens_path``) is read in the forward passes beside the logit
   lens; one fitted in the run is read once the task is measured (deferred),
   from the states at n kept per document, through the same read-out. Both
   reduce as the built-in lens metrics do.

The fitted lens is saved beside the geometry file (``jlens_<task>_<run_id>.pt``,
or ``jlens_save``) in TransformerLens's format (``jacobian_lens_file``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_coupling.plugins.builtin.jacobian_lens_file import FORMAT, load_lens, save_lens
from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.options import parse_at_least, parse_doc_count
from lm_coupling.plugins.short import AtN
from lm_coupling.plugins.specs import UNIT_INTERVAL, JacobianRequest, MetricSpec, OptionSpec

if TYPE_CHECKING:
    import torch

    from lm_coupling.capture.lens import JacobianLens
    from lm_coupling.model.architecture import ModelParts
    from lm_coupling.states import BatchInfo, LensStates

FIT = "jlens_fit"
READ = {  # each J-lens metric and the lens metric whose definition it shares
    "jlens_entropy": "logit_lens_entropy",
    "jlens_tv_to_target": "tv_to_target",
    "jlens_fixation_depth": "fixation_depth",
}
DEFAULT_DOCS = 8
LENS = "jacobian"
"""The name its reading metrics read the lens by (`lm_coupling.capture.lens.JacobianLens`)."""


def _optional_path(text: str) -> str | None:
    text = text.strip()
    return None if text.lower() in ("", "none") else text


def _lens_file(text: str) -> str | None:
    """A lens file that exists (checked when the options are parsed, before any model loads)."""
    path = _optional_path(text)
    if path is not None and not Path(path).is_file():
        raise ValueError(
            f"{path} is not a file; leave jlens_path out to fit the lens in this run "
            "(docs/metrics.md, 'The Jacobian lens')"
        )
    return path


PATH = OptionSpec(
    "jlens_path",
    None,
    "a fitted lens file to read documents through instead of fitting one in the run",
    _lens_file,
)
DOCS = OptionSpec(
    "jlens_docs", DEFAULT_DOCS, "documents per task the Jacobian lens is fitted on", parse_doc_count
)
ESTIMATOR = OptionSpec(
    "jlens_estimator",
    "reference",
    "the fit's estimator: reference (TransformerLens 4.3 JacobianLens.fit: targets summed, "
    "sources s..T-2 averaged) or last_position (the target position alone)",
    str,
    ("reference", "last_position"),
)


SKIP = OptionSpec(
    "jlens_skip_first",
    16,
    "reference estimator: leading positions left out (TransformerLens skip_first_positions)",
    parse_at_least(0),
)
MAX_LEN = OptionSpec(
    "jlens_max_len",
    128,
    "reference estimator: tokens kept from a prompt's start (TransformerLens max_seq_len)",
    parse_at_least(2),
)
DIM_BATCH = OptionSpec(
    "jlens_dim_batch",
    8,
    "reference estimator: cotangent directions per backward pass (TransformerLens dim_batch)",
    parse_at_least(1),
)
SAVE = OptionSpec(
    "jlens_save",
    None,
    "where the fitted lens is written: a folder (jlens_<task>.pt inside) or a .pt path "
    "(default: beside the geometry file)",
    _optional_path,
)


def _fit_unless_loaded(options) -> tuple[str, ...]:
    """The reading metrics need the fit in the run unless a fitted lens is loaded."""
    return () if options.get(PATH.name) else (FIT,)


def _reading_spec(name: str, description: str, label: str, profile: bool) -> MetricSpec:
    return MetricSpec(
        name,
        description,
        frozenset({"lens"}),
        options=(PATH, DOCS, SAVE, ESTIMATOR, SKIP, MAX_LEN, DIM_BATCH),
        profiles=(name,) if profile else (),
        higher_is_better=False if profile else None,
        opt_in=True,
        label=label,
        bounds=UNIT_INTERVAL,
        deferred=True,
        requires=_fit_unless_loaded,
        lens=LENS,
    )


@hookimpl
def lmc_declare_metrics():
    """Declare jlens_fit and the three J-lens metrics."""
    return [
        MetricSpec(
            FIT,
            "fits the Jacobian lens on its sample; value: mean over l < L of "
            "||d x^L_n / d x^l_n||_F / sqrt(d)",
            frozenset({"lens_jacobian"}),
            options=(DOCS, SAVE, ESTIMATOR, SKIP, MAX_LEN, DIM_BATCH),
            sample_option=DOCS.name,
            sampled=True,
            opt_in=True,
            label="J-lens fit: ||dx^L/dx^l||_F / sqrt(d)",
        ),
        _reading_spec(
            "jlens_entropy",
            "mean over layers of the Jacobian-lens entropy H(P^l)/ln V at the target position",
            "J-lens entropy",
            True,
        ),
        _reading_spec(
            "jlens_tv_to_target",
            "mean over layers of 1 - P^l(gold token) under the Jacobian lens",
            "J-lens TV to target",
            True,
        ),
        _reading_spec(
            "jlens_fixation_depth",
            "smallest l/L after which the Jacobian lens's top-1 token no longer changes",
            "J-lens fixation depth",
            False,
        ),
    ]


def _reading(selected) -> list[str]:
    return [name for name in READ if name in selected]


STATES, TARGET = "jlens_states", "jlens_target"
"""Per document, what a lens fitted in the run reads: ``x^l_n`` (l = 0..L), the gold token."""


def _loaded(options) -> bool:
    return bool(options.get(PATH.name))


def _on_model(J: torch.Tensor, parts: ModelParts) -> JacobianLens:
    """The lens on the model's device, in the dtype capture reduces in (float64 stays)."""
    import torch

    from lm_coupling.capture.lens import JacobianLens

    weight = next(parts.blocks[0].parameters(), None)
    wide = weight is not None and weight.dtype == torch.float64
    return JacobianLens(J.to(parts.input_device, torch.float64 if wide else torch.float32), parts)


@hookimpl
def lmc_lens(selected, options, parts: ModelParts) -> JacobianLens | None:
    """A loaded lens (``jlens_path``), read beside the logit lens in the run's forward passes."""
    if not (_reading(selected) and _loaded(options)):
        return None
    from lm_coupling.jacobian.lens_fit import unembedding_fingerprint

    J = load_lens(options[PATH.name], parts.n_layers, parts.d_model, unembedding_fingerprint(parts))
    return _on_model(J["jacobians"], parts)


@hookimpl
def lmc_layer_reducer(selected, options, batch: BatchInfo):
    """A loaded lens: the lens plugin's reducer; one fitted in the run: keep the states at n."""
    if not _reading(selected):
        return None
    if _loaded(options):
        from lm_coupling.plugins.builtin.lens import LensReducer

        return LensReducer(batch, top1="jlens_fixation_depth" in selected)
    return AtN({"states"}, batch)


def _read(selected, lens: LensStates) -> dict[str, dict[str, torch.Tensor]]:
    """The J-lens metrics of the lens quantities at n, with the lens plugin's own reduction.

    States the lens has no transport for (NaN: a TransformerLens file has
    none for state 0) count for nothing: entropy and TV are the mean over the
    other states, the top-1 token never changes there, and the fixation
    depth is not below the first covered state.
    """
    import dataclasses

    import torch

    from lm_coupling.plugins.builtin import lens as lens_plugin

    missing = lens.entropy.isnan()
    top1 = None if lens.top1 is None else lens.top1.clone()  # None: no fixation depth asked
    for layer in range(missing.shape[1] - 2, -1, -1) if top1 is not None else ():
        top1[:, layer] = torch.where(missing[:, layer], top1[:, layer + 1], top1[:, layer])
    shared = lens_plugin.lmc_compute_batch(
        selected=[READ[name] for name in selected], reduced=dataclasses.replace(lens, top1=top1)
    )
    partial = missing.any(dim=1)
    out: dict[str, dict[str, torch.Tensor]] = {"values": {}, "profiles": {}}
    for name in selected:
        value = shared["values"][READ[name]]
        profile = shared["profiles"].get(READ[name])
        if profile is not None:
            out["profiles"][name] = profile
            value = torch.where(partial, profile.nanmean(dim=1), value)
        else:
            first = (~missing).float().argmax(dim=1) / (missing.shape[1] - 1)
            value = torch.maximum(value, first.to(value.dtype))
        out["values"][name] = value
    return out


IDENTITY, SKIPPED = "jlens_identity", "jlens_skipped"
"""Per sampled document: the model identity (JSON bytes) its term belongs to; 1 if skipped."""


def _fit_batch(states) -> dict[str, Any]:
    """Per sampled document: its fit term (summary) and its mean gain over l < L (value).

    A document the reference estimator skips (no position after the skipped
    leading ones) gets NaN and the summary ``jlens_skipped``.
    """
    import json
    import math

    import torch

    L, d = states.n_layers, states.d_model
    identity = torch.tensor(list(json.dumps(states.model_identity).encode()), dtype=torch.uint8)
    gains, terms, skipped = [], [], []
    for term in states.lens_jacobians or [None] * states.size:
        skipped.append(term is None)
        if term is None:
            term = torch.full((L + 1, d, d), math.nan)
        terms.append(term.cpu())
        gains.append(float(torch.linalg.matrix_norm(term[:L]).mean() / math.sqrt(d)))
    return {
        "values": {FIT: torch.tensor(gains, dtype=torch.float64)},
        "summaries": {
            FIT: torch.stack(terms),
            IDENTITY: identity.repeat(len(terms), 1),
            SKIPPED: torch.tensor(skipped, dtype=torch.uint8),
        },
    }


@hookimpl
def lmc_jacobian_request(selected, options) -> JacobianRequest | None:
    """The fit's terms under the estimator this plugin's options name (need ``lens_jacobian``)."""
    if FIT not in selected:
        return None
    return JacobianRequest(
        k=1,
        lens_terms={
            "estimator": options.get(ESTIMATOR.name, ESTIMATOR.default),
            "skip_first": options.get(SKIP.name, SKIP.default),
            "max_len": options.get(MAX_LEN.name, MAX_LEN.default),
            "dim_batch": options.get(DIM_BATCH.name, DIM_BATCH.default),
        },
    )


@hookimpl
def lmc_compute_batch(selected, states, options, reduced):
    """The fit's per-document terms; a loaded lens's read; for a lens fitted later, the states."""
    out: dict[str, dict] = {"values": {}, "profiles": {}, "summaries": {}}
    if FIT in selected and states.lens_jacobians:
        out.update(_fit_batch(states))
    reading = _reading(selected)
    if reading and reduced is not None:
        if _loaded(options):
            out.update(_read(reading, reduced))
        else:
            out["summaries"].update({STATES: reduced["states"], TARGET: reduced["targets"]})
    return out


def fitted_lens(documents) -> tuple[torch.Tensor | None, dict[str, int], dict[str, Any]]:
    """``(J [L+1, d, d] float64 or None, counts, model identity)`` from the sample's terms.

    ``counts``: ``fitted_on`` (documents averaged), ``left_out`` (skipped by
    the estimator or not finite) and ``skipped_short`` (of those, the ones the
    estimator skipped as too short for the reference's positions).
    """
    import json

    import numpy as np
    import torch

    kept, left_out, skipped, identity = [], 0, 0, {}
    for doc in documents:
        term, flag, raw = (doc.summaries.get(key) for key in (FIT, SKIPPED, IDENTITY))
        if term is not None and np.isfinite(np.asarray(term)).all():
            kept.append(np.asarray(term, dtype=np.float64))
        elif term is not None:
            left_out += 1
        skipped += int(flag is not None and bool(np.asarray(flag).any()))
        if raw is not None and not identity:
            identity = json.loads(bytes(np.asarray(raw, dtype=np.uint8).reshape(-1)).decode())
    J = torch.from_numpy(np.mean(np.stack(kept), axis=0)) if kept else None
    return J, {"fitted_on": len(kept), "left_out": left_out, "skipped_short": skipped}, identity


def read_through(lens: JacobianLens, states, targets, selected, chunk: int = 16) -> dict:
    """The J-lens metrics of documents read through a lens fitted in the run.

    The same read-out as capture's (`lm_coupling.capture.lens.read_all`: one
    call per chunk of documents) and the same reduction as a loaded lens's.

    Args:
        lens: the fitted lens.
        states: ``[N, L+1, d]`` ``x^l_n`` of each document (host or device).
        targets: ``[N]`` the gold tokens (-1: none).
        selected: the J-lens metrics wanted.
        chunk: documents read at once (bounds the ``[chunk, L+1, V]`` logits).

    Returns:
        ``{"values": {name: [N]}, "profiles": {name: [N, L+1]}}``.
    """
    import torch

    from lm_coupling.capture.lens import read_all
    from lm_coupling.metrics.lens import lens_summary
    from lm_coupling.states import LensStates

    if not torch.isfinite(lens.jacobians).all(dim=(1, 2)).any():
        raise ValueError("the lens has no finite transport on any state")
    out: dict[str, dict[str, list]] = {"values": {}, "profiles": {}}
    for start in range(0, states.shape[0], chunk):
        rows = states[start : start + chunk].to(lens.parts.input_device)
        with torch.no_grad():
            logits = read_all(lens, lens.parts, list(rows.unbind(dim=1)))
        target = targets[start : start + chunk].to(device=logits.device, dtype=torch.long)
        entropy, target_prob, top1 = lens_summary(logits, target, check_target=False)
        answer = _read(selected, LensStates(entropy=entropy, target_prob=target_prob, top1=top1))
        for kind, part in answer.items():
            for name, tensor in part.items():
                out[kind].setdefault(name, []).append(tensor.detach().cpu())
    return {kind: {k: torch.cat(v) for k, v in part.items()} for kind, part in out.items()}


@hookimpl
def lmc_complete_task(selected, options, documents, parts: ModelParts):
    """Fit the task's lens from its sample, then read every document through it.

    A loaded lens (``jlens_path``) was read in the run's forward passes: nothing to do.

    Raises:
        ValueError: no sampled document gave a finite fit (the read is then NaN
            on the task, reported as this plugin's failure).
    """
    reading = _reading(selected)
    if not reading or _loaded(options):
        return None
    import numpy as np
    import torch

    J, counts, _ = fitted_lens(documents)
    if J is None:
        raise ValueError(
            "no document of the fit's sample (jlens_docs) gave finite Jacobians, so no lens "
            f"was fitted ({counts['skipped_short']} were too short for the reference estimator: "
            "it needs more than jlens_skip_first + 1 tokens; lower jlens_skip_first, raise "
            "jlens_docs, or set jlens_estimator=last_position)"
        )
    lens = _on_model(J, parts)
    dtype = lens.jacobians.dtype
    blank = np.full((parts.n_layers + 1, parts.d_model), np.nan)
    states, targets = [], []
    for doc in documents:  # the read's inputs leave the documents: they are not kept
        state, target = doc.summaries.pop(STATES, None), doc.summaries.pop(TARGET, None)
        if state is None:
            state, target = blank, -1
        states.append(torch.as_tensor(np.asarray(state), dtype=dtype))
        targets.append(int(np.asarray(target).reshape(-1)[0]))
    return read_through(lens, torch.stack(states), torch.tensor(targets), reading)


@hookimpl
def lmc_aggregate_task(selected, options, documents, task, output_dir, run_id):
    """Average the sample's total Jacobians into the task's lens; save it; summarise it."""
    if FIT not in selected and not _reading(selected):
        return None
    section: dict[str, Any] = {"format": FORMAT, "version": 2}
    path = options.get(PATH.name)
    if _reading(selected):
        section["read_through"] = str(path) if path else "fitted in this run"
    if FIT in selected:
        section.update(_fit_section(documents, options, task, output_dir, run_id))
    return {"jacobian_lens": section}


def _fit_section(documents, options, task: str, output_dir, run_id: str) -> dict[str, Any]:
    import torch

    J, counts, identity = fitted_lens(documents)
    estimator = options.get(ESTIMATOR.name, ESTIMATOR.default)
    fit = {"estimator": estimator}
    if estimator == "reference":
        for key, option in (
            ("skip_first_positions", SKIP), ("max_seq_len", MAX_LEN), ("dim_batch", DIM_BATCH)
        ):  # fmt: skip
            fit[key] = int(options.get(option.name, option.default))
    out: dict[str, Any] = {**counts, **fit}
    if J is None:
        out["saved"] = None
        return out
    J = J.float()
    d = J.shape[-1]
    gain = torch.linalg.matrix_norm(J) / d**0.5
    out["gain_profile"] = [float(g) for g in gain]  # ||J_l||_F / sqrt(d), l = 0..L
    save = options.get(SAVE.name)
    if save is None and output_dir is not None:  # beside the geometry file
        save = Path(output_dir) / f"jlens_{task}_{run_id or 'run'}.pt"
    out["saved"] = (
        str(save_lens(save, J, counts["fitted_on"], task, identity, fit)) if save else None
    )
    return out
