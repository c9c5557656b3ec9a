"""State of one geometry run: selection, plans, measured documents, outputs.

One `GeometrySession` lives for one ``lm_eval ... --metrics`` run. The model
wrapper plans documents from the requests lm-eval hands it and fills the
session during the forward passes; the task glue reads it when lm-eval scores
each document; the run's end writes the geometry files.

Every document's trajectory/lens geometry has one source, counted per task
(`task_records.CAPTURE_SOURCES`): captured inside lm-eval's own batch (``in_batch``),
measured alone afterwards (``alone``: documents lm-eval answered from its
response cache, or rows the batch matching missed), read from the geometry
cache (``cached``), or ``failed`` (NaN, with a warning naming the document).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lm_coupling.errors import GeometryWarning
from lm_coupling.geometry import DocumentGeometry, GeometryRunner
from lm_coupling.harness.lm_eval_adapter import reported_doc_id, templates_compiled_once
from lm_coupling.harness.plan import DocumentId, DocumentPlan, GeometryKey, plan_document
from lm_coupling.harness.sample import TaskSample, task_sample
from lm_coupling.harness.task_records import TaskRecords
from lm_coupling.plugins.specs import used_k
from lm_coupling.selection import Selection
from lm_coupling.states import DocumentRef

log = logging.getLogger("lm_coupling")
_NO_METRICS: frozenset[str] = frozenset()


def _requests_by_document(task: Any) -> dict[int, list[Any]]:
    """Every request of an lm-eval task (its ``instances``), by ``doc_id``."""
    index: dict[int, list[Any]] = defaultdict(list)
    for instance in getattr(task, "instances", None) or ():
        index[instance.doc_id].append(instance)
    return index


class GeometrySession:
    """Everything one run measures, keyed the way lm-eval asks for it.

    Built whole, once per run, by the run's model (`CouplingHFLM.open_session`:
    the run's configuration, then the runner on the loaded model, then the
    cache) and handed to the task manager (`GeometryTaskManager`); nothing
    outside it writes its attributes, and it holds no reference to the model:
    the task glue passes the model's ``measure_alone`` to `geometry_for`.

    Args:
        selection: the run's metrics and options.
        runner: the geometry runner on the run's model.
        model_shape: layers, width, parameters and vocabulary of the model.
        cache_path_prefix: lm-eval's ``--use_cache`` path, if any (documents
            it answers are measured alone, as expected).
        cache: the geometry cache (a ``GeometryCache``) beside lm-eval's
            ``--use_cache`` database, else None.
        lm_eval_options: the lm-eval options the run uses, as the results
            record them (`lm_coupling.harness.run_options.check_run_options`).
    """

    def __init__(
        self,
        selection: Selection,
        *,
        runner: GeometryRunner | None = None,
        model_shape: dict[str, Any] | None = None,
        cache_path_prefix: str | None = None,
        cache: Any = None,
        lm_eval_options: dict[str, Any] | None = None,
    ):
        self.selection = selection
        self._first_batch_claimed = False  # preflight's read-out check, once per run
        self.lm_eval_options: dict[str, Any] = dict(lm_eval_options or {})
        self.runner = runner
        self.model_shape: dict[str, Any] = dict(model_shape or {})
        self.tasks: dict[str, Any] = {}
        self.plans: dict[DocumentId, DocumentPlan | None] = {}
        self.plans_by_key: dict[GeometryKey, list[DocumentPlan]] = defaultdict(list)
        self.measured: dict[GeometryKey, DocumentGeometry] = {}
        self.sources: dict[GeometryKey, str] = {}
        self.failed_keys: set[GeometryKey] = set()
        self.records: dict[str, TaskRecords] = defaultdict(TaskRecords)
        self.cache = cache  # a GeometryCache when lm-eval's --use_cache is on
        self.cache_path_prefix = cache_path_prefix
        self.generation_keys: dict[str, list[GeometryKey]] = defaultdict(list)
        self.results: dict[str, Any] | None = None  # lm-eval's results, once saved
        self.sample_sizes: dict[str, int | None] = {
            name: selection.options.get(spec.sample_option)
            for name, spec in selection.specs.items()
            if spec.sampled
        }
        self.samples: dict[str, TaskSample] = {}
        self._task_instances: dict[str, dict[int, list[Any]]] = {}
        self._warned: set[Any] = set()
        self._scored: set[DocumentId] = set()
        self._completed: set[str] = set()  # tasks whose deferred metrics are computed
        self._own_parts: dict[frozenset[str], tuple[list[str], set[str], bool]] = {}
        self._sampled_names = frozenset(n for n, spec in selection.specs.items() if spec.sampled)

    def claim_first_batch(self) -> bool:
        """True the first time only: the run's first captured batch (preflight checks it)."""
        claimed, self._first_batch_claimed = self._first_batch_claimed, True
        return not claimed

    # -- planning ---------------------------------------------------------
    def add_task(self, name: str, task: Any) -> None:
        """Register a task whose documents get geometry (its sample drawn now, before scoring)."""
        self.tasks[name] = task
        self.sample_of(name)

    def plan_requests(self, instances: Iterable[Any]) -> None:
        """Plan the documents of the requests lm-eval hands the model.

        Each document is planned from ALL of its task's requests, not only
        those that reach the model: with lm-eval's ``--use_cache``, a resumed
        run hands the model only the requests its cache cannot answer, so a
        document's answer choices may arrive split (the gold one answered from
        the cache); planning from those alone would pick the wrong gold answer.
        """
        handed: dict[tuple[str, int], list[Any]] = defaultdict(list)
        for instance in instances:
            if instance.task_name in self.tasks:
                handed[(instance.task_name, instance.doc_id)].append(instance)
        # Each document's gold answer is rendered from the task's template: compiled
        # once for all of them (lm-eval compiles it on every call otherwise). The
        # index of each task's requests is this call's own: a list per document,
        # not kept until scoring (issue 28: what geometry keeps per document).
        indexes: dict[str, dict[int, list[Any]]] = {}
        with templates_compiled_once():
            for ident in sorted(handed.keys() - self.plans.keys()):
                task_name, doc_id = ident
                if task_name not in indexes:
                    indexes[task_name] = _requests_by_document(self.tasks[task_name])
                self._add_plan(ident, indexes[task_name].get(doc_id) or handed[ident])

    def _instances_of(self, task_name: str) -> dict[int, list[Any]]:
        """Every request of a task, by document, for scoring (built once per task)."""
        index = self._task_instances.get(task_name)
        if index is None:
            index = self._task_instances[task_name] = _requests_by_document(self.tasks[task_name])
        return index

    def _add_plan(self, ident: DocumentId, instances: list[Any]) -> DocumentPlan | None:
        task_name, doc_id = ident
        sampled = self.sampled_metrics_of(task_name, doc_id)
        plan = plan_document(self.tasks[task_name], task_name, doc_id, instances, sampled)
        self.plans[ident] = plan
        if plan is not None and plan.problem is None:
            self.plans_by_key[plan.key].append(plan)
            if plan.kind == "generate_until":
                if plan.key not in self.generation_keys[plan.key[0]]:
                    self.generation_keys[plan.key[0]].append(plan.key)
        return plan

    def sample_of(self, task_name: str) -> TaskSample | None:
        """The task's document sample (drawn once, from the task alone), if a metric is sampled."""
        if not self.sample_sizes:
            return None
        if task_name not in self.samples:
            sizes = self.sample_sizes.values()
            largest = None if None in sizes else max(sizes)
            seed = self.selection.options.get("sample_seed", 0)
            self.samples[task_name] = task_sample(
                self.tasks[task_name], task_name, seed, self.lm_eval_options, largest
            )
        return self.samples[task_name]

    def sampled_metrics_of(self, task_name: str, doc_id: int) -> frozenset[str]:
        """The sampled metrics whose document sample holds the document."""
        sample = self.sample_of(task_name)
        if sample is None:
            return _NO_METRICS
        held = frozenset(
            name for name, size in self.sample_sizes.items() if sample.holds(doc_id, size)
        )
        return held or _NO_METRICS  # one shared empty set, not one per planned document

    def reported_id(self, task_name: str, doc_id: int) -> int:
        """The ``doc_id`` lm-eval's samples file gives the document of requests ``doc_id``.

        They differ under ``--samples`` (`lm_eval_adapter.reported_doc_id`);
        everything the run writes or warns names documents by this one.
        """
        samples = self.lm_eval_options.get("samples")
        if not samples:  # the common case: no --samples, the ids are lm-eval's own
            return doc_id
        chosen = samples.get(task_name) if isinstance(samples, Mapping) else None
        return reported_doc_id(chosen, doc_id)

    def sample_record(self, task_name: str) -> dict[str, Any] | None:
        """What the geometry file records of the task's sample (`TaskSample.record`)."""
        sample = self.samples.get(task_name)
        if sample is None:
            return None
        specs = self.selection.specs
        sizes = {specs[name].sample_option: size for name, size in self.sample_sizes.items()}
        return sample.record(sizes)

    def plan_for(self, task_name: str, doc_id: int) -> DocumentPlan | None:
        """The plan of a document.

        Documents the model never saw (lm-eval's response cache answered
        them) are planned here from the task's requests.

        Returns:
            None, after one warning, for a document without geometry.
        """
        ident = (task_name, doc_id)
        if ident not in self.plans:
            index = self._instances_of(task_name)
            if not index.get(doc_id):
                reported = self.reported_id(*ident)
                self._warn_once(
                    ident, f"task {task_name!r} document {reported}: no request of this "
                    "document was found, so it has no geometry"
                )  # fmt: skip
                return None
            self._add_plan(ident, index[doc_id])
        plan = self.plans[ident]
        if plan is None:
            self._warn_once(
                task_name,
                f"task {task_name!r} asks for loglikelihood_rolling (perplexity): lm-coupling "
                "measures no geometry for rolling log-likelihood, so its documents have none",
            )
        return plan

    def options_used(self) -> dict[str, Any]:
        """The options, each metric's K as used on this model (`MetricSpec.k_option`)."""
        options = dict(self.selection.options)
        d_model = self.model_shape.get("d_model")
        if d_model:
            for spec in self.selection.specs.values():
                if spec.k_option and spec.k_option in options:
                    options[spec.k_option] = used_k(options[spec.k_option], d_model)
        return options

    def announce_changed_options(self) -> None:
        """Say once, at the start of the run, which options the model changes (a K too large)."""
        used = self.options_used()
        for name, asked in self.options_changed().items():
            log.warning(
                "lm-coupling: %s=%s is more than this model can give (d_model %s): %s=%s is "
                "used; the results record both (config.lm_coupling.options and "
                "options_requested)",
                name,
                asked,
                self.model_shape.get("d_model"),
                name,
                used[name],
            )

    def options_changed(self) -> dict[str, Any]:
        """The options as requested, where the model changed them (a K it cannot hold)."""
        used = self.options_used()
        return {k: v for k, v in self.selection.options.items() if used[k] != v}

    def generation_keys_of(self, context: str) -> list[GeometryKey]:
        """The planned keys of a generation prompt (one per distinct gold answer)."""
        return self.generation_keys.get(context, [])

    def plugin_versions(self) -> dict[str, str]:
        """Metric plugins in use and their distributions, for the results file."""
        return plugin_versions(self.selection)

    def sampled_to_measure(self) -> int:
        """Planned sampled documents (distinct requests) whose Jacobian work is still to do."""
        sampled = set(self.runner.sampled_metrics) if self.runner else set()
        return sum(
            1
            for key, plans in self.plans_by_key.items()
            if any(plan.sampled for plan in plans)
            and not sampled <= set(self.measured.get(key, DocumentGeometry()).values)
        )

    def documents_at(self, key: GeometryKey) -> tuple[DocumentRef, ...]:
        """The documents measured at ``key`` (their identity, for the plugins)."""
        return tuple(
            DocumentRef(p.task_name, self.reported_id(p.task_name, p.doc_id))
            for p in self.plans_by_key.get(key, ())
        )

    def wanted(self, key: GeometryKey) -> bool:
        """Whether ``key`` is planned and not measured yet."""
        return key in self.plans_by_key and key not in self.measured

    def sampled(self, key: GeometryKey) -> bool:
        """Whether any document measured at ``key`` is in a sampled metric's sample."""
        return any(plan.sampled for plan in self.plans_by_key.get(key, ()))

    # -- measuring --------------------------------------------------------
    def store(
        self, key: GeometryKey, geometry: DocumentGeometry, source: str | None = None
    ) -> None:
        """Keep a measurement (and write it to the cache, if any).

        Args:
            key: the measured request.
            geometry: its values (merged into an earlier part, if any).
            source: ``in_batch``, ``alone`` or ``cached`` for the trajectory/lens
                part; None for a later part (the Jacobian metrics).
        """
        geometry = self._keep_measurement(key, geometry, source)
        if source is not None and not self.sampled(key):
            self._fold_profiles(key, geometry)

    def store_many(
        self, measurements: list[tuple[GeometryKey, DocumentGeometry]], source: str
    ) -> None:
        """`store` several measurements of one source; their profiles folded in together.

        The geometries are the caller's to give away (fresh from
        `GeometryRunner.compute`, one object per key): a folded geometry's
        profiles are dropped from it, not from a copy.
        """
        folded: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
        emptied: list[DocumentGeometry] = []
        for key, geometry in measurements:
            geometry = self._keep_measurement(key, geometry, source)
            if geometry.profiles and not self.sampled(key):
                for plan in self.plans_by_key.get(key, ()):
                    folded[plan.task_name].append((plan.doc_id, geometry.profiles))
                emptied.append(geometry)
        for task_name, documents in folded.items():
            self.records[task_name].add_profiles_of(documents)
        for geometry in emptied:
            geometry.profiles = {}

    def _keep_measurement(
        self, key: GeometryKey, geometry: DocumentGeometry, source: str | None
    ) -> DocumentGeometry:
        """`store`'s part shared with `store_many`: merge, keep, note the source, cache.

        Returns the geometry now kept at ``key`` (an earlier part it was merged into).
        """
        existing = self.measured.get(key)
        if existing is not None:
            existing.merge(geometry)
            geometry = existing
        self.measured[key] = geometry
        if source is not None:
            self.sources[key] = source
        if self.cache is not None and key not in self.failed_keys and source != "cached":
            try:
                self.cache.put(key, geometry)
            except Exception as exc:  # the measurement stands; only its caching failed
                self._warn_once(
                    "cache", f"the geometry cache {self.cache.path} could not be written "
                    f"({exc!r}); values are kept but not cached",
                )  # fmt: skip
        return geometry

    def _fold_profiles(self, key: GeometryKey, geometry: DocumentGeometry) -> None:
        """Fold a measurement's profiles into its documents' task summaries, then drop them.

        Only for keys no sampled metric measures (their measurement is complete
        and cached whole already): what waits for lm-eval's scoring is then the
        values alone (`TaskRecords`).
        """
        if not geometry.profiles:
            return
        for plan in self.plans_by_key.get(key, ()):
            self.records[plan.task_name].add_profiles(plan.doc_id, geometry.profiles)
        # A copy without them: the caller's object (a duplicate prompt's source) is unchanged.
        self.measured[key] = geometry.without_profiles()

    def needed_metrics(self, key: GeometryKey) -> set[str]:
        """The metrics the documents measured at ``key`` need."""
        needed = set(self.runner.streamed_metrics) if self.runner else set()
        for plan in self.plans_by_key.get(key, ()):
            needed |= plan.sampled_metrics
        return needed

    def lookup(self, key: GeometryKey) -> DocumentGeometry | None:
        """A measurement from this run, or a complete one from an earlier run's cache."""
        found = self.measured.get(key)
        if found is None and self.cache is not None:
            cached = self.cache.get(key)
            if cached is not None and self.needed_metrics(key) <= set(cached.values):
                self.store(key, cached, "cached")
                found = self.measured[key]
        return found

    def fail(
        self, keys: Iterable[GeometryKey], error: str, metrics: tuple[str, ...] | None = None
    ) -> None:
        """Record a failed measurement as NaN, with one warning per document.

        Args:
            keys: the requests whose measurement failed.
            error: the error's text (never the exception: its traceback would
                keep the failed capture's tensors alive).
            metrics: the metrics that failed (default: all).
        """
        metrics = metrics if metrics is not None else self.selection.metrics
        for key in keys:
            self.failed_keys.add(key)
            for plan in self.plans_by_key.get(key, ()):
                self.warn(plan, f"its geometry failed ({error}); values are NaN")
            failed = DocumentGeometry(values={name: math.nan for name in metrics})
            if key in self.measured:
                self.measured[key].merge(failed)
            else:
                self.measured[key] = failed
            self.sources.setdefault(key, "failed")

    def _warn_once(self, ident: Any, message: str) -> None:
        if ident in self._warned:
            return
        self._warned.add(ident)
        warnings.warn(f"lm-coupling: {message}", GeometryWarning, stacklevel=3)

    def warn_key(self, key: GeometryKey, message: str) -> None:
        """One GeometryWarning per document planned at ``key``."""
        for plan in self.plans_by_key.get(key, ()):
            self.warn(plan, message)

    def warn(self, plan: DocumentPlan, message: str) -> None:
        """One GeometryWarning per document, naming task and document."""
        ident = (plan.task_name, plan.doc_id)
        reported = self.reported_id(*ident)
        self._warn_once(ident, f"task {plan.task_name!r} document {reported}: {message}")

    # -- scoring ----------------------------------------------------------
    def geometry_for(
        self, plan: DocumentPlan, measure_alone: Callable[[DocumentPlan], DocumentGeometry]
    ) -> DocumentGeometry:
        """This run's (or the cache's) measurement, else the prompt measured alone.

        Documents lm-eval answered from its own cache never reached the model,
        so they are measured here, alone, by ``measure_alone`` (the run's
        model's `CouplingHFLM.measure_alone`).
        """
        if plan.problem is not None:
            self.warn(plan, f"{plan.problem}; its geometry is NaN")
            return DocumentGeometry(values=dict.fromkeys(self.selection.metrics, math.nan))
        found = self.lookup(plan.key)
        if found is not None:
            return found
        try:
            geometry = measure_alone(plan)
        except Exception as exc:  # a broken document must not stop the scoring
            self.fail([plan.key], repr(exc))
            return self.measured[plan.key]
        self.store(plan.key, geometry, "alone")
        return self.measured[plan.key]

    def complete_task(
        self, task_name: str, measure_alone: Callable[[DocumentPlan], DocumentGeometry]
    ) -> None:
        """Once per task, before lm-eval scores it: the deferred metrics' per-document values.

        lm-eval runs every request of the run before it scores any document,
        so every document of the task is measured here (a document lm-eval
        answered from its cache is measured alone now); the plugins owning a
        selected deferred metric (`MetricSpec.deferred`) then compute its
        values and profiles from the task's documents (``lmc_complete_task``),
        which lm-eval receives per document as it scores them.
        """
        if task_name in self._completed:
            return
        self._completed.add(task_name)
        specs = self.selection.specs
        deferred = [n for n in self.selection.metrics if specs[n].deferred]
        if not deferred or self.runner is None:
            return
        docs: list[DocumentGeometry] = []
        refs: list[DocumentRef] = []
        seen: set[int] = set()
        for doc_id in sorted(self._instances_of(task_name)):
            plan = self.plan_for(task_name, doc_id)
            if plan is None or plan.problem is not None or plan.key in self.failed_keys:
                continue
            geometry = self.geometry_for(plan, measure_alone)
            if id(geometry) in seen:  # duplicate prompts share one measurement
                continue
            seen.add(id(geometry))
            docs.append(geometry)
            refs.append(DocumentRef(task_name, doc_id))
        if docs:
            self.runner.plugins.complete_task(
                deferred, docs, refs, self.options_used(), self.runner.parts
            )

    def document_values(
        self, plan: DocumentPlan, geometry: DocumentGeometry, record: bool
    ) -> dict[str, float]:
        """The per-document values lm-eval aggregates (undefined ones left out).

        A value is undefined (NaN) for degenerate documents, and a sampled
        metric is undefined outside its document sample: lm-eval then averages
        each metric over the documents that define it.
        """
        own = self._own_geometry(plan, geometry)
        values = {k: v for k, v in own.values.items() if math.isfinite(v)}
        undefined: list[str] = []
        if len(values) < len(own.values):
            failed = {name for failure in own.failures for name in failure.get("metrics", ())}
            undefined = [name for name in own.values if name not in values and name not in failed]
        specs = self.selection.specs
        targeted = [n for n in undefined if n in specs and specs[n].reads_target]
        if targeted and plan.target_problem is not None:
            undefined = [name for name in undefined if name not in targeted]
            reported = self.reported_id(plan.task_name, plan.doc_id)
            self._warn_once(
                ("target", plan.task_name, plan.doc_id),
                f"task {plan.task_name!r} document {reported}: {', '.join(targeted)} "
                f"{'is' if len(targeted) == 1 else 'are'} undefined (NaN): {plan.target_problem}",
            )
        if undefined and plan.problem is None and plan.key not in self.failed_keys:
            self.warn(plan, f"undefined geometry (NaN) for {', '.join(undefined)}")
        if record:
            self._record(plan, own)
        return values

    def _own_geometry(self, plan: DocumentPlan, geometry: DocumentGeometry) -> DocumentGeometry:
        """The part of a measurement that belongs to ``plan``'s document."""
        metrics, profiles, sampled = self._own_metrics(plan.sampled_metrics)
        if (
            not sampled
            and not geometry.profiles
            and not geometry.failures
            and not geometry.summaries
            and geometry.jacobian_methods is None
            and len(geometry.values) == len(metrics)
            and all(name in geometry.values for name in metrics)
        ):
            return geometry  # all of it is the document's own (never changed by the caller)
        return DocumentGeometry(
            values={name: geometry.values.get(name, math.nan) for name in metrics},
            profiles={k: v for k, v in geometry.profiles.items() if k in profiles},
            jacobian_methods=geometry.jacobian_methods if sampled else None,
            timings=dict(geometry.timings),
            summaries=dict(geometry.summaries),
            failures=[f for f in geometry.failures if set(f.get("metrics", ())) & set(metrics)],
        )

    def _own_metrics(self, sampled_metrics: frozenset[str]) -> tuple[list[str], set[str], bool]:
        """``(metrics, profiles, any sampled)`` of a document in these samples (built once each)."""
        parts = self._own_parts.get(sampled_metrics)
        if parts is None:
            specs = self.selection.specs
            metrics = [
                n
                for n in self.selection.metrics
                if (not specs[n].sampled or n in sampled_metrics) and not specs[n].task_level
            ]  # a task-level metric has no per-document value: its task's value is added at the end
            profiles = {p for n in metrics for p in specs[n].profiles}
            parts = metrics, profiles, any(specs[n].sampled for n in metrics)
            self._own_parts[sampled_metrics] = parts
        return parts

    def scored(self, task_name: str, doc_id: int | None) -> bool:
        """Whether the document's geometry was already given to lm-eval (an earlier filter)."""
        return (task_name, doc_id) in self._scored

    def internal_failure(self, task_name: str, doc_id: int | None, error: str) -> None:
        """Record a document whose geometry an lm-coupling error lost (its scores are kept).

        The document counts as ``failed`` with the error in the geometry file,
        one warning names it, and the end-of-run account reports the task as
        an error: a bug here never passes as a quiet NaN.
        """
        ident = (task_name, doc_id)
        if ident in self._scored:
            return
        self._scored.add(ident)
        if doc_id is not None:
            doc_id = self.reported_id(task_name, doc_id)
        records = self.records[task_name]
        records.add(-1 if doc_id is None else doc_id, DocumentGeometry())
        records.capture["failed"] += 1
        records.failures.append({"doc_id": doc_id, "error": f"internal error: {error}"})
        self._warn_once(
            ident,
            f"task {task_name!r} document {doc_id}: geometry not attached because of an "
            f"lm-coupling error ({error}); the benchmark's own scores are kept. Please report it",
        )

    def _record(self, plan: DocumentPlan, geometry: DocumentGeometry) -> None:
        """Record a scored document once (lm-eval scores it once per filter)."""
        ident = (plan.task_name, plan.doc_id)
        if ident in self._scored:
            return
        self._scored.add(ident)
        records = self.records[plan.task_name]
        keep = not self._sampled_names.isdisjoint(geometry.values)
        doc_id = self.reported_id(*ident)
        records.add(doc_id, geometry, keep)
        self._release(plan.key)
        if plan.problem is not None:
            source, error = "failed", plan.problem
        elif plan.key in self.failed_keys:
            source, error = "failed", "its geometry failed (see the warning)"
        else:
            source, error = self.sources.get(plan.key, "alone"), None
        records.capture[source] += 1
        if error is not None:
            records.failures.append({"doc_id": doc_id, "error": error})
        for failure in geometry.failures:  # a plugin's answer failed (its metrics NaN)
            records.failures.append({"doc_id": doc_id, **failure})

    def _release(self, key: GeometryKey) -> None:
        """Drop a measurement once every document planned at ``key`` is scored.

        Its values live on in lm-eval's own per-document results and in the
        task's running summaries (`TaskRecords`).
        """
        scored = self._scored
        if all((plan.task_name, plan.doc_id) in scored for plan in self.plans_by_key.get(key, ())):
            self.measured.pop(key, None)

    def capture_report(self) -> dict[str, dict[str, Any]]:
        """Per task: ``capture`` counts and ``n_measured`` per metric.

        Warns once per task whose documents were measured alone without
        ``--use_cache`` (a second forward pass the batch matching should
        have made unnecessary).
        """
        report = {}
        for task_name, records in sorted(self.records.items()):
            alone = records.capture.get("alone", 0)
            if alone and self.cache_path_prefix is None:
                self._warn_once(
                    ("alone", task_name),
                    f"task {task_name!r}: {alone} of {records.n_documents} documents were "
                    "not found in lm-eval's batches and were measured alone afterwards (a "
                    "second forward pass). Likely cause: the model input lm-eval built (its "
                    "tokenization, truncation or padding) differs from the one planned, e.g. "
                    "a custom model subclass or chat template; the values are those of the "
                    "prompt alone.",
                )  # fmt: skip
            report[task_name] = {
                "capture": dict(records.capture),
                "n_measured": records.n_measured(self.selection.metrics),
            }
        return report

    # -- gathering across ranks --------------------------------------------
    def export_records(self) -> dict[str, TaskRecords]:
        """This rank's records, for gathering across data-parallel ranks."""
        return dict(self.records)

    def merge_records(self, gathered: list[dict[str, TaskRecords]]) -> None:
        """Replace the records by those gathered from every rank."""
        merged: dict[str, TaskRecords] = defaultdict(TaskRecords)
        for rank_records in gathered:
            for task_name, task_records in rank_records.items():
                merged[task_name].extend(task_records)
        self.records = merged


def plugin_versions(selection: Selection) -> dict[str, str]:
    """Metric plugins a selection uses and their distributions, for the results file."""
    from lm_coupling.plugins.manager import get_registry

    owners = {spec.plugin for spec in selection.specs.values()}
    versions = get_registry().distributions()
    return {name: versions.get(name, "lm-coupling (built-in)") for name in sorted(owners)}
