"""Geometry metrics in lm-eval's metric registries, for the duration of a run.

lm-eval 0.4.13 looks metrics up by name in process-wide registries
(``lm_eval.api.registry``): a metric that is not registered makes lm-eval warn
and guess its direction. The per-task declaration (`attach_to_task`) is what
aggregation needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from lm_coupling.plugins.specs import MetricSpec


def _passthrough(items):
    """Per-document values are computed by lm-coupling; lm-eval only averages."""
    return items


@contextlib.contextmanager
def registered_metrics(specs: Mapping[str, MetricSpec]) -> Iterator[None]:
    """Register each geometry metric with lm-eval for the run; unregister after.

    Names lm-eval already knows are left as they are, and so are the
    registries of an lm-eval that discovers metric plugins itself (its main
    branch, `lm_eval_adapter.has_entry_point_plugins`). A frozen registry
    (``lm_eval.api.registry.freeze_all``) is opened for the registration and
    the removal, and frozen again after each.
    """
    import lm_eval.api.metrics  # noqa: F401  (lm-eval's own aggregations, registered on import)
    from lm_eval.api import registry

    from lm_coupling.harness.lm_eval_adapter import (
        METRIC_TABLES,
        has_entry_point_plugins,
        thawed,
        unregister,
    )

    tables = [getattr(registry, name) for name in METRIC_TABLES]
    added: list[str] = []
    if not has_entry_point_plugins():
        with contextlib.ExitStack() as stack:
            for table in tables:
                stack.enter_context(thawed(table))
            for name, spec in specs.items():
                if name in registry.metric_registry:
                    continue
                registry.register_metric(
                    metric=name, higher_is_better=spec.higher_is_better, aggregation="mean"
                )(_passthrough)
                added.append(name)
    try:
        yield
    finally:
        for name in added:
            for table in tables:
                unregister(table, name)


def attach_to_task(task: Any, specs: Mapping[str, MetricSpec]) -> None:
    """Make ``task`` aggregate the geometry metrics (mean) and know their direction.

    They are not added to the task's metric list: generation tasks call every listed function.
    """
    from lm_eval.api import registry

    from lm_coupling.harness.lm_eval_adapter import declare_task_metric

    mean = registry.get_aggregation("mean")
    for name, spec in specs.items():
        declare_task_metric(task, name, mean, spec.higher_is_better)
