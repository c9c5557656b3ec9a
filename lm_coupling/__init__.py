"""lm-coupling: hidden-state geometry measured inside lm-evaluation-harness runs.

The package measures, from the benchmark's own forward passes, transformer-block
coupling, line-shape score, expodistance, equidistance and logit-lens metrics,
and reports them next to accuracy (see README.md).
"""

from lm_coupling.plugins.markers import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl", "hookspec"]
