"""Frozen records by which plugins declare their metrics and options."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from lm_coupling.states import Need

if TYPE_CHECKING:  # annotations only: declaring metrics loads no torch
    import torch


@dataclass(frozen=True)
class OptionSpec:
    """One ``--metric_args`` option.

    Attributes:
        name: the key users write (``k=10``).
        default: the value used when the option is not given.
        help: one line for ``lm-coupling metrics``.
        parse: turns the command-line string into the value; raises
            ValueError with a readable message on bad input.
        choices: allowed parsed values, if the option is an enumeration.
        method_only: True when the option picks only how a value is computed (a
            numerical method, its tolerance, memory or seed), never what is
            measured: the report does not tell two runs' values apart by it.
    """

    name: str
    default: Any
    help: str
    parse: Callable[[str], Any] = str
    choices: tuple[Any, ...] | None = None
    method_only: bool = False


ProfileAxis = Literal["states", "blocks", "matrix"]
"""What a profile's values are indexed by (`ProfileSpec.axis`)."""

PROFILE_AXES: tuple[str, ...] = ("states", "blocks", "matrix")
LAYER_AXES = ("states", "blocks")
"""The dimensions of `ProfileSpec.axes` counted in layers: L + 1 states, L blocks."""
UNIT_INTERVAL = (0.0, 1.0)
"""The ``bounds`` of a quantity in [0, 1]: the report draws it on a fixed [0, 1] axis."""

DEFAULT_SAMPLE_OPTION = "coupling_docs"
"""The option sizing the sample of a sampled metric that names none (`MetricSpec.sample_option`)."""


def _check_bounds(owner: str, bounds: Any) -> tuple[float, float] | None:
    """``bounds`` as a ``(low, high)`` float pair with low < high, or None."""
    if bounds is None:
        return None
    try:
        low, high = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise ValueError(
            f"{owner}: bounds must be a (low, high) pair such as (0.0, 1.0) or None, "
            f"found {bounds!r}"
        ) from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{owner}: bounds need finite low < high, found {bounds!r}")
    return (low, high)


@dataclass(frozen=True)
class ProfileSpec:
    """A per-document profile a metric stores in the geometry file.

    Attributes:
        name: the key under the geometry file's ``profiles`` (or ``matrices``).
        axis: what its values are indexed by: ``"states"`` l = 0..L (0 = the
            embeddings), ``"blocks"`` l = 1..L, or ``"matrix"`` (kept under
            ``matrices``); the report numbers the layers by it.
        label: the title of its panel in the report (default: the name).
        bounds: ``(low, high)`` when bounded (the report draws it on that
            fixed axis), else None.
        min_blocks: drawn only for models with at least this many blocks.
        boundary: the report reads the thought/fixation boundary from it.
        plot: drawn in the report's profile figures (False: kept in the files only).
        axes: the shape of one document's answer, one entry per dimension:
            ``"states"`` (L + 1), ``"blocks"`` (L), an int (that length) or
            None (any length). Default: ``(axis,)`` for a per-layer vector,
            ``("blocks", "blocks")`` (L x L) for a matrix; e.g.
            ``("blocks", None)`` for ``[L, K+1]`` singular values. Every
            answer is checked against it (not recorded in the catalogue).
    """

    name: str
    axis: ProfileAxis = "states"
    label: str = ""
    bounds: tuple[float, float] | None = None
    min_blocks: int = 0
    boundary: bool = False
    plot: bool = True
    axes: tuple[str | int | None, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        """Check the axis, axes and bounds; default the label and the axes."""
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a profile needs a non-empty name, found {self.name!r}")
        if self.axis not in PROFILE_AXES:
            raise ValueError(
                f"profile {self.name!r}: axis must be one of {', '.join(PROFILE_AXES)}, "
                f"found {self.axis!r}"
            )
        object.__setattr__(self, "label", self.label or self.name)
        object.__setattr__(self, "bounds", _check_bounds(f"profile {self.name!r}", self.bounds))
        if isinstance(self.min_blocks, bool) or not isinstance(self.min_blocks, int):
            raise ValueError(f"profile {self.name!r}: min_blocks must be an int")
        vector = self.axis in LAYER_AXES
        axes = tuple(self.axes) or ((self.axis,) if vector else ("blocks", "blocks"))
        known = all(a is None or a in LAYER_AXES or (type(a) is int and a > 0) for a in axes)
        if not known or (vector and axes[0] != self.axis) or (not vector and len(axes) < 2):
            raise ValueError(
                f"profile {self.name!r}: axes must be 'states', 'blocks', a positive int or "
                f"None per dimension, starting with its axis {self.axis!r} (a matrix: at least "
                f"two), found {self.axes!r}"
            )
        object.__setattr__(self, "axes", axes)

    @property
    def first_layer(self) -> int:
        """The number of its first value: 0 over states, 1 over blocks (and matrix rows)."""
        return 0 if self.axis == "states" else 1

    def shape(self, n_layers: int) -> tuple[int | None, ...]:
        """One document's shape on a model of L = ``n_layers`` blocks (None: any length)."""
        lengths = {"states": n_layers + 1, "blocks": n_layers}
        return tuple(lengths.get(a, a) if isinstance(a, str) else a for a in self.axes)


@dataclass(frozen=True)
class MetricSpec:
    """A metric a plugin provides: one entry of the catalogue (docs/plugins.md, its fields).

    Attributes:
        name: snake_case public identifier: lm-eval metric key, CSV column and
            command-line word. Never renamed once released.
        description: one line for ``lm-coupling metrics`` and the README.
        needs: what it reads (``lm_coupling.states.Need``), checked on registration.
        options: the options it reads.
        profiles: its per-document profiles: `ProfileSpec` records or names
            (a name not in ``profile_specs`` is a profile over states, a
            matrix when in ``matrices``; one named like the metric takes its
            label and bounds). After construction: the names.
        matrices: the profiles that are matrices (kept under ``matrices``).
        k_option: the option holding its K; the report names its column
            after the K used (``coupling_k10``).
        sample_option: a sampled metric's option sizing its sample
            (default `DEFAULT_SAMPLE_OPTION`).
        sampled: computed on a sample of documents by the Jacobian engine.
        higher_is_better: for lm-eval's table; None when neither is better.
        opt_in: excluded from ``--metrics all``.
        label: a short human name for figures and tables (default: the name).
        unit: the unit of its values (``"nats"``), "" when unitless.
        bounds: ``(low, high)`` when bounded (``UNIT_INTERVAL``), else None.
        profile_specs: one `ProfileSpec` per profile (after construction).
        task_level: one value per task from ``lmc_aggregate_task``, no
            per-document value.
        deferred: computed by ``lmc_complete_task`` once the task is measured.
        reads_target: reads the gold token at n; NaN without one, with that reason.
        primary: the report's default primary metric.
        lens: the name of the lens its ``lens`` need reads (``"logit"``).
        nan_expected: NaN is one of its answers, not undefined geometry.
        requires: metrics brought into the selection with it: names, or a
            function of the parsed options returning names.
    """

    name: str
    description: str
    needs: frozenset[Need]
    options: tuple[OptionSpec, ...] = ()
    profiles: tuple[str | ProfileSpec, ...] = ()
    matrices: tuple[str, ...] = ()
    k_option: str | None = None
    sample_option: str | None = None
    sampled: bool = False
    higher_is_better: bool | None = None
    opt_in: bool = False
    label: str = ""
    unit: str = ""
    bounds: tuple[float, float] | None = None
    profile_specs: tuple[ProfileSpec, ...] = ()
    task_level: bool = False
    deferred: bool = False
    reads_target: bool = False
    primary: bool = False
    lens: str = "logit"
    nan_expected: bool = False
    requires: tuple[str, ...] | Callable[[Mapping[str, Any]], Iterable[str]] = field(
        default=(), compare=False
    )
    plugin: str = field(default="", compare=False)

    def required(self, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The metrics this one brings into the selection, given the parsed options."""
        names = self.requires(options) if callable(self.requires) else self.requires
        return tuple(names or ())

    def __post_init__(self) -> None:
        """Normalise the profiles to names plus one `ProfileSpec` each (see the attributes)."""
        set_ = object.__setattr__
        set_(self, "label", self.label or self.name)
        if self.sampled and self.sample_option is None:
            set_(self, "sample_option", DEFAULT_SAMPLE_OPTION)
        set_(self, "bounds", _check_bounds(f"metric {self.name!r}", self.bounds))
        given: dict[str, ProfileSpec] = {}
        names: dict[str, None] = {}  # in order, once each
        for item in (*self.profiles, *self.profile_specs):
            record = item if isinstance(item, ProfileSpec) else None
            name = item.name if record is not None else item
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"metric {self.name!r}: profiles must be ProfileSpec records or names, "
                    f"found {item!r}"
                )
            if record is not None:
                if given.setdefault(name, record) != record:
                    raise ValueError(
                        f"metric {self.name!r} describes profile {name!r} twice, differently: "
                        f"{given[name]!r} and {record!r}"
                    )
            names[name] = None
        matrices = list(self.matrices)
        records = []
        for name in names:
            own = name == self.name  # one given by name only: see ``profiles``
            record = given.get(name) or ProfileSpec(
                name,
                "matrix" if name in self.matrices else "states",
                label=self.label if own else "",
                bounds=self.bounds if own else None,
            )
            if record.axis == "matrix" and name not in matrices:
                matrices.append(name)
            if name in matrices and record.axis != "matrix":
                raise ValueError(
                    f"metric {self.name!r}: profile {name!r} is in matrices but its "
                    f"ProfileSpec has axis {record.axis!r}; give it axis='matrix'"
                )
            records.append(record)
        set_(self, "profiles", tuple(names))
        set_(self, "matrices", tuple(matrices))
        set_(self, "profile_specs", tuple(records))

    def profile(self, name: str) -> ProfileSpec:
        """The `ProfileSpec` of one of its profiles.

        Raises:
            KeyError: ``name`` is not one of its profiles.
        """
        for record in self.profile_specs:
            if record.name == name:
                return record
        raise KeyError(f"metric {self.name!r} stores no profile {name!r}")


PairReduction = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
"""``reduce(left [B, M, d, K], products [B, M, d, K]) -> [B, M, ...]``, per layer l.

``products[b, m] = J^l right_m`` for M of the blocks m (the engine sends the
blocks in groups), ``left`` and ``right`` the top-K singular vectors of
``J^m`` (``U``, ``V``; exchanged for the swapped pass). The engine stacks
what it returns over l into ``JacobianFactors.A`` (``[L, L, ...]``) and,
with ``swapped``, ``B``.
"""


@dataclass(frozen=True)
class JacobianRequest:
    """What a metric asks of the block-Jacobian engine (hook ``lmc_jacobian_request``).

    The engine serves the union of the requests: the largest K, ``swapped``
    and ``dense`` if any request asks, the one route that is not ``auto``
    (two different routes are an error), and the one pair reduction (two
    different ones are an error).

    Attributes:
        k: singular vectors per block the metric reads (already resolved
            with `used_k` on the model's width).
        swapped: also reduce the swapped products (``JacobianFactors.B``).
        method: the engine route (``auto``, ``dense``, ``gram``, ``krylov``).
        dense: also hand over the dense block Jacobians ``JacobianFactors.dense
            [L, d, d]`` (the exact ``dense`` route then runs on every layer).
        pair_reduction: the per-layer-pair reduction of the engine's products
            (`PairReduction`), computed as the products are formed so that the
            ``[L, L, d, K]`` products are never held; None: no pair products
            (``A`` and ``B`` stay None). The coupling plugin hands its
            ``U_m^T J^l V_m``.
        settings: engine settings the metric's options set (fields of
            ``lm_coupling.jacobian.config.JacobianConfig``, e.g. ``tol``, ``seed``).
        lens_terms: for the ``lens_jacobian`` need, the estimator's keywords
            (``lm_coupling.jacobian_lens_terms.lens_terms``); None: not asked.
    """

    k: int
    swapped: bool = False
    method: str = "auto"
    dense: bool = False
    pair_reduction: PairReduction | None = field(default=None, compare=False)
    settings: Mapping[str, Any] = field(default_factory=dict, compare=False)
    lens_terms: Mapping[str, Any] | None = field(default=None, compare=False)


def used_k(k: int | float, d_model: int) -> int:
    """The K a top-K metric uses on a model of width ``d_model``: the one resolver of K.

    An integer K is capped at ``d_model - 1`` (one less than the width leaves
    ``s_{K+1}`` for the spectral gap); a float in (0, 1) is a fraction of the
    width, ``floor(k * d_model)``, at least 1 and at most ``d_model - 1``.

    Raises:
        TypeError: ``k`` is not an int or a float (a bool is neither).
        ValueError: ``d_model`` is not a positive integer, an int ``k`` is
            below 1, or a float ``k`` is outside (0, 1).
    """
    if isinstance(k, bool) or not isinstance(k, (int, float)):
        raise TypeError(f"k must be an int or a float in (0, 1), found {type(k).__name__} {k!r}")
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
        raise ValueError(f"d_model must be a positive int, found {d_model!r}")
    cap = max(d_model - 1, 1)
    if isinstance(k, float):
        if not 0 < k < 1:
            raise ValueError(
                f"a float k is a fraction of d_model and must lie in (0, 1), found {k}; "
                "pass an int for an absolute number of singular vectors"
            )
        return max(1, min(math.floor(k * d_model + 1e-9), cap))
    if k < 1:
        raise ValueError(f"k must be at least 1, found {k}")
    return min(k, cap)
