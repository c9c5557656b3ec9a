"""Register geometry metrics in lm-eval's own metric and aggregation registries."""

from __future__ import annotations

import lm_eval.api.metrics  # noqa: F401  (registers lm-eval's own aggregations)
from lm_eval.api import registry

from lm_coupling.plugins.specs import MetricSpec


def _passthrough(items):
    """Per-document values are computed by lm-coupling; lm-eval only averages."""
    return items


def register_with_lm_eval(specs: dict[str, MetricSpec]) -> None:
    """Declare each metric with aggregation ``mean`` and its direction.

    lm-eval then treats the metric like ``acc``: mean with closed-form
    stderr, arrows in the table, no fallback warnings.
    """
    for name, spec in specs.items():
        if name not in registry.metric_registry:
            registry.register_metric(
                metric=name, higher_is_better=spec.higher_is_better, aggregation="mean"
            )(_passthrough)


def attach_to_task(task, specs: dict[str, MetricSpec]) -> None:
    """Make ``task`` aggregate the geometry metrics (mean) and know their direction.

    The metric functions are deliberately not added to the task's own metric
    list: generation tasks call every listed function on their outputs.
    """
    mean = registry.get_aggregation("mean")
    for name, spec in specs.items():
        task._aggregation_list[name] = mean
        task._higher_is_better[name] = spec.higher_is_better
