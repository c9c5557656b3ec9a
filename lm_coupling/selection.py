"""Turn ``--metrics`` and ``--metric_args`` into a validated selection.

Everything here runs before any model or data loads, so that a typo stops the
run at once with a message that lists what is available.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from lm_coupling.errors import ConfigurationError
from lm_coupling.plugins.manager import MetricRegistry, get_registry
from lm_coupling.plugins.options import parse_at_least
from lm_coupling.plugins.specs import MetricSpec, OptionSpec
from lm_coupling.presets import expand_preset
from lm_coupling.states import Need


@dataclass(frozen=True)
class Selection:
    """The metrics a run computes and their parsed options.

    Attributes:
        metrics: selected metric names, in registry order.
        options: every option of the selected metrics, defaults filled in.
        specs: the selected metrics' specifications, by name.
    """

    metrics: tuple[str, ...]
    options: dict[str, Any]
    specs: dict[str, MetricSpec] = field(repr=False)

    @property
    def needs(self) -> frozenset[Need]:
        """Union of what the selected metrics need captured."""
        return frozenset().union(*(spec.needs for spec in self.specs.values()))

    @property
    def profiles(self) -> tuple[str, ...]:
        """Names of the per-document profiles the selected metrics store."""
        return tuple(dict.fromkeys(p for spec in self.specs.values() for p in spec.profiles))


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def parse_metric_names(text: str, registry: MetricRegistry) -> tuple[str, ...]:
    """Parse a comma list of metric names, or ``all``.

    ``all`` selects every registered metric except opt-in ones.

    Raises:
        ConfigurationError: empty list or an unknown name (with suggestions).
    """
    available = list(registry.metrics)
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words:
        raise ConfigurationError(
            f"--metrics needs metric names or 'all'; available: {', '.join(available)}"
        )
    if words == ["all"]:
        return tuple(n for n, spec in registry.metrics.items() if not spec.opt_in)
    unknown = [w for w in words if w not in registry.metrics]
    if unknown:
        raise ConfigurationError(
            f"unknown metric {unknown[0]!r}.{_did_you_mean(unknown[0], available)} "
            f"Available metrics: {', '.join(available)} (or 'all'); "
            "`lm-coupling metrics` describes them"
        )
    return tuple(n for n in available if n in words)


def parse_metric_args(
    text: str | dict | None,
    specs: dict[str, MetricSpec],
    registry: MetricRegistry | None = None,
) -> dict[str, Any]:
    """Parse ``k=v,...`` (or a dict) against the options of the selected metrics.

    Every bad pair is reported, not only the first, and so is a sample of 0
    documents for a selected sampled metric (``coupling_docs=0`` with coupling).

    Args:
        text: the ``--metric_args`` value.
        specs: the selected metrics.
        registry: all registered metrics, to name the metric an option of an
            unselected metric belongs to (defaults to the process-wide one).

    Raises:
        ConfigurationError: malformed pair, unknown option, bad value or
            empty sample (one line per problem).
    """
    by_name = {opt.name: opt for spec in specs.values() for opt in spec.options}
    if any(spec.sampled for spec in specs.values()):
        by_name.setdefault(SAMPLE_SEED.name, SAMPLE_SEED)
    options = {name: opt.default for name, opt in by_name.items()}
    if text is None or text == "":
        return options
    pairs = text.items() if isinstance(text, dict) else _split_pairs(text)
    pairs, recorded = expand_preset(pairs, by_name)  # preset=NAME (lm_coupling.presets)
    options.update(recorded)
    problems = []
    for key, raw in pairs:
        if key not in by_name:
            problems.append(_unknown_option(key, by_name, specs, registry))
            continue
        try:
            options[key] = _parse_value(by_name[key], key, raw)
        except ConfigurationError as exc:
            problems.append(str(exc))
    problems += sample_problems(options, specs)
    if len(problems) > 1:
        listed = "".join(f"\n  - {p}" for p in problems)
        raise ConfigurationError(f"{len(problems)} problems with --metric_args:{listed}")
    if problems:
        raise ConfigurationError(problems[0])
    return options


SAMPLE_SEED = OptionSpec(
    "sample_seed",
    0,
    "seed of the sampled metrics' document sample (seeded random, stratified by the gold "
    "answer; docs/metrics.md)",
    parse_at_least(0),
)
"""The run-level option of every sampled metric (`lm_coupling.harness.sample`)."""


def _parse_value(option: OptionSpec, key: str, raw: Any) -> Any:
    try:
        value = option.parse(str(raw))
    except ValueError as exc:
        raise ConfigurationError(f"--metric_args {key}={raw}: {exc}") from None
    if option.choices is not None and value not in option.choices:
        raise ConfigurationError(
            f"--metric_args {key}={raw}: expected one of {', '.join(map(str, option.choices))}"
        )
    return value


def _unknown_option(
    key: str,
    by_name: dict[str, OptionSpec],
    specs: dict[str, MetricSpec],
    registry: MetricRegistry | None,
) -> str:
    """The message for an option no selected metric takes."""
    valid = ", ".join(sorted(by_name)) or "none (the selected metrics take no options)"
    registry = registry if registry is not None else get_registry()
    owners = [
        name
        for name, spec in registry.metrics.items()
        if name not in specs and any(opt.name == key for opt in spec.options)
    ]
    if owners:
        names = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} and {owners[-1]}"
        verb = "is" if len(owners) == 1 else "are"
        return (
            f"--metric_args option {key!r} belongs to {names}, which {verb} not selected: "
            f"add one to --metrics. Options of the selected metrics: {valid}"
        )
    return (
        f"unknown --metric_args option {key!r}.{_did_you_mean(key, list(by_name))} "
        f"Options of the selected metrics: {valid}"
    )


def sample_problems(options: dict[str, Any], specs: dict[str, MetricSpec]) -> list[str]:
    """A sample of 0 documents for a selected sampled metric (``coupling_docs=0``)."""
    problems = []
    for name, spec in specs.items():
        option = spec.sample_option
        if spec.sampled and options.get(option, None) == 0:
            problems.append(
                f"--metric_args {option}=0 leaves {name} with no documents: give a number "
                f">= 1 (or 'all'), or drop {name} from --metrics"
            )
    return sorted(set(problems))


def _split_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ConfigurationError(f"--metric_args expects key=value pairs, found {item!r}")
        key, value = item.split("=", 1)
        pairs.append((key.strip(), value.strip()))
    return pairs


def make_selection(
    metrics: str, metric_args: str | dict | None = None, registry: MetricRegistry | None = None
) -> Selection:
    """Validate ``--metrics`` and ``--metric_args`` and return the selection."""
    registry = registry if registry is not None else get_registry()
    if metric_args and not str(metrics or "").strip():
        raise ConfigurationError(
            "--metric_args was given but --metrics is missing: add --metrics with the "
            "metrics the options are for (e.g. --metrics all)"
        )
    names = parse_metric_names(metrics or "", registry)
    specs = {name: registry.metrics[name] for name in names}
    options = parse_metric_args(metric_args, specs, registry)
    # A metric may bring others in (MetricSpec.requires: the J-lens read needs its fit).
    wanted = set(names) | {r for spec in specs.values() for r in spec.required(options)}
    if wanted - set(names):
        unknown = sorted(wanted - set(registry.metrics))
        if unknown:
            raise ConfigurationError(f"a selected metric requires unknown metrics {unknown}")
        names = tuple(n for n in registry.metrics if n in wanted)
        specs = {name: registry.metrics[name] for name in names}
        options = parse_metric_args(metric_args, specs, registry)
    return Selection(names, options, specs)
