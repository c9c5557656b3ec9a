"""lm-coupling: hidden-state geometry measured inside lm-evaluation-harness runs.

The package measures, from the benchmark's own forward passes, transformer-block
coupling, line-shape score, expodistance, equidistance and logit-lens metrics,
and reports them next to accuracy (see README.md).
"""

from lm_coupling.plugins.markers import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = ["__version__", "evaluate", "hookimpl", "hookspec"]


def __getattr__(name: str):
    """``lm_coupling.evaluate``, imported on first use (``import lm_coupling`` stays light)."""
    if name == "evaluate":
        from lm_coupling.harness.evaluate import evaluate

        return evaluate
    raise AttributeError(f"module 'lm_coupling' has no attribute {name!r}")
