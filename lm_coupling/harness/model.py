"""`CouplingHFLM`: lm-eval's ``hf`` model that also measures geometry.

It captures the states of lm-eval's own batched forward passes (the
log-likelihood batches, and the prefill of generation) and maps every batch
row back to its document through lm-eval's reordering, context grouping,
truncation and padding. Without an active geometry session it is exactly
lm-eval's ``hf`` model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lm_eval.api.instance import Instance

import lm_coupling
from lm_coupling.catalogue import CONFIG_KEY, Catalogue
from lm_coupling.geometry import DocumentGeometry, GeometryRunner
from lm_coupling.harness import preflight
from lm_coupling.harness.interrupt import counting_requests
from lm_coupling.harness.lm_eval_adapter import HFLMWithHooks, encode_pair, loglikelihood_input
from lm_coupling.harness.plan import DocumentPlan, GeometryKey
from lm_coupling.harness.progress import geometry_progress, sampled_in_requests
from lm_coupling.harness.rows import RowIndex, rows_per_target, share_untargeted
from lm_coupling.harness.session import GeometrySession, plugin_versions

if TYPE_CHECKING:
    from lm_coupling.harness.run_config import RunConfig


class CouplingHFLM(HFLMWithHooks):
    """lm-eval's Hugging Face model with geometry capture.

    It overrides five public methods of HFLM (``get_model_info``,
    ``loglikelihood``, ``generate_until``, ``tok_batch_encode``,
    ``gather_object``) and the public hooks `HFLMWithHooks` puts on HFLM's
    private steps. `lm_coupling.harness.run` builds one per run, then its
    session (`open_session`); without a session it is exactly lm-eval's
    ``hf`` model. It takes lm-eval's ``HFLM`` arguments (``pretrained`` may
    be a model in memory).
    """

    # Class defaults (HFLM's __init__ is not overridden), replaced on the instance.
    _lmc_session: GeometrySession | None = None
    _lmc_rows: RowIndex | None = None  # the wanted requests by model input, while scoring
    _lmc_gen_contexts: list[str] | None = None
    _lmc_gathered = False
    _lmc_probing = False
    _lmc_progress: Any = None  # the sampled documents' tqdm line, while scoring
    _lmc_model_source: Mapping[str, Any] | None = None  # a GGUF file and its quantisation

    def open_session(self, run: RunConfig) -> GeometrySession:
        """Build the run's session (runner checked by `preflight.check_model`, cache) and use it.

        Raises:
            RuntimeError: a session is already open on this model.
            UnsupportedModelError: the model cannot give the selected metrics.
        """
        if self._lmc_session is not None:
            raise RuntimeError("this CouplingHFLM already measures a run; build one per run")
        selection = run.selection
        runner = GeometryRunner(self.model, selection)
        runner.plugins.deferred = True  # warned once per task, every document counted (outputs)
        preflight.check_model(self.model, runner.parts, runner.selection)
        prefix = run.evaluator.use_cache
        session = GeometrySession(
            selection,
            runner=runner,
            model_shape={
                "model_type": getattr(self.model.config, "model_type", None),
                "n_layers": runner.parts.n_layers,
                "d_model": runner.parts.d_model,
                "vocab_size": runner.parts.vocab_size,
                "n_params": sum(p.numel() for p in self.model.parameters()),
            },
            cache=self._geometry_cache(prefix, selection) if prefix else None,
            lm_eval_options=dict(run.lm_eval_options),
        )
        session.announce_changed_options()
        self._lmc_session = session
        self._lmc_model_source = run.model_source
        return session

    def _geometry_cache(self, prefix: str, selection: Any) -> Any:
        """The geometry cache beside lm-eval's ``--use_cache`` database."""
        from lm_coupling.harness.cache import GeometryCache, weights_fingerprint

        identity = {
            "model": self.pretrained if isinstance(self.pretrained, str) else None,
            "revision": self.revision,
            "weights": weights_fingerprint(self.model),
            "dtype": str(self.model.dtype),
            "max_length": self.max_length,
            "metrics": selection.metrics,
            "options": selection.options,
            "lm_coupling": lm_coupling.__version__,
            "plugins": plugin_versions(selection),
        }
        return GeometryCache(f"{prefix}_geometry_rank{self.rank}.db", identity)

    # Override: the results' model info is HFLM's; no hook adds to it.
    def get_model_info(self) -> dict[str, Any]:
        """lm-eval's model info plus lm-coupling's provenance (``config.lm_coupling``)."""
        info = super().get_model_info()
        session = self._lmc_session
        if session is not None:
            report = session.records.capture_report()
            info["lm_coupling"] = {
                "version": lm_coupling.__version__,
                "metrics": list(session.selection.metrics),
                "options": session.options_used(),
                "options_requested": session.options_changed(),
                "lm_eval_options": session.lm_eval_options,
                "model_shape": session.model_shape,
                "plugins": plugin_versions(session.selection),
                "capture": {task: part["capture"] for task, part in report.items()},
                "n_measured": {task: part["n_measured"] for task, part in report.items()},
                CONFIG_KEY: Catalogue.from_specs(session.selection.specs.values()).to_json(),
            }
            if self._lmc_model_source is not None:
                info["lm_coupling"]["model_source"] = dict(self._lmc_model_source)
        return info

    # -- log-likelihood requests --------------------------------------------
    # Override: the only place the requests (with their documents) reach the model.
    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """Plan the requests' documents, then run lm-eval's loglikelihood."""
        with self._geometry_progress(requests, disable_tqdm):
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    @contextlib.contextmanager
    def _geometry_progress(self, requests: list[Instance], disable: bool) -> Iterator[None]:
        """Plan the requests' documents; show the sampled documents' progress meanwhile."""
        session = self._lmc_session
        if session is None:  # exactly lm-eval's hf model
            yield
            return
        session.plans.plan_requests(requests)
        sampled = session.runner.sampled_metrics
        total = sampled_in_requests(session, requests)
        self._lmc_progress = geometry_progress(",".join(sampled), total, disable=disable)
        try:
            with counting_requests(self, requests):  # Ctrl-C says how far it got
                yield
        finally:
            self._lmc_progress.close()
            self._lmc_progress = None

    @contextlib.contextmanager
    def encoded_requests(self, requests: list[Any]) -> Iterator[None]:
        """Index the wanted requests by their model input while HFLM scores them."""
        session = self._lmc_session
        if session is not None:
            self._lmc_rows = RowIndex.of_requests(self, requests, session.measurements)
        try:
            yield
        finally:
            self._lmc_rows = None

    def forward_batch(self, inps: torch.Tensor, call: Callable[..., torch.Tensor]) -> torch.Tensor:
        """One forward batch of lm-eval's scoring: its wanted rows measured under capture.

        A key whose lens target differs from its row's other keys (duplicate
        prompts) is measured on a copy of the row appended to the same forward
        pass (``call(full)``); lm-eval gets the logits of its own rows only.
        """
        session = self._lmc_session
        if self._lmc_probing:
            return self._probe_call(inps, call)
        if session is None or not self._lmc_rows:
            return call()
        matched = []
        for b, plans in self._lmc_rows.match(inps):
            plans = [plan for plan in plans if session.measurements.wanted(plan.key)]
            if plans:
                matched.append((b, plans))
        if not matched:
            return call()
        batch = inps.shape[0]
        rows, copies = rows_per_target(matched, batch)
        full = torch.cat([inps, inps[copies]]) if copies else inps
        logits = self._captured_call(
            (lambda: call(full)[:batch]) if copies else call,
            session,
            [(row, p.key, (p.last_index, 0, p.target_token)) for row, plans in rows for p in plans],
            {batch + j: b for j, b in enumerate(copies)},
        )
        self._measure_sampled(
            session, [(plan.key, plan.context_tokens) for _, plans in matched for plan in plans]
        )
        return logits

    # -- generation ------------------------------------------------------------
    # Override: as loglikelihood, for generation requests.
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Plan the requests' documents, then run lm-eval's generate_until."""
        with self._geometry_progress(requests, disable_tqdm):
            return super().generate_until(requests, disable_tqdm=disable_tqdm)

    # Override: the only place a generation batch's context strings are seen.
    def tok_batch_encode(self, strings: list[str], *args: Any, **kwargs: Any) -> Any:
        """Remember the contexts of the batch lm-eval is about to generate for."""
        self._lmc_gen_contexts = list(strings)
        return super().tok_batch_encode(strings, *args, **kwargs)

    def generate_batch(
        self, context: torch.Tensor, generation_kwargs: dict[str, Any], call: Callable[[], Any]
    ) -> torch.Tensor:
        """One generation batch: the prefill of its wanted rows measured under capture."""
        session = self._lmc_session
        contexts, self._lmc_gen_contexts = self._lmc_gen_contexts, None
        if session is None or contexts is None or len(contexts) != context.shape[0]:
            return call()
        mask = generation_kwargs.get("attention_mask")
        batch, width = context.shape
        first = (mask == 0).sum(dim=1).tolist() if mask is not None else [0] * batch
        matches = []
        for b, text in enumerate(contexts):
            row_target = None
            for key in session.plans.generation_keys.get(text, ()):
                if not session.measurements.wanted(key):
                    continue
                target = self._lens_target(session, key)
                if row_target is None:
                    row_target = target
                elif target != row_target:  # another lens target: measured alone later
                    continue
                matches.append((b, key, (width - 1, first[b], target)))
        if not matches:
            return call()
        output = self._captured_call(call, session, matches)
        sampled = [(b, key) for b, key, _ in matches if session.plans.sampled(key)]
        if sampled:  # the prompt's tokens leave the device only for the engine
            self._measure_sampled(
                session, [(key, tuple(context[b, first[b] :].tolist())) for b, key in sampled]
            )
        return output

    def _lens_target(self, session: GeometrySession, key: GeometryKey) -> int:
        """The gold continuation's first token; -1 without one (a warning names the cause)."""
        context, gold = key
        if not gold or not context:  # the plan's target_problem names the cause
            return -1
        continuation = encode_pair(self, context, gold)[1]
        if continuation:
            return continuation[0]
        targeted = [n for n, s in session.selection.specs.items() if s.reads_target]
        session.plans.warn_key(
            key,
            f"{', '.join(targeted) or 'the lens target'} is undefined (NaN): the gold answer "
            f"{gold!r} encodes to no token after its context, so the lens has no target",
        )
        return -1

    # -- shared capture plumbing -------------------------------------------------
    def _captured_call(
        self,
        call: Callable[[], Any],
        session: GeometrySession,
        matches: list[tuple[int, GeometryKey, tuple[int, int, int]]],
        copies: dict[int, int] | None = None,
    ) -> Any:
        """Run ``call`` under capture; a failed capture runs it again without (the output stands).

        ``matches``: ``(row, key, (last, first, target))`` of each measured key
        (a row is captured at its first key's positions). ``copies``: appended copy
        row -> its original row (`share_untargeted`).
        """
        keys = [key for _, key, _ in matches]
        preflight.check_first_batch(self, session, keys)
        runner = session.runner
        if not runner.needs_forward_capture:
            for key in keys:
                session.measurements.store(key, DocumentGeometry(), "in_batch")
            return call()
        output, error = None, None
        try:
            start = time.perf_counter()
            positions = {b: where for b, _, where in reversed(matches)}  # a row's first key's
            measured = sorted(positions)  # position i of the capture is row measured[i]
            at = {b: i for i, b in enumerate(measured)}
            # A row shared by duplicate prompts measures all their documents.
            refs: list[tuple] = [()] * len(measured)
            for b, key, _ in matches:
                refs[at[b]] = refs[at[b]] + session.plans.documents_at(key)
            last, first, target = ([positions[b][i] for b in measured] for i in range(3))
            with runner.capture(last, first, target, refs, measured) as handle:
                output = call()
            forward = (time.perf_counter() - start) / max(len(matches), 1)
            documents = runner.compute(handle)
            share_untargeted(documents, at, copies or {}, session.selection.specs)
            stored: set[int] = set()
            for b, key, _ in matches:
                document = documents[at[b]]
                document.timings["forward_capture"] = forward
                session.measurements.store(
                    key, document if b not in stored else document.copy(), "in_batch"
                )
                stored.add(b)
        except Exception as exc:  # geometry must never cost the benchmark its scores
            error = repr(exc)  # the text only: the traceback must not outlive this block
        if error is not None:
            handle = None
            session.measurements.fail(keys, error)
            if output is None:
                if torch.cuda.is_available():  # freed accelerator memory back for the retry
                    torch.cuda.empty_cache()
                output = call()
        return output

    def _measure_sampled(
        self, session: GeometrySession, documents: list[tuple[GeometryKey, tuple[int, ...]]]
    ) -> None:
        """The sampled (Jacobian) metrics of a batch's documents: one engine call per group.

        Documents are grouped by the sampled metrics they need; a failure of a
        whole group makes its documents' sampled values NaN.
        """
        runner = session.runner
        by_tokens: dict[tuple[int, ...], list[GeometryKey]] = {}
        for key, tokens in documents:
            if session.plans.sampled(key):
                by_tokens.setdefault(tokens, []).append(key)
        groups: dict[tuple[str, ...], list[tuple[GeometryKey, tuple[int, ...]]]] = {}
        for tokens, keys in by_tokens.items():
            wanted = set().union(*(session.measurements.needed_metrics(key) for key in keys))
            metrics = tuple(m for m in runner.sampled_metrics if m in wanted)
            groups.setdefault(metrics, []).append((keys, tokens))
        for metrics, group in groups.items():
            error, results = None, []
            try:
                prompts = [
                    torch.tensor(tokens, dtype=torch.long, device=self.device)
                    for _, tokens in group
                ]
                refs = [
                    sum((session.plans.documents_at(key) for key in keys), ()) for keys, _ in group
                ]
                results = runner.compute_sampled_batch(prompts, metrics, documents=refs)
            except Exception as exc:
                error = repr(exc)  # the text only: the traceback must not outlive this block
            if error is not None:
                session.measurements.fail(
                    [key for keys, _ in group for key in keys], error, metrics=metrics
                )
            for (keys, _), result in zip(group, results, strict=False):
                if isinstance(result, Exception):
                    session.measurements.fail(keys, repr(result), metrics=metrics)
                    continue
                for i, key in enumerate(keys):
                    session.measurements.store(key, result if i == 0 else result.copy())
            if self._lmc_progress is not None:
                self._lmc_progress.update(sum(len(keys) for keys, _ in group))

    # -- batch size detection ------------------------------------------------------
    @contextlib.contextmanager
    def batch_size_search(self) -> Iterator[None]:
        """lm-eval's ``--batch_size auto`` search, captured (room left for the capture)."""
        self._lmc_probing = self._lmc_session is not None
        try:
            yield
        finally:
            self._lmc_probing = False

    def _probe_call(self, inps: torch.Tensor, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One probe batch of the batch-size search, captured like a real one."""
        runner = self._lmc_session.runner
        if not runner.needs_forward_capture:
            return call()
        batch, width = inps.shape
        with runner.capture([width - 1] * batch, [0] * batch, [0] * batch) as handle:
            logits = call()
        runner.compute(handle)
        return logits

    def measure_alone(self, plan: DocumentPlan) -> DocumentGeometry:
        """Measure a document's prompt alone (documents lm-eval answered from its cache)."""
        session = self._lmc_session
        context, continuation = plan.key
        if plan.kind == "generate_until":
            # HFLM's own left truncation (as generate_until applies it), the request's budget.
            max_gen_toks = plan.max_gen_toks if plan.max_gen_toks is not None else self.max_gen_toks
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks)
            target = self._lens_target(session, plan.key)
        else:
            context_enc, continuation_enc = encode_pair(self, context, continuation)
            inp, last = loglikelihood_input(self, context_enc, continuation_enc)
            if last < 0:
                raise ValueError(
                    f"the answer alone ({len(continuation_enc)} tokens) fills the model's "
                    f"max_length ({self.max_length}): no context position is left to measure"
                )
            ids, target = inp[: last + 1], continuation_enc[0]
        return session.runner.measure_prompt(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            target,
            sampled=session.plans.sampled(plan.key),
            documents=session.plans.documents_at(plan.key),
        )

    # -- data parallel ------------------------------------------------------------
    # Override: lm-eval's first gather of a run carries the geometry records along.
    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Gather the per-document geometry with lm-eval's first gather of a run."""
        session = self._lmc_session
        if session is not None and self.world_size > 1 and not self._lmc_gathered:
            self._lmc_gathered = True
            gathered = super().gather_object(dict(session.records.tasks), dst)
            if self.rank == dst:
                session.records.merge(gathered)
        return super().gather_object(obj, dst)
