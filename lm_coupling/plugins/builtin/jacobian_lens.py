"""Built-in Jacobian lens: fit ``J_l`` on a sample and read every document through it, in one run.

Gurnee et al. (2026): ``lens_l(h) = W_U N(J_l h) + b``, ``J_l = E[d x^L_n / d x^l_n]``
(math: ``lm_coupling.metrics.jacobian_lens``). Written against the public
contract only:

1. **Fit** (``jlens_fit``, a sampled metric, brought into the selection by
   the reading metrics unless ``jlens_path`` is given): on ``jlens_docs``
   documents of each task (the seeded sample), the engine's dense block
   Jacobians (``JacobianRequest(dense=True)``) give each document's
   ``d x^L_n / d x^l_n = (I + J^L) ... (I + J^{l+1})``; the task's lens is
   their average.
2. **Read** (``jlens_entropy``, ``jlens_tv_to_target``,
   ``jlens_fixation_depth``: deferred metrics): while lm-eval's batches run,
   the reducer keeps per document only what the read needs, ``x^l_n`` for
   l = 0..L (``(L+1) d`` numbers) and the gold token; once the task is
   measured (``lmc_complete_task``, before lm-eval scores it) the fitted lens
   reads every document, exactly as if it had been fitted before the run,
   with the lens plugin's own reducer and reduction (not a copy). With
   ``jlens_path=FILE`` the lens is loaded instead of fitted (fit once per
   model, reuse across tasks).

The fitted lens is saved beside the geometry file
(``jlens_<task>_<timestamp>.pt``), or where ``jlens_save`` says.
Lens file (``torch.save``; load with ``torch.load(path, weights_only=True)``):
``{"format": "lm_coupling.jacobian_lens", "version": 1, "jacobians": [L+1, d, d]
float32 (rows: output coordinates; J_L = I), "n_documents": int, "task": str,
"n_layers": L, "d_model": d}`` (docs/outputs.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.options import parse_doc_count
from lm_coupling.plugins.specs import UNIT_INTERVAL, JacobianRequest, MetricSpec, OptionSpec

if TYPE_CHECKING:
    import torch

    from lm_coupling.model.architecture import ModelParts
    from lm_coupling.states import BatchInfo

FORMAT = "lm_coupling.jacobian_lens"
VERSION = 1
FIT = "jlens_fit"
READ = {  # each J-lens metric and the lens metric whose definition it shares
    "jlens_entropy": "logit_lens_entropy",
    "jlens_tv_to_target": "tv_to_target",
    "jlens_fixation_depth": "fixation_depth",
}
DEFAULT_DOCS = 8


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
        frozenset({"hidden_states"}),
        options=(PATH, DOCS, SAVE),
        profiles=(name,) if profile else (),
        higher_is_better=False if profile else None,
        opt_in=True,
        label=label,
        bounds=UNIT_INTERVAL,
        deferred=True,
        requires=_fit_unless_loaded,
    )


@hookimpl
def lmc_declare_metrics():
    """Declare jlens_fit and the three J-lens metrics."""
    return [
        MetricSpec(
            FIT,
            "fits the Jacobian lens on its sample; value: mean over l < L of "
            "||d x^L_n / d x^l_n||_F / sqrt(d)",
            frozenset({"jacobian"}),
            options=(DOCS, SAVE),
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


class JacobianLens:
    """The Jacobian lens as a `lm_coupling.states.Lens`: ``W_U N(J_l x) + b``.

    Args:
        jacobians: ``[L+1, d, d]`` the fitted ``J_l``.
        parts: the model's parts (its final norm and unembedding).
    """

    name = "jacobian"

    def __init__(self, jacobians: torch.Tensor, parts: ModelParts):
        self.jacobians = jacobians
        self.parts = parts

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` logits of ``hidden [B, d]`` (``x^layer_n``), float32 (float64 stays)."""
        import torch

        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        J = self.jacobians[layer].to(device=hidden.device, dtype=dtype)
        moved = hidden.to(dtype) @ J.T
        return self.parts.unembed_fp32(self.parts.final_norm_fp32(moved))


def save_lens(path: str | Path, jacobians: torch.Tensor, n_documents: int, task: str) -> Path:
    """Write a fitted lens in the documented format; returns the file written."""
    import torch

    path = Path(path)
    if path.suffix != ".pt":
        path = path / f"jlens_{task}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "jacobians": jacobians.detach().to("cpu", torch.float32).contiguous(),
        "n_documents": int(n_documents),
        "task": task,
        "n_layers": int(jacobians.shape[0] - 1),
        "d_model": int(jacobians.shape[-1]),
    }
    torch.save(record, path)
    return path


def load_lens(path: str | Path, n_layers: int, d_model: int) -> dict[str, Any]:
    """Read a lens file and check it fits a model of L blocks and width d.

    Raises:
        ConfigurationError: the file is missing, not a lens, or of another shape.
    """
    import torch

    from lm_coupling.errors import ConfigurationError

    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(
            f"jlens_path={path} is not a file; leave jlens_path out to fit the lens in the run "
            "(jlens_fit then comes in by itself; docs/metrics.md, 'The Jacobian lens')"
        )
    record = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ConfigurationError(f"jlens_path={path} is not a Jacobian lens file ({FORMAT})")
    J = record["jacobians"]
    if tuple(J.shape) != (n_layers + 1, d_model, d_model):
        raise ConfigurationError(
            f"jlens_path={path} holds a lens of shape {tuple(J.shape)}; this model needs "
            f"[{n_layers + 1}, {d_model}, {d_model}] (L = {n_layers}, d = {d_model}): fit it on "
            "this model"
        )
    return record


def _reading(selected) -> list[str]:
    return [name for name in READ if name in selected]


STATES, TARGET = "jlens_states", "jlens_target"
"""The reducer's per-document summaries: ``x^l_n`` for l = 0..L, and the gold token."""


class StatesAtTarget:
    """Keeps ``x^l_n`` of every row for l = 0..L (``[B, L+1, d]``) and the gold tokens."""

    def __init__(self, batch: BatchInfo):
        self.target = batch.target_tokens
        self.columns: list = []

    def update(self, view) -> None:
        """Keep the rows at n of state ``x^l``."""
        self.columns.append(view.at_n.detach())

    def finalize(self) -> dict[str, Any]:
        """``{"jlens_states": [B, L+1, d], "jlens_target": [B]}``."""
        import torch

        return {STATES: torch.stack(self.columns, dim=1), TARGET: self.target.clone()}


@hookimpl
def lmc_layer_reducer(selected, batch: BatchInfo):
    """Keep what the read needs: the states at n and the gold token."""
    return StatesAtTarget(batch) if _reading(selected) else None


@hookimpl
def lmc_jacobian_request(selected):
    """Dense block Jacobians for the fit's sample."""
    return JacobianRequest(k=1, dense=True) if FIT in selected else None


def _fit_batch(states) -> dict[str, Any]:
    """Per sampled document: its total Jacobians (summary) and their mean gain (value)."""
    import math

    import torch

    from lm_coupling.metrics.jacobian_lens import jacobian_products

    L, d = states.n_layers, states.d_model
    gains, products = [], []
    for factors in states.jacobians or [None] * states.size:
        if factors is None or factors.dense is None:
            gains.append(math.nan)
            products.append(torch.full((L + 1, d, d), math.nan))
            continue
        P = jacobian_products(factors.dense).cpu()
        products.append(P)
        gains.append(float(torch.linalg.matrix_norm(P[:L]).mean() / math.sqrt(d)))
    return {
        "values": {FIT: torch.tensor(gains, dtype=torch.float64)},
        "summaries": {FIT: torch.stack(products)},
    }


@hookimpl
def lmc_compute_batch(selected, states, reduced):
    """The fit's per-document products; for the read, the states it needs (as summaries)."""
    out: dict[str, dict] = {"values": {}, "profiles": {}, "summaries": {}}
    if FIT in selected and states.jacobians:
        out.update(_fit_batch(states))
    if _reading(selected) and reduced is not None:
        out["summaries"] = {STATES: reduced[STATES], TARGET: reduced[TARGET]}
    return out


def fitted_lens(documents) -> tuple[torch.Tensor | None, int, int]:
    """``(J [L+1, d, d] float64, documents fitted on, left out)`` from the sample's products."""
    import numpy as np
    import torch

    rows = [doc.summaries.get(FIT) for doc in documents]
    rows = [np.asarray(r) for r in rows if r is not None]
    kept = [r for r in rows if np.isfinite(r).all()]
    if not kept:
        return None, 0, len(rows)
    J = torch.from_numpy(np.mean(np.stack(kept).astype(np.float64), axis=0))
    return J, len(kept), len(rows) - len(kept)


def read_through(lens: JacobianLens, states, targets, selected, chunk: int = 64) -> dict:
    """The lens metrics of documents read through ``lens``, with the lens plugin's own code.

    Args:
        lens: the fitted lens.
        states: ``[N, L+1, d]`` ``x^l_n`` of each document (host or device).
        targets: ``[N]`` the gold tokens (-1: none).
        selected: the J-lens metrics wanted.
        chunk: documents read at once (bounds the ``[chunk, V]`` logits).

    Returns:
        ``{"values": {name: [N]}, "profiles": {name: [N, L+1]}}``.
    """
    import torch

    from lm_coupling.metrics.lens import lens_summary
    from lm_coupling.plugins.builtin import lens as lens_plugin
    from lm_coupling.states import LensStates

    parts = lens.parts
    shared = [READ[name] for name in selected]
    back = {lens_name: name for name, lens_name in READ.items()}
    out: dict[str, dict[str, list]] = {"values": {}, "profiles": {}}
    for start in range(0, states.shape[0], chunk):
        rows = states[start : start + chunk].to(parts.input_device)
        target = targets[start : start + chunk].to(torch.long)
        columns = []
        with torch.no_grad():  # one state at a time: [chunk, V] logits, not [chunk, L+1, V]
            for layer in range(rows.shape[1]):
                logits = lens.logits(layer, rows[:, layer])
                columns.append(
                    lens_summary(logits[:, None], target.to(logits.device), check_target=False)
                )
        entropy, target_prob, top1 = (torch.cat(c, dim=1) for c in zip(*columns, strict=True))
        reduced = LensStates(entropy=entropy, target_prob=target_prob, top1=top1)
        answer = lens_plugin.lmc_compute_batch(selected=shared, reduced=reduced)
        for kind in ("values", "profiles"):
            for name, tensor in answer.get(kind, {}).items():
                out[kind].setdefault(back[name], []).append(tensor.detach().cpu())
    return {kind: {k: torch.cat(v) for k, v in part.items()} for kind, part in out.items()}


@hookimpl
def lmc_complete_task(selected, options, documents, parts: ModelParts):
    """Fit the task's lens from its sample (or load it), then read every document through it.

    Raises:
        ValueError: no sampled document gave a finite fit (the read is then NaN
            on the task, reported as this plugin's failure).
    """
    reading = _reading(selected)
    if not reading:
        return None
    import numpy as np
    import torch

    path = options.get(PATH.name)
    if path is not None:
        J = load_lens(path, parts.n_layers, parts.d_model)["jacobians"]
    else:
        J, fitted, _ = fitted_lens(documents)
        if J is None:
            raise ValueError(
                "no document of the fit's sample (jlens_docs) gave finite Jacobians, so no "
                "lens was fitted"
            )
    weight = next(parts.blocks[0].parameters(), None)
    wide = weight is not None and weight.dtype == torch.float64
    dtype = torch.float64 if wide else torch.float32  # as capture reduces: float64 stays
    lens = JacobianLens(J.to(parts.input_device, dtype), parts)
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
    section: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    path = options.get(PATH.name)
    if _reading(selected):
        section["read_through"] = str(path) if path else "fitted in this run"
    if FIT in selected:
        section.update(_fit_section(documents, options, task, output_dir, run_id))
    return {"jacobian_lens": section}


def _fit_section(documents, options, task: str, output_dir, run_id: str) -> dict[str, Any]:
    import torch

    J, fitted, left_out = fitted_lens(documents)
    out: dict[str, Any] = {"fitted_on": fitted, "left_out": left_out}
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
    out["saved"] = str(save_lens(save, J, fitted, task)) if save else None
    return out
