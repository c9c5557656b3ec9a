"""The Jacobian engine's settings: one frozen record, validated once.

``JacobianEngine(model, parts, config)`` takes a :class:`JacobianConfig`
(or its fields as keywords). The coupling plugin offers the ones a user may
want as ``jacobian_<field>`` options; the others serve tests, diagnostics and
the metrics that ask for factors (K, swapped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from lm_coupling.errors import ConfigurationError

__all__ = ["DENSE_MAX_D", "ILL_GAP", "METHODS", "JacobianConfig"]

DENSE_MAX_D = 1024
"""``method="auto"`` uses the exact ``gram`` route for every layer when d is at most this."""

ILL_GAP = 1e-3
"""Top K+1 singular values closer than ``ILL_GAP * s_1`` make a layer ill-defined."""

METHODS = ("auto", "dense", "gram", "krylov")
"""The routes (``jacobian.routes`` module docstring)."""


def _int(name: str, value, low: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(
            f"JacobianConfig.{name} must be an int, found {type(value).__name__} {value!r}"
        )
    if value < low:
        raise ConfigurationError(f"JacobianConfig.{name} must be >= {low}, found {value}")


@dataclass(frozen=True)
class JacobianConfig:
    """Every setting of the Jacobian engine (see ``jacobian.engine.JacobianEngine``).

    Attributes:
        k_max: K, the number of singular triplets kept (``S`` has K + 1 values
            for the gap ``s_K / s_{K+1}``); 1 <= K < d (checked by the engine).
        method: one of :data:`METHODS`.
        swapped: also compute the swapped matrices ``B[l, m] = V_m^T J^l U_m``.
        keep_dense: keep the dense Jacobians in ``JacobianFactors.dense``;
            forces the ``dense`` route for every layer.
        seed: seed of the random start blocks (results are reproducible).
        tol: vector accuracy target of the iterative routes (None: 1e-9 in
            float64, 1e-5 in float32).
        max_iters: iteration budget of the iterative routes (None: 100; under
            ``auto`` the steps that cost as much as the exact route, at least 3).
        ill_gap: see :data:`ILL_GAP`.
        check: verify the replayed block calls against the block outputs of
            the plain forward pass that also gives the frozen prefix (no extra pass).
        dense_max_d: ``auto`` takes the exact ``gram`` route for every layer
            when d <= this.
        chunk_size: tangents per vectorized JVP/VJP batch (None: from a
            memory budget, ``jacobian.linalg.chunk_size_for``).
        docs_per_batch: documents per batched pass (None: from free GPU memory; one on a CPU).
        keep_bytes: dense Jacobians pass one may keep for pass two (None: 1 GiB
            on CPU, a quarter of free memory on a GPU); beyond it pass two
            recomputes ``J^l V_m`` by JVPs.
        attn_implementation: force this attention implementation inside the
            engine (diagnostics; the run-time check then tells whether it
            changes the function).
        pair_reduction: the per-layer-pair reduction of pass two,
            ``reduce(left [B, M, d, K], products [B, M, d, K]) -> [B, M, ...]``
            with ``products[b, m] = J^l right_m`` (``lm_coupling.plugins.specs.PairReduction``;
            the coupling plugin hands ``U_m^T J^l V_m``). None: no pass two,
            ``JacobianFactors.A`` and ``B`` are None.
    """

    k_max: int
    method: str = "auto"
    swapped: bool = False
    keep_dense: bool = False
    seed: int = 0
    tol: float | None = None
    max_iters: int | None = None
    ill_gap: float = ILL_GAP
    check: bool = True
    dense_max_d: int = DENSE_MAX_D
    chunk_size: int | None = None
    docs_per_batch: int | None = None
    keep_bytes: int | None = None
    attn_implementation: str | None = None
    pair_reduction: Callable | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigurationError(
                f"JacobianConfig.method must be one of {METHODS}, found {self.method!r}"
            )
        _int("k_max", self.k_max, 1)
        _int("seed", self.seed, 0)
        _int("dense_max_d", self.dense_max_d, 0)
        _int("max_iters", self.max_iters, 1, optional=True)
        _int("chunk_size", self.chunk_size, 1, optional=True)
        _int("docs_per_batch", self.docs_per_batch, 1, optional=True)
        _int("keep_bytes", self.keep_bytes, 0, optional=True)
        if self.pair_reduction is not None and not callable(self.pair_reduction):
            raise ConfigurationError(
                f"JacobianConfig.pair_reduction must be callable, found {self.pair_reduction!r}"
            )
        for name in ("tol", "ill_gap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value >= 0):
                raise ConfigurationError(
                    f"JacobianConfig.{name} must be a number >= 0, found {value!r}"
                )

    @property
    def route(self) -> str:
        """The route asked for: ``dense`` whenever ``keep_dense``, else ``method``."""
        return "dense" if self.keep_dense else self.method

    @property
    def block(self) -> int:
        """Columns of the iterative routes' block, 2(K + 1): converges fast on flat spectra."""
        return 2 * (self.k_max + 1)

    def replace(self, **changes) -> JacobianConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)
