"""lm-coupling: hidden-state geometry measured inside lm-evaluation-harness runs.

The package measures, from the benchmark's own forward passes, transformer-block
coupling, line-shape score, expodistance, equidistance and logit-lens metrics,
and reports them next to accuracy (see README.md and docs/design.md).

Importing the package loads nothing heavy (no torch, lm-eval or statsmodels):
`evaluate` (the Python entry point), ``metric`` (the short form of a metric
plugin), ``hookimpl`` and ``hookspec`` (the plugin markers) and
``JacobianMismatchError`` are looked up on first use. The errors
are plain classes, importable at once: every error lm-coupling raises on
purpose is an `LmCouplingError`.
"""

from __future__ import annotations

from typing import Any

from lm_coupling.errors import (
    ConcurrentRunError,
    ConfigurationError,
    DataUnavailableError,
    GeometryWarning,
    LmCouplingError,
    ModelNotFoundError,
    PluginError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

__all__ = [
    "ConcurrentRunError",
    "ConfigurationError",
    "DataUnavailableError",
    "GeometryWarning",
    "JacobianMismatchError",
    "LmCouplingError",
    "ModelNotFoundError",
    "PluginError",
    "UnsupportedModelError",
    "__version__",
    "evaluate",
    "hookimpl",
    "hookspec",
    "metric",
]


def __getattr__(name: str) -> Any:
    """The names looked up on first use (see the module docstring)."""
    if name == "evaluate":
        from lm_coupling.harness.evaluate import evaluate

        return evaluate
    if name == "metric":
        from lm_coupling.plugins.short import metric

        return metric
    if name in ("hookimpl", "hookspec"):
        from lm_coupling.plugins import markers

        return getattr(markers, name)
    if name == "JacobianMismatchError":
        from lm_coupling.jacobian.engine import JacobianMismatchError

        return JacobianMismatchError
    raise AttributeError(f"module 'lm_coupling' has no attribute {name!r}")
