"""lm-coupling: hidden-state geometry measured inside lm-evaluation-harness runs.

The package measures, from the benchmark's own forward passes, transformer-block
coupling, line-shape score, expodistance, equidistance and logit-lens metrics,
and reports them next to accuracy (see README.md).

Importing the package loads nothing heavy: ``evaluate`` (the Python entry
point), ``hookimpl`` and ``hookspec`` (the plugin markers) are looked up on
first use, so that ``lm_coupling.report`` and the interpreter start-up hook
never import torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "evaluate", "hookimpl", "hookspec"]


def __getattr__(name: str) -> Any:
    """``lm_coupling.evaluate``, ``hookimpl`` and ``hookspec``, imported on first use."""
    if name == "evaluate":
        from lm_coupling.harness.evaluate import evaluate

        return evaluate
    if name in ("hookimpl", "hookspec"):
        from lm_coupling.plugins import markers

        return getattr(markers, name)
    raise AttributeError(f"module 'lm_coupling' has no attribute {name!r}")
