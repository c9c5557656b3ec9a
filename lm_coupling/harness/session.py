"""State of one geometry run: its plans, its measurements and its task records."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lm_coupling.geometry import GeometryRunner
from lm_coupling.harness.measurements import MeasurementStore
from lm_coupling.harness.plan import DocumentPlan
from lm_coupling.harness.run_plans import RunPlans
from lm_coupling.harness.task_records import RunRecords
from lm_coupling.plugins.specs import used_k
from lm_coupling.selection import Selection
from lm_coupling.states import DocumentGeometry, DocumentRef

log = logging.getLogger("lm_coupling")


class GeometrySession:
    """Everything one run measures: its plans, measurements and records, and its options.

    Built once per run by the run's model (`CouplingHFLM.open_session`) and
    handed to the task manager (`GeometryTaskManager`); it holds no reference
    to the model.

    Args:
        selection: the run's metrics and options.
        runner: the geometry runner on the run's model.
        model_shape: layers, width, parameters and vocabulary of the model.
        cache: the geometry cache beside lm-eval's ``--use_cache`` database, else None.
        lm_eval_options: the lm-eval options the run uses, as the results
            record them (`lm_coupling.harness.run_options.check_run_options`).

    Attributes:
        plans: which documents are measured, their samples and reported ids (`RunPlans`).
        measurements: the measurements by request (`MeasurementStore`).
        records: the scored documents per task (`RunRecords`).
    """

    def __init__(
        self,
        selection: Selection,
        *,
        runner: GeometryRunner | None = None,
        model_shape: dict[str, Any] | None = None,
        cache: Any = None,
        lm_eval_options: dict[str, Any] | None = None,
    ):
        self.selection = selection
        self.runner = runner
        self.model_shape: dict[str, Any] = dict(model_shape or {})
        self.lm_eval_options: dict[str, Any] = dict(lm_eval_options or {})
        self.plans = RunPlans(selection, self.lm_eval_options)
        self.records = RunRecords(self.plans, cached=cache is not None)
        streamed = runner.streamed_metrics if runner else ()
        self.measurements = MeasurementStore(self.plans, self.records, streamed, cache)
        self.first_batch_checked = False  # preflight's read-out check, once per run
        self._completed: set[str] = set()  # tasks whose deferred metrics are computed

    def options_used(self) -> dict[str, Any]:
        """The options, each metric's K as used on this model (`MetricSpec.k_option`)."""
        options = dict(self.selection.options)
        d_model = self.model_shape.get("d_model")
        if d_model:
            for spec in self.selection.specs.values():
                if spec.k_option and spec.k_option in options:
                    options[spec.k_option] = used_k(options[spec.k_option], d_model)
        return options

    def options_changed(self) -> dict[str, Any]:
        """The options as requested, where the model changed them (a K it cannot hold)."""
        used = self.options_used()
        return {k: v for k, v in self.selection.options.items() if used[k] != v}

    def announce_changed_options(self) -> None:
        """Say once, at the start of the run, which options the model changes (a K too large)."""
        used, d_model = self.options_used(), self.model_shape.get("d_model")
        for name, asked in self.options_changed().items():
            log.warning(
                f"lm-coupling: {name}={asked} is more than this model can give (d_model "
                f"{d_model}): {name}={used[name]} is used; the results record both "
                "(config.lm_coupling.options and options_requested)"
            )

    # -- scoring ----------------------------------------------------------
    def complete_task(
        self, task_name: str, measure_alone: Callable[[DocumentPlan], DocumentGeometry]
    ) -> None:
        """Once per task, before lm-eval scores it: the deferred metrics' per-document values.

        Every request has run by then, so every document of the task is
        measured; the plugins owning a selected deferred metric
        (`MetricSpec.deferred`) compute its values and profiles from them
        (``lmc_complete_task``).
        """
        if task_name in self._completed:
            return
        self._completed.add(task_name)
        specs = self.selection.specs
        deferred = [n for n in self.selection.metrics if specs[n].deferred]
        if not deferred or self.runner is None:
            return
        found: dict[int, tuple[DocumentGeometry, DocumentRef]] = {}
        store = self.measurements
        for doc_id in sorted(self.plans.instances_of(task_name)):
            plan = self.plans.plan_for(task_name, doc_id)
            if plan is None or plan.problem is not None or plan.key in store.failed_keys:
                continue
            geometry = store.geometry_for(plan, measure_alone)
            # Duplicate prompts share one measurement: its first document stands for it.
            found.setdefault(id(geometry), (geometry, DocumentRef(task_name, doc_id)))
        if found:
            docs, refs = (list(column) for column in zip(*found.values(), strict=True))
            self.runner.plugins.complete_task(
                deferred, docs, refs, self.options_used(), self.runner.parts
            )

    def document_values(self, plan: DocumentPlan, geometry: DocumentGeometry) -> dict[str, float]:
        """The per-document values lm-eval aggregates (`RunRecords.document_values`).

        The document is recorded once, and its measurement released once
        every document measured at its key is scored.
        """
        source = self.measurements.source_of(plan)
        values = self.records.document_values(plan, geometry, source)
        self.measurements.release(plan.key)
        return values


def plugin_versions(selection: Selection) -> dict[str, str]:
    """Metric plugins a selection uses and their distributions, for the results file."""
    from lm_coupling.plugins.manager import get_registry

    owners = {spec.plugin for spec in selection.specs.values()}
    versions = get_registry().distributions()
    return {name: versions.get(name, "lm-coupling (built-in)") for name in sorted(owners)}
