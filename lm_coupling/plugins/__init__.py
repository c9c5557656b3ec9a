"""Metric plugins: hook specifications, the plugin manager and the built-ins."""

from lm_coupling.plugins.manager import get_plugin_manager
from lm_coupling.plugins.specs import MetricSpec, OptionSpec

__all__ = ["MetricSpec", "OptionSpec", "get_plugin_manager"]
