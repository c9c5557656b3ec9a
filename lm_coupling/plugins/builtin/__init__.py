"""Built-in metric plugins, registered exactly like third-party ones."""

from lm_coupling.plugins.builtin import (
    coupling,
    coupling_authors,
    jacobian_lens,
    layer_by_layer,
    lens,
    tokenwise,
    trajectory,
)

BUILTIN_PLUGINS = (
    trajectory,
    lens,
    coupling,
    coupling_authors,
    tokenwise,
    layer_by_layer,
    jacobian_lens,
)

__all__ = ["BUILTIN_PLUGINS"]
