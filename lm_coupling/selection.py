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
from lm_coupling.plugins.specs import MetricSpec
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
        names: list[str] = []
        for spec in self.specs.values():
            names.extend(p for p in spec.profiles if p not in names)
        return tuple(names)


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


def parse_metric_args(text: str | dict | None, specs: dict[str, MetricSpec]) -> dict[str, Any]:
    """Parse ``k=v,...`` (or a dict) against the options of the selected metrics.

    Raises:
        ConfigurationError: malformed pair, unknown option, or a bad value.
    """
    by_name = {opt.name: opt for spec in specs.values() for opt in spec.options}
    options = {name: opt.default for name, opt in by_name.items()}
    if text is None or text == "":
        return options
    pairs = text.items() if isinstance(text, dict) else _split_pairs(text)
    pairs, recorded = expand_preset(pairs, by_name)  # preset=NAME (lm_coupling.presets)
    options.update(recorded)
    for key, raw in pairs:
        if key not in by_name:
            valid = ", ".join(sorted(by_name)) or "none (the selected metrics take no options)"
            raise ConfigurationError(
                f"unknown --metric_args option {key!r}.{_did_you_mean(key, list(by_name))} "
                f"Options of the selected metrics: {valid}"
            )
        option = by_name[key]
        try:
            value = option.parse(str(raw))
        except ValueError as exc:
            raise ConfigurationError(f"--metric_args {key}={raw}: {exc}") from None
        if option.choices is not None and value not in option.choices:
            raise ConfigurationError(
                f"--metric_args {key}={raw}: expected one of {', '.join(map(str, option.choices))}"
            )
        options[key] = value
    return options


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
    names = parse_metric_names(metrics, registry)
    specs = {name: registry.metrics[name] for name in names}
    return Selection(names, parse_metric_args(metric_args, specs), specs)
