"""Measure the selected geometry of a model's forward passes.

`GeometryRunner` ties the three layers together: capture/ gets the states out
of a Hugging Face model, the plugins turn them into per-document values with
the math in metrics/. It knows nothing of lm-eval: the harness (and any
Python caller) decides which rows of a batch are which documents.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pluggy
import torch

from lm_coupling.errors import ConfigurationError, LmCouplingError
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.calls import PluginCalls, answers
from lm_coupling.plugins.manager import get_plugin_manager
from lm_coupling.plugins.specs import JacobianRequest
from lm_coupling.selection import Selection
from lm_coupling.states import (
    STREAMED_NEEDS,
    DocumentGeometry,
    DocumentRef,
    GeometryStates,
    JacobianFactors,
)


class GeometryRunner:
    """Compute a selection of metrics on a Hugging Face causal LM.

    Args:
        model: the model (any dtype, any device map).
        selection: validated metrics and options (`lm_coupling.selection`).
        plugin_manager: defaults to the process-wide one.

    Raises:
        UnsupportedModelError: the model's blocks, final norm or unembedding
            cannot be located (raised here, before any data is read).
        ConfigurationError: a selected metric reads attention probabilities
            and the model's attention implementation gives none, or two
            plugins supply lenses of one name, or a metric reads a lens nobody supplies.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        selection: Selection,
        plugin_manager: pluggy.PluginManager | None = None,
    ):
        self.model = model
        self.selection = selection
        self.pm = plugin_manager if plugin_manager is not None else get_plugin_manager()
        self.parts = locate_model_parts(model)
        self.sampled_metrics = tuple(m for m in selection.metrics if selection.specs[m].sampled)
        self.streamed_metrics = tuple(
            m for m in selection.metrics if not selection.specs[m].sampled
        )
        self.plugins = PluginCalls(self.pm, selection)
        self.lenses: dict[str, Any] = {}
        self.collector = None
        streamed = {
            need
            for name in self.streamed_metrics
            for need in selection.specs[name].needs
            if need in STREAMED_NEEDS
        }
        if streamed:
            self.collector = self._collector(streamed)
        self._engine = None

    def _collector(self, needs: set[str]):
        from lm_coupling.capture.collector import StateCollector
        from lm_coupling.model.attention import check_attentions

        if "attentions" in needs:
            specs = (self.selection.specs[n] for n in self.streamed_metrics)
            spec = next(s for s in specs if "attentions" in s.needs)
            check_attentions(self.model, f"metric {spec.name!r} (plugin {spec.plugin!r})")
        if "lens" in needs:
            self.lenses = self._lenses()
        return StateCollector(
            self.model,
            self.parts,
            hidden_states="hidden_states" in needs,
            lens=self.lenses,
            attentions="attentions" in needs,
        )

    def _lenses(self) -> dict[str, Any]:
        """The lenses the selected metrics read, by name: the logit lens and the plugins' ones.

        A deferred metric may name a lens no plugin supplies during the run
        (one fitted on the task, read once it is measured).

        Raises:
            ConfigurationError: two lenses share a name, an answer is no lens,
                or a selected metric reads a lens no plugin supplies.
        """
        from lm_coupling.capture.lens import LogitLens

        lenses: dict[str, Any] = {"logit": LogitLens(self.parts)}
        supplied = answers(
            self.pm,
            "lmc_lens",
            selected=self.selection.metrics,
            options=self.selection.options,
            model=self.model,
            parts=self.parts,
        )
        for name, lens in supplied.items():
            if lens is None:
                continue
            if not callable(getattr(lens, "logits", None)) or not getattr(lens, "name", None):
                raise ConfigurationError(
                    f"plugin {name!r} answered lmc_lens with {lens!r}; a lens has a name and a "
                    "logits(layer, hidden [B, d]) -> [B, V] method (lm_coupling.states.Lens)"
                )
            if lens.name in lenses:
                raise ConfigurationError(
                    f"plugin {name!r} supplies a lens named {lens.name!r}, a name already taken; "
                    "give the lens a name of its own"
                )
            lenses[lens.name] = lens
        read = {self.selection.specs[m].lens for m in self.streamed_metrics}
        for metric in self.streamed_metrics:
            spec = self.selection.specs[metric]
            if "lens" in spec.needs and spec.lens not in lenses and not spec.deferred:
                raise ConfigurationError(
                    f"metric {metric!r} (plugin {spec.plugin!r}) reads the lens {spec.lens!r}, "
                    f"which no plugin supplies (lenses: {', '.join(lenses)})"
                )
        return {name: lens for name, lens in lenses.items() if name in read}

    @property
    def needs_forward_capture(self) -> bool:
        """Whether the benchmark's forward passes must be captured."""
        return self.collector is not None

    def jacobian_request(self) -> JacobianRequest | None:
        """The union of the plugins' ``lmc_jacobian_request`` answers (None: nobody asked).

        ``auto`` defers to a named route; two different named routes, or two
        different pair reductions, are an error.

        Raises:
            ConfigurationError: two plugins ask for different named routes or
                hand different pair reductions.
        """
        asked = answers(
            self.pm,
            "lmc_jacobian_request",
            selected=self.selection.metrics,
            options=self.selection.options,
            d_model=self.parts.d_model,
        )
        given = [a for a in asked.values() if a is not None]
        if not given:
            return None
        methods = {a.method for a in given} - {"auto"} or {"auto"}
        if len(methods) > 1:
            raise ConfigurationError(
                f"the selected metrics ask the Jacobian engine for different routes "
                f"({', '.join(sorted(methods))}); select metrics that agree, or set "
                "jacobian_method"
            )
        reductions = {id(a.pair_reduction): a.pair_reduction for a in given if a.pair_reduction}
        if len(reductions) > 1:
            raise ConfigurationError(
                "the selected metrics hand the Jacobian engine different pair reductions "
                f"({', '.join(getattr(r, '__qualname__', repr(r)) for r in reductions.values())})"
                "; the engine applies one: select metrics of one plugin"
            )
        return JacobianRequest(
            k=max(a.k for a in given),
            swapped=any(a.swapped for a in given),
            method=methods.pop(),
            dense=any(a.dense for a in given),
            pair_reduction=next(iter(reductions.values()), None),
            settings={k: v for a in given for k, v in a.settings.items()},
            lens_terms=next((a.lens_terms for a in given if a.lens_terms is not None), None),
        )

    @property
    def engine(self):
        """The Jacobian engine, built on first use from the plugins' requests.

        Token-wise metrics alone (position Jacobians, no factors) need no request.

        Raises:
            ConfigurationError: a selected metric needs Jacobian factors but no
                plugin asked for them (a plugin without ``lmc_jacobian_request``).
        """
        if self._engine is None:
            from lm_coupling.jacobian.engine import JacobianEngine

            request = self.jacobian_request()
            if request is None and "jacobian" not in self.selection.needs:
                request = JacobianRequest(k=1)  # position Jacobians only: no factors asked for
            if request is None:
                raise ConfigurationError(
                    "a selected metric needs block Jacobians, but no plugin implements "
                    "lmc_jacobian_request to say which factors (K, route) it needs"
                )
            self._engine = JacobianEngine(
                self.model,
                self.parts,
                k_max=request.k,
                method=request.method,
                swapped=request.swapped,
                keep_dense=request.dense,
                pair_reduction=request.pair_reduction,
                **request.settings,
            )
        return self._engine

    @contextlib.contextmanager
    def capture(
        self,
        last_index: torch.Tensor,
        first_index: torch.Tensor,
        target_tokens: torch.Tensor,
        documents: Sequence[Sequence[DocumentRef]] | None = None,
        rows: Sequence[int] | torch.Tensor | None = None,
    ) -> Iterator:
        """Capture the first forward pass run inside the block.

        The arguments are `StateCollector.capture`'s; the reducers and lenses
        are the selected plugins'.

        Yields:
            A ``CaptureHandle``, filled once the block exits; pass it to :meth:`compute`.
        """
        if self.collector is None:
            from lm_coupling.capture.collector import CaptureHandle

            refs = tuple(tuple(DocumentRef(*r) for r in row) for row in documents or ())
            parts = self.parts
            yield CaptureHandle(
                GeometryStates(
                    parts.n_layers, parts.d_model, parts.vocab_size, len(last_index), refs
                )
            )
            return
        with self.collector.capture(
            last_index,
            first_index,
            target_tokens,
            self.plugins.reducers(self.streamed_metrics, self.selection.options),
            documents,
            rows,
            self.plugins.lenses(self.streamed_metrics),
        ) as handle:
            yield handle

    def compute(self, captured, metrics: Sequence[str] | None = None) -> list[DocumentGeometry]:
        """Run the plugins on a batch; one `DocumentGeometry` per row.

        Each plugin is called on its own (`PluginCalls.compute`): a failure of
        one makes its own metrics NaN on the batch's documents, reported in
        ``DocumentGeometry.failures`` and one warning per plugin and cause.

        Args:
            captured: the handle :meth:`capture` yielded (states, reductions and
                the reducers' errors), or a `GeometryStates` (the engine's batches).
            metrics: the metrics to compute (default: the streamed ones).
        """
        metrics = tuple(metrics if metrics is not None else self.streamed_metrics)
        if isinstance(captured, GeometryStates):
            states, reduced, errors, lens_errors = captured, {}, {}, {}
        else:
            states, reduced = captured.states, captured.reduced
            errors, lens_errors = captured.errors, captured.lens_errors
        start = time.perf_counter()
        docs = [DocumentGeometry() for _ in range(states.size)]
        plugin_seconds = self.plugins.compute(
            metrics, states, docs, reduced, errors, lens_errors, self.selection.options
        )
        for name, spent in getattr(captured, "seconds", {}).items():
            plugin_seconds[name] = plugin_seconds.get(name, 0.0) + spent
        size = max(states.size, 1)
        seconds = (time.perf_counter() - start) / size
        # One key object per plugin for every document (interned): what waits for lm-eval's
        # scoring stays a few numbers per document.
        shares = {sys.intern(f"plugin:{k}"): v / size for k, v in plugin_seconds.items()}
        for doc in docs:
            doc.timings["metrics"] = seconds
            doc.timings.update(shares)
            if len(doc.values) < len(metrics):  # a failed plugin's metrics: NaN
                for name in metrics:
                    doc.values.setdefault(name, math.nan)
        return docs

    def position_jacobians(self, input_ids: torch.Tensor) -> dict:
        """``J^l_{t_in t_out}`` of one prompt ``[T]`` at the keys the plugins ask for.

        Empty unless a selected metric needs ``tokenwise_jacobian`` (hook
        ``lmc_position_jacobian_keys``).
        """
        if "tokenwise_jacobian" not in self.selection.needs:
            return {}
        asked = answers(
            self.pm,
            "lmc_position_jacobian_keys",
            selected=self.selection.metrics,
            options=self.selection.options,
            n_layers=self.parts.n_layers,
            n_tokens=int(input_ids.shape[-1]),
        )
        keys = sorted({tuple(key) for answer in asked.values() for key in answer or ()})
        return {key: self.engine.position_jacobian(input_ids, *key) for key in keys}

    def compute_sampled_batch(
        self,
        prompts: Sequence[torch.Tensor],
        metrics: Sequence[str] | None = None,
        errors: str = "return",
        documents: Sequence[Sequence[DocumentRef]] | None = None,
    ) -> list[DocumentGeometry | LmCouplingError]:
        """The sampled metrics of several prompts, their Jacobian work batched.

        Each document's values equal those of its prompt alone, up to round-off.

        Args:
            prompts: ``[T_b]`` token ids of each prompt.
            metrics: the sampled metrics to compute (default: all selected).
            errors: ``"return"`` puts a ``JacobianMismatchError`` in the
                failing prompt's place; ``"raise"`` raises it.
            documents: per prompt, the documents it measures (`DocumentRef`s).

        Returns:
            Per prompt, in order: its `DocumentGeometry`, or the
            ``JacobianMismatchError`` that makes its values NaN (record it
            as a failed document).
        """
        metrics = tuple(metrics if metrics is not None else self.sampled_metrics)
        needs = {need for name in metrics for need in self.selection.specs[name].needs}
        prompts = [torch.as_tensor(p).reshape(-1) for p in prompts]
        start = time.perf_counter()
        if "jacobian" in needs:
            results = self.engine.factors_batch(prompts, errors=errors)
        else:
            results = [None] * len(prompts)
        jacobian_seconds = (time.perf_counter() - start) / max(len(prompts), 1)
        kept = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
        rows = tuple(tuple(DocumentRef(*r) for r in row) for row in documents or ())
        docs = iter(
            self._sampled_documents(
                [prompts[i] for i in kept],
                [results[i] for i in kept],
                metrics,
                needs,
                tuple(rows[i] for i in kept) if rows else (),
            )
            if kept
            else []
        )
        out = [r if isinstance(r, Exception) else next(docs) for r in results]
        for doc, factors in zip(out, results, strict=True):
            if isinstance(doc, DocumentGeometry) and "jacobian" in needs:
                doc.timings.update(_jacobian_timings(factors, jacobian_seconds))
        return out

    def _sampled_documents(
        self,
        prompts: list[torch.Tensor],
        factors: list[JacobianFactors | None],
        metrics: tuple[str, ...],
        needs: set[str],
        documents: tuple[tuple[DocumentRef, ...], ...],
    ) -> list[DocumentGeometry]:
        states = GeometryStates(
            self.parts.n_layers,
            self.parts.d_model,
            self.parts.vocab_size,
            size=len(prompts),
            documents=documents or tuple(() for _ in prompts),
            jacobians=factors,
        )
        if "tokenwise_jacobian" in needs:
            states.tokenwise = [self.position_jacobians(ids) for ids in prompts]
        if "lens_jacobian" in needs:  # the Jacobian lens's fit terms (its estimator's module)
            from lm_coupling.jacobian.lens_fit import model_identity
            from lm_coupling.jacobian_lens_terms import lens_terms

            request = self.jacobian_request()
            settings = request.lens_terms if request is not None else None
            states.lens_jacobians = lens_terms(self, prompts, **(settings or {}))
            states.model_identity = model_identity(self.model, self.parts)
        if "authors_jacobian" in needs:  # the coupling authors' route (its own module)
            from lm_coupling.jacobian.authors import authors_jacobians

            states.authors_jacobians = authors_jacobians(self, prompts)
        docs = self.compute(states, metrics)
        for doc, one in zip(docs, factors, strict=True):
            if one is not None:
                doc.jacobian_methods = list(one.method)
        return docs

    def measure_prompt(
        self,
        input_ids: torch.Tensor,
        target_token: int = -1,
        sampled: bool = True,
        documents: Sequence[DocumentRef] = (),
    ) -> DocumentGeometry:
        """Measure one prompt alone, without padding: the reference route.

        Args:
            input_ids: ``[T]`` token ids; the target position is the last one.
            target_token: gold next token for the lens, or -1.
            sampled: also compute the Jacobian metrics.
            documents: the documents the prompt measures (`DocumentRef`s).
        """
        input_ids = torch.as_tensor(input_ids).reshape(-1)
        doc = DocumentGeometry()
        if self.collector is not None:
            handle = self.collector.capture_prompt(
                input_ids,
                target_token,
                self.plugins.reducers(self.streamed_metrics, self.selection.options),
                [tuple(documents)],
                self.plugins.lenses(self.streamed_metrics),
            )
            (doc,) = self.compute(handle)
        if sampled and self.sampled_metrics:
            (sampled_doc,) = self.compute_sampled_batch(
                [input_ids], errors="raise", documents=[tuple(documents)]
            )
            doc.merge(sampled_doc)
        return doc


def _jacobian_timings(factors: JacobianFactors | None, seconds: float) -> dict[str, Any]:
    """The engine's seconds for one document: its share of the batch, and the split per layer."""
    out: dict[str, Any] = {"jacobian": seconds}
    split = getattr(factors, "seconds", None) or {}
    for part in ("jacobian_products", "factorisation", "reduction"):
        per_layer = split.get(part)
        if per_layer is not None:
            out[f"{part}_per_layer"] = [float(s) for s in per_layer]
            out[part] = float(sum(per_layer))
    if "forward" in split:
        out["jacobian_forward"] = float(split["forward"])
    return out
