"""Geometry metrics in lm-eval's metric registries, for the duration of a run.

lm-eval 0.4.13 looks metrics up by name in process-wide registries
(``lm_eval.api.registry``) and discovers no plugins: a metric that is not
registered makes lm-eval warn and guess its direction. `registered_metrics`
adds the selected geometry metrics (aggregation ``mean`` and their direction)
for one run and removes what it added afterwards.

Upstream: lm-eval's main branch adds entry-point plugin groups
(``lm_eval.metrics``, ``lm_eval.aggregations``); where the installed lm-eval
has them (`has_metric_entry_points`), its registries are left alone. The
per-task declaration (`attach_to_task`) is what aggregation needs in either case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from lm_coupling.plugins.specs import MetricSpec


def _passthrough(items):
    """Per-document values are computed by lm-coupling; lm-eval only averages."""
    return items


def has_metric_entry_points() -> bool:
    """Whether the installed lm-eval discovers metrics through entry points.

    No released lm-eval does (0.4.13 has none); the check looks for the
    plugin loader of lm-eval's main branch, so that lm-coupling stops writing
    into the registries once a release reads the groups itself.
    """
    import lm_eval.api.registry as registry

    return any(hasattr(registry, name) for name in ("load_plugins", "load_entry_points"))


@contextlib.contextmanager
def registered_metrics(specs: Mapping[str, MetricSpec]) -> Iterator[None]:
    """Register each geometry metric with lm-eval for the run; unregister after.

    Names lm-eval already knows (its own, or registered by an earlier run that
    is still going) are left as they are.
    """
    import lm_eval.api.metrics  # noqa: F401  (lm-eval's own aggregations, registered on import)
    from lm_eval.api import registry

    added: list[str] = []
    if not has_metric_entry_points():
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
            for table in _registry_tables(registry):
                table.pop(name, None)


def _registry_tables(registry: Any) -> list[dict]:
    """The per-metric tables ``register_metric`` writes into (lm-eval's ``Registry._objs``)."""
    names = ("metric_registry", "metric_agg_registry", "higher_is_better_registry")
    tables = [getattr(getattr(registry, n, None), "_objs", None) for n in names]
    return [t for t in tables if isinstance(t, dict)]


def attach_to_task(task: Any, specs: Mapping[str, MetricSpec]) -> None:
    """Make ``task`` aggregate the geometry metrics (mean) and know their direction.

    The metric functions are deliberately not added to the task's own metric
    list: generation tasks call every listed function on their outputs.
    """
    from lm_eval.api import registry

    mean = registry.get_aggregation("mean")
    for name, spec in specs.items():
        task._aggregation_list[name] = mean
        task._higher_is_better[name] = spec.higher_is_better
