"""Built-in metric plugins, registered exactly like third-party ones."""

from lm_coupling.plugins.builtin import coupling, lens, tokenwise, trajectory

BUILTIN_PLUGINS = (trajectory, lens, coupling, tokenwise)

__all__ = ["BUILTIN_PLUGINS"]
