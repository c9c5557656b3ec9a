"""Metric plugins: hook specifications, the plugin manager and the built-ins."""

from lm_coupling.plugins.manager import get_plugin_manager
from lm_coupling.plugins.specs import JacobianRequest, MetricSpec, OptionSpec, used_k

__all__ = ["JacobianRequest", "MetricSpec", "OptionSpec", "get_plugin_manager", "used_k"]
