"""The short form: a metric of the states at the measured token is one plain function.

``@metric(...)`` declares it; the function receives, whole for the batch, the
tensors its arguments name (``states [B, L+1, d]``, ``logits [B, L+1, V]``,
``attentions [B, L, H, T]``, ``targets [B]``; docs/plugins.md) and returns its
values ``[B]``, or ``(values, profile)``. A module holding such functions is a
plugin; the manager serves it through the hooks (`ShortRoutePlugin`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.specs import MetricSpec, ProfileSpec

__all__ = ["ShortMetric", "ShortRoutePlugin", "metric", "short_metrics"]

ARGUMENTS = {"states": "hidden_states", "logits": "lens", "attentions": "attentions", "targets": ""}
"""The arguments a short-form function may take, and the need each one declares."""


@dataclass(frozen=True)
class ShortMetric:
    """A function declared with `metric`: its catalogue entry and the tensors it reads."""

    spec: MetricSpec
    function: Callable[..., Any]
    reads: tuple[str, ...]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function itself (it stays usable as a plain function)."""
        return self.function(*args, **kwargs)


def metric(
    description: str,
    *,
    name: str | None = None,
    profile: str | tuple[str | int | None, ...] | None = None,
    lens: str = "logit",
    **fields: Any,
) -> Callable[[Callable[..., Any]], ShortMetric]:
    """Declare a metric of the states at the measured token n as one function.

    Args:
        description: one line for ``lm-coupling metrics``.
        name: the metric's public name (default: the function's name).
        profile: ``"states"`` (the function returns a ``[B, L+1]`` profile
            beside its values), ``"blocks"`` (``[B, L]``, blocks 1..L), the
            axes of a matrix (``("blocks", "blocks")``: ``[B, L, L]``; see
            `ProfileSpec.axes`), or None.
        lens: the lens whose logits ``logits`` holds (``"logit"``, or the name
            of a plugin's lens).
        **fields: any other `MetricSpec` field (``label``, ``unit``, ``bounds``,
            ``higher_is_better``, ``opt_in``, ``nan_expected``, ...).

    Raises:
        ValueError: the function takes an argument the route does not serve,
            or none it serves.
    """

    def declare(function: Callable[..., Any]) -> ShortMetric:
        reads = tuple(inspect.signature(function).parameters)
        where = f"metric function {function.__qualname__!r}"
        unknown = [arg for arg in reads if arg not in ARGUMENTS]
        if unknown or not set(reads) - {"targets"}:
            raise ValueError(
                f"{where} takes {', '.join(reads) or 'no argument'}; a metric of the states at "
                f"n takes some of {', '.join(ARGUMENTS)} (docs/plugins.md)"
            )
        own = name or function.__name__
        label, bounds = fields.get("label", ""), fields.get("bounds")
        if isinstance(profile, tuple):
            profiles = (ProfileSpec(own, "matrix", label, bounds, axes=profile),)
        else:
            profiles = (ProfileSpec(own, profile, label, bounds),) if profile else ()
        needs = frozenset(ARGUMENTS[arg] for arg in reads) - {""}
        spec = MetricSpec(own, description, needs, profiles=profiles, lens=lens, **fields)
        return ShortMetric(spec, function, reads)

    return declare


def short_metrics(plugin: object) -> list[ShortMetric]:
    """The short-form metrics a plugin (a module or object) holds, in name order."""
    return [value for _, value in sorted(vars(plugin).items()) if isinstance(value, ShortMetric)]


class AtN:
    """Keeps, per batch, the states, attention rows and lens logits at n the functions read."""

    def __init__(self, reads: set[str], batch: Any):
        self.reads, self.batch = reads, batch
        self.kept: dict[str, Any] = {"states": [], "attentions": []}

    def update(self, view: Any) -> None:
        """Keep ``x^l_n`` and, from block 1 on, the attention row of query n."""
        if "states" in self.reads:
            self.kept["states"].append(view.at_n)
        if "attentions" in self.reads and view.layer > 0:
            if view.attentions is None:
                raise ValueError(f"block {view.layer} gave no attention probabilities")
            rows = self.batch.last_index.to(view.attentions.device)
            self.kept["attentions"].append(view.attentions[range(len(rows)), :, rows])

    def update_lens(self, logits: Any) -> None:
        """The lens logits of every state ``[B, L+1, V]``."""
        self.kept["logits"] = logits

    def finalize(self) -> dict[str, Any]:
        """``{argument: tensor}``, the tensors stacked over layers (dim 1)."""
        import torch

        out = {
            key: torch.stack(self.kept[key], dim=1) for key in {"states", "attentions"} & self.reads
        }
        if "logits" in self.reads:
            out["logits"] = self.kept.get("logits")
        out["targets"] = self.batch.target_tokens
        return out


class ShortRoutePlugin:
    """The hooks that serve a module's short-form metrics (registered in its place)."""

    def __init__(self, metrics: list[ShortMetric]):
        self.metrics = {one.spec.name: one for one in metrics}

    @hookimpl
    def lmc_declare_metrics(self) -> list[MetricSpec]:
        """The functions' specs."""
        return [one.spec for one in self.metrics.values()]

    @hookimpl
    def lmc_layer_reducer(self, selected, batch) -> AtN | None:
        """Keep what the selected functions read."""
        own = [self.metrics[name] for name in selected if name in self.metrics]
        reads = {arg for one in own for arg in one.reads}
        return AtN(reads, batch) if reads else None

    @hookimpl
    def lmc_compute_batch(self, selected, reduced) -> dict[str, dict[str, Any]] | None:
        """Call each selected function; its answer (or error) is checked by the caller."""
        if not reduced:
            return None
        values, profiles = {}, {}
        for name in selected:
            one = self.metrics[name]
            try:
                answer = one.function(**{arg: reduced[arg] for arg in one.reads})
            except Exception as exc:  # one function's failure is its own metric's
                answer = exc
            if isinstance(answer, tuple):
                values[name], profiles[name] = answer
            else:
                values[name] = answer
        return {"values": values, "profiles": profiles}
