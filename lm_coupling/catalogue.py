"""The catalogue of metrics: what the rest of the package knows about each metric.

Every metric is declared once, by its plugin (`lm_coupling.plugins.specs`). A
run records the catalogue of its metrics in its results file, under
``config.lm_coupling.catalogue`` (docs/outputs.md); the report, the harness and
the tests read names, labels, bounds, profile axes and K options from it. A
results file without one is read with the installed plugins' catalogue
(`Catalogue.installed`), and the report says so. No torch, no plotting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lm_coupling.plugins.specs import (
    DEFAULT_SAMPLE_OPTION,
    PROFILE_AXES,
    MetricSpec,
    ProfileSpec,
)

CONFIG_KEY = "catalogue"
"""The key of the catalogue in the results file's ``config.lm_coupling``."""

INSTALLED = "installed plugins"
"""`Catalogue.source` of a catalogue derived from the installed plugins."""

_METRIC_FIELDS = ("label", "unit", "bounds", "higher_is_better", "sampled", "k_option", "plugin")
_SPEC_FIELDS = (
    *_METRIC_FIELDS,
    "profiles",
    "task_level",
    "sample_option",
    "primary",
    "nan_expected",
)
"""The `MetricSpec` fields a `MetricEntry` copies as they are."""
_PROFILE_FIELDS = ("axis", "label", "bounds", "min_blocks", "boundary", "plot")


@dataclass(frozen=True)
class MetricEntry:
    """One metric of a catalogue: the fields of its `MetricSpec` the outputs need (same meanings).

    ``task_level``, ``nan_expected``, a non-logit ``lens`` and a sampled
    metric's non-default ``sample_option`` are recorded only when they differ
    from the default; ``primary`` and ``method_options`` (its options declared
    ``OptionSpec.method_only``) are never recorded (the installed plugins' are used).
    """

    name: str
    label: str = ""
    unit: str = ""
    bounds: tuple[float, float] | None = None
    higher_is_better: bool | None = None
    sampled: bool = False
    k_option: str | None = None
    plugin: str = ""
    profiles: tuple[str, ...] = ()
    task_level: bool = False
    sample_option: str | None = None
    primary: bool = field(default=False, compare=False)  # not recorded: the installed one's
    lens: str = "logit"
    nan_expected: bool = False
    method_options: frozenset[str] = field(default=frozenset(), compare=False)


def _bounds(value: Any) -> tuple[float, float] | None:
    return None if value is None else (float(value[0]), float(value[1]))


@dataclass(frozen=True)
class Catalogue:
    """The metrics and profiles of one run (or of the installed plugins).

    Attributes:
        metrics: metric name -> `MetricEntry`, in declaration order.
        profiles: profile name -> `ProfileSpec`, in declaration order.
        source: where it came from: ``"results"`` (recorded by the run) or
            ``"installed plugins"`` (derived for a file without one).
    """

    metrics: dict[str, MetricEntry] = field(default_factory=dict)
    profiles: dict[str, ProfileSpec] = field(default_factory=dict)
    source: str = "results"

    # -- building ------------------------------------------------------------
    @classmethod
    def from_specs(cls, specs: Iterable[MetricSpec], source: str = "results") -> Catalogue:
        """The catalogue of ``specs`` (a selection's, or every registered metric's).

        Raises:
            ValueError: two metrics describe one profile differently (its axis,
                label or bounds); a profile is one quantity, declared one way.
        """
        metrics: dict[str, MetricEntry] = {}
        profiles: dict[str, ProfileSpec] = {}
        owner: dict[str, str] = {}
        for spec in specs:
            metrics[spec.name] = MetricEntry(
                spec.name,
                **{key: getattr(spec, key) for key in _SPEC_FIELDS},
                lens=spec.lens if "lens" in spec.needs else "logit",
                method_options=frozenset(
                    option.name for option in spec.options if option.method_only
                ),
            )
            for record in spec.profile_specs:
                known = profiles.setdefault(record.name, record)
                owner.setdefault(record.name, spec.name)
                if known != record:
                    raise ValueError(
                        f"profile {record.name!r} is declared as {known!r} by metric "
                        f"{owner[record.name]!r} and as {record!r} by {spec.name!r}; "
                        "declare one ProfileSpec for it and share it"
                    )
        return cls(metrics, profiles, source)

    @classmethod
    def installed(cls) -> Catalogue:
        """The catalogue of every metric of the installed plugins (built-in and third-party)."""
        from lm_coupling.plugins.manager import get_registry

        return cls.from_specs(get_registry().metrics.values(), source=INSTALLED)

    def to_json(self) -> dict[str, Any]:
        """The JSON form recorded under ``config.lm_coupling.catalogue``."""
        metrics = {}
        for name, entry in self.metrics.items():
            record = {key: getattr(entry, key) for key in _METRIC_FIELDS}
            record["bounds"] = list(entry.bounds) if entry.bounds is not None else None
            record["profiles"] = list(entry.profiles)
            if entry.task_level:  # only when true: earlier files and the golden ones stay
                record["task_level"] = True
            if entry.sampled and entry.sample_option != DEFAULT_SAMPLE_OPTION:  # likewise
                record["sample_option"] = entry.sample_option
            if entry.lens != "logit":
                record["lens"] = entry.lens
            if entry.nan_expected:
                record["nan_expected"] = True
            metrics[name] = record
        profiles = {}
        for name, spec in self.profiles.items():
            record = {key: getattr(spec, key) for key in _PROFILE_FIELDS}
            record["bounds"] = list(spec.bounds) if spec.bounds is not None else None
            profiles[name] = record
        return {"metrics": metrics, "profiles": profiles}

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], source: str = "results", order: Iterable[str] = ()
    ) -> Catalogue:
        """Read a recorded catalogue (`to_json`'s form).

        JSON objects may come back with their keys sorted, so the order is
        rebuilt: the metrics in ``order`` (the run's ``metrics`` list, in
        registry order) first, and each profile where a metric first lists it.

        Raises:
            ValueError: the record is not a catalogue (wrong types, an unknown axis).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"the catalogue must be a JSON object, found {type(data).__name__}")
        metrics_in, profiles_in = data.get("metrics") or {}, data.get("profiles") or {}
        if not isinstance(metrics_in, Mapping) or not isinstance(profiles_in, Mapping):
            raise ValueError("the catalogue's 'metrics' and 'profiles' must be JSON objects")
        try:
            metrics = {
                str(name): MetricEntry(
                    str(name),
                    str(rec.get("label") or name),
                    str(rec.get("unit") or ""),
                    _bounds(rec.get("bounds")),
                    rec.get("higher_is_better"),
                    bool(rec.get("sampled", False)),
                    rec.get("k_option"),
                    str(rec.get("plugin") or ""),
                    tuple(str(p) for p in rec.get("profiles") or ()),
                    bool(rec.get("task_level", False)),
                    (rec.get("sample_option") or DEFAULT_SAMPLE_OPTION)
                    if rec.get("sampled")
                    else None,
                    lens=str(rec.get("lens") or "logit"),
                    nan_expected=bool(rec.get("nan_expected", False)),
                )
                for name, rec in metrics_in.items()
            }
            profiles = {
                str(name): ProfileSpec(
                    str(name),
                    rec.get("axis", "states"),
                    str(rec.get("label") or ""),
                    _bounds(rec.get("bounds")),
                    int(rec.get("min_blocks") or 0),
                    bool(rec.get("boundary", False)),
                    bool(rec.get("plot", True)),
                )
                for name, rec in profiles_in.items()
            }
        except (AttributeError, TypeError, IndexError, ValueError) as exc:
            raise ValueError(
                f"unreadable catalogue ({exc}); axes are {', '.join(PROFILE_AXES)}"
            ) from exc
        names = [n for n in dict.fromkeys(order) if n in metrics] + list(metrics)
        metrics = {n: metrics[n] for n in dict.fromkeys(names)}
        listed = [p for e in metrics.values() for p in e.profiles if p in profiles]
        profiles = {n: profiles[n] for n in dict.fromkeys([*listed, *profiles])}
        return cls(metrics, profiles, source)

    def merged(self, other: Catalogue) -> Catalogue:
        """This catalogue with ``other``'s metrics and profiles added (this one's win)."""
        source = self.source if self.source == other.source else f"{self.source}; {other.source}"
        return Catalogue(
            {**other.metrics, **self.metrics}, {**other.profiles, **self.profiles}, source
        )

    # -- reading -------------------------------------------------------------
    def profile(self, name: str) -> ProfileSpec:
        """The record of a profile; one not in the catalogue is a profile over states 0..L."""
        return self.profiles.get(name) or ProfileSpec(name)

    def first_layer(self, name: str) -> int:
        """The number of a profile's first value: 0 over states, 1 over blocks."""
        return self.profile(name).first_layer

    def label(self, name: str) -> str:
        """The label of a metric or profile (its name when it has none)."""
        if name in self.profiles:
            return self.profiles[name].label
        entry = self.metrics.get(name)
        return entry.label if entry is not None else name

    def bounds(self, name: str) -> tuple[float, float] | None:
        """The bounds of a metric, a K-named column of one (``coupling_k10``) or a profile."""
        if name in self.profiles:
            return self.profiles[name].bounds
        entry = self.metrics.get(self.base_metric(name))
        return entry.bounds if entry is not None else None

    def is_unit(self, name: str) -> bool:
        """Whether a metric, its K-named column or a profile is bounded to [0, 1]."""
        return self.bounds(name) == (0.0, 1.0)

    def k_option(self, metric: str) -> str | None:
        """The option a metric's column is named after (None: no K)."""
        entry = self.metrics.get(metric)
        return entry.k_option if entry is not None else None

    def base_metric(self, column: str) -> str:
        """The metric of a report column: ``coupling_k10`` -> ``coupling``; others unchanged."""
        if column in self.metrics:
            return column
        for name, entry in self.metrics.items():
            if entry.k_option and column.startswith(f"{name}_k"):
                return name
        return column

    def is_metric(self, column: str) -> bool:
        """Whether ``column`` is a metric of the catalogue or a K-named column of one."""
        return self.base_metric(column) in self.metrics

    def sampled_metrics(self) -> tuple[str, ...]:
        """The metrics computed on the coupling sample of documents only."""
        return tuple(n for n, e in self.metrics.items() if e.sampled)

    def primary_metric(self) -> str | None:
        """The metric a plugin declares the report's default primary one (None: none does)."""
        return next((name for name, e in self.metrics.items() if e.primary), None)

    def sample_options(self) -> frozenset[str]:
        """The options sizing the sampled metrics' samples (how many documents, not what)."""
        return frozenset(
            e.sample_option for e in self.metrics.values() if e.sampled and e.sample_option
        )

    def method_options(self) -> frozenset[str]:
        """The options that pick only how values are computed (`OptionSpec.method_only`)."""
        return frozenset().union(*(e.method_options for e in self.metrics.values()))

    def plotted_profiles(self) -> tuple[str, ...]:
        """The per-layer (not matrix) profiles the report draws, in catalogue order."""
        return tuple(n for n, p in self.profiles.items() if p.axis != "matrix" and p.plot)

    def boundary_profiles(self) -> tuple[str, ...]:
        """The profiles the thought/fixation boundary is read from, in catalogue order."""
        return tuple(n for n, p in self.profiles.items() if p.boundary)

    def matrices(self) -> tuple[str, ...]:
        """The profiles that are matrices."""
        return tuple(n for n, p in self.profiles.items() if p.axis == "matrix")


def recorded_catalogue(config: Mapping[str, Any] | None) -> Catalogue | None:
    """The catalogue in a results file's ``config`` (None when the run recorded none).

    Raises:
        ValueError: the recorded catalogue is unreadable.
    """
    lmc = (config or {}).get("lm_coupling") or {}
    data = lmc.get(CONFIG_KEY) if isinstance(lmc, Mapping) else None
    if data is None:
        return None
    order = lmc.get("metrics")
    return Catalogue.from_json(data, order=order if isinstance(order, list) else ())
