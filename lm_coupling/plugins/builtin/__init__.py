"""Built-in metric plugins, registered exactly like third-party ones."""

from lm_coupling.plugins.builtin import coupling, lens, trajectory

BUILTIN_PLUGINS = (trajectory, lens, coupling)

__all__ = ["BUILTIN_PLUGINS"]
