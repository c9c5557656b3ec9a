"""The plugin manager: built-in metrics plus entry-point plugins."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import lru_cache

import pluggy

from lm_coupling.errors import PluginError
from lm_coupling.plugins import calls, hookspecs
from lm_coupling.plugins.builtin import BUILTIN_PLUGINS
from lm_coupling.plugins.markers import PROJECT_NAME
from lm_coupling.plugins.short import ShortRoutePlugin, short_metrics
from lm_coupling.plugins.specs import MetricSpec, OptionSpec
from lm_coupling.states import ENGINE_NEEDS, NEEDS, STREAMED_NEEDS

ENTRY_POINT_GROUP = "lm_coupling"
DISABLE_AUTOLOAD_ENV = "LM_COUPLING_DISABLE_PLUGIN_AUTOLOAD"


class MetricRegistry:
    """The metrics and options declared by every registered plugin."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.metrics: dict[str, MetricSpec] = {}
        self.options: dict[str, OptionSpec] = {}
        option_owner: dict[str, str] = {}
        reducers = {calls.plugin_name(pm, i) for i in pm.hook.lmc_layer_reducer.get_hookimpls()}
        for plugin_name, declared in calls.answers(pm, "lmc_declare_metrics").items():
            lenses = {spec.lens for spec in declared or () if "lens" in getattr(spec, "needs", ())}
            if len(lenses) > 1:
                raise PluginError(
                    f"plugin {plugin_name!r} declares metrics reading the lenses "
                    f"{', '.join(sorted(lenses))}; a plugin's metrics read one lens"
                )
            for spec in declared or ():
                if not isinstance(spec, MetricSpec):
                    raise PluginError(
                        f"plugin {plugin_name!r} declared {spec!r}; expected MetricSpec records"
                    )
                if spec.name in self.metrics:
                    raise PluginError(
                        f"metric {spec.name!r} is declared by two plugins: "
                        f"{self.metrics[spec.name].plugin!r} and {plugin_name!r}; "
                        "uninstall or disable one of them"
                    )
                check_needs(spec, plugin_name, plugin_name in reducers)
                spec = replace(spec, plugin=plugin_name)
                self.metrics[spec.name] = spec
                for option in spec.options:
                    known = self.options.get(option.name)
                    if known is not None and known.default != option.default:
                        raise PluginError(
                            f"option {option.name!r} is declared with default {known.default!r} "
                            f"by {option_owner[option.name]!r} and {option.default!r} by "
                            f"{plugin_name!r}; options shared by metrics must agree"
                        )
                    self.options.setdefault(option.name, option)
                    option_owner.setdefault(option.name, plugin_name)

    def distributions(self) -> dict[str, str]:
        """Return ``{plugin name: "distribution version"}`` for the results file."""
        info = {}
        served = getattr(self.pm, "served", {})
        for plugin, dist in self.pm.list_plugin_distinfo():
            plugin = served.get(id(plugin), plugin)
            info[self.pm.get_name(plugin) or repr(plugin)] = f"{dist.project_name} {dist.version}"
        return info


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, checking each plugin as it registers (entry point or by hand).

    A plugin holding short-form metrics (`lm_coupling.plugins.short.metric`)
    is served by a `ShortRoutePlugin` registered under its name (with the
    plugin's other hooks, such as ``lmc_lens``).
    """

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.served: dict[int, object] = {}  # id(module) -> the object registered for it

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """Register ``plugin``; a misspelled hook is refused at once.

        Raises:
            PluginError: the plugin implements a hook that does not exist
                (``lmc_compute_bach``), or implements the hooks its short-form
                metrics are served by.
        """
        shorts = short_metrics(plugin) if hasattr(plugin, "__dict__") else []
        if shorts:
            hooks = [n for n in dir(plugin) if self.parse_hookimpl_opts(plugin, n) is not None]
            clash = sorted(set(hooks) & set(vars(ShortRoutePlugin)))
            if clash:
                raise PluginError(
                    f"plugin {name or plugin!r} holds @metric functions and implements "
                    f"{', '.join(clash)}; put the short-form metrics in a module of their own"
                )
            name = name or self.get_canonical_name(plugin)
            self.served[id(plugin)] = served = ShortRoutePlugin(shorts)
            for hook in hooks:  # its other hooks (a lens) are served beside the functions
                setattr(served, hook, getattr(plugin, hook))
            plugin = served
        registered = super().register(plugin, name)
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            self.unregister(plugin)
            raise PluginError(
                f"metric plugin {registered!r} implements an unknown hook: {exc}; the hooks "
                f"are {', '.join(sorted(n for n in dir(hookspecs) if n.startswith('lmc_')))}"
            ) from exc
        return registered


def check_needs(spec: MetricSpec, plugin_name: str, has_reducer: bool) -> None:
    """Check what a metric declares it reads (``MetricSpec.needs``) when its plugin registers.

    Raises:
        PluginError: an unknown need; a streamed need (``hidden_states``,
            ``lens``, ``attentions``) without an ``lmc_layer_reducer`` in the
            plugin, or on a sampled metric; an engine need (``jacobian``,
            ``tokenwise_jacobian``) on a metric that is not sampled.
    """
    where = f"metric {spec.name!r} of plugin {plugin_name!r}"
    needs = spec.needs if isinstance(spec.needs, (set, frozenset, tuple, list)) else None
    if needs is None:
        raise PluginError(f"{where} declares needs={spec.needs!r}; expected a frozenset of needs")
    unknown = sorted(set(needs) - set(NEEDS))
    if unknown:
        raise PluginError(
            f"{where} declares unknown needs {unknown}; a plugin can read {', '.join(NEEDS)} "
            "(lm_coupling.states.Need, docs/plugins.md)"
        )
    streamed = sorted(set(needs) & STREAMED_NEEDS)
    if streamed and not has_reducer:
        raise PluginError(
            f"{where} reads {', '.join(streamed)}, which capture streams layer by layer to the "
            "plugin's reducer: implement lmc_layer_reducer (docs/plugins.md)"
        )
    if streamed and spec.sampled:
        raise PluginError(
            f"{where} is sampled (measured by the Jacobian engine on a document sample) but "
            f"reads {', '.join(streamed)}, which only the benchmark's forward pass serves; "
            "declare it with sampled=False"
        )
    engine = sorted(set(needs) & ENGINE_NEEDS)
    if engine and not spec.sampled:
        raise PluginError(
            f"{where} reads {', '.join(engine)} from the Jacobian engine, which runs on a "
            "document sample only: declare it with sampled=True"
        )


def new_plugin_manager(load_entry_points: bool | None = None) -> PluginManager:
    """Build a plugin manager with the built-ins and (optionally) entry points.

    Args:
        load_entry_points: load third-party plugins from the ``lm_coupling``
            entry-point group; default: unless ``LM_COUPLING_DISABLE_PLUGIN_AUTOLOAD``
            is set to a non-empty value.

    Raises:
        PluginError: a plugin failed to import, or implements a misspelled hook.
    """
    pm = PluginManager()
    pm.add_hookspecs(hookspecs)
    for plugin in BUILTIN_PLUGINS:
        pm.register(plugin, name=f"builtin.{plugin.__name__.rsplit('.', 1)[-1]}")
    if load_entry_points is None:
        load_entry_points = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    if load_entry_points:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except PluginError:
            raise
        except Exception as exc:  # an import error inside a third-party plugin
            raise PluginError(
                f"the metric plugin {_failing_entry_point(pm)} failed to load: {exc!r}. "
                "Fix or uninstall the distribution that provides it, or set "
                f"{DISABLE_AUTOLOAD_ENV}=1 to skip third-party plugins"
            ) from exc
    return pm


def _failing_entry_point(pm: pluggy.PluginManager) -> str:
    """Name the first entry point of the group that is not registered and fails to load."""
    import importlib.metadata

    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP or pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
                continue
            try:
                ep.load()
            except Exception:
                name, version = dist.metadata["Name"], dist.version
                return f"{ep.name!r} = {ep.value!r} (entry point of {name} {version})"
    return f"from the entry-point group {ENTRY_POINT_GROUP!r}"


@lru_cache(maxsize=1)
def get_plugin_manager() -> PluginManager:
    """Return the process-wide plugin manager (built once)."""
    return new_plugin_manager()


def get_registry(pm: pluggy.PluginManager | None = None) -> MetricRegistry:
    """Return the metric registry of ``pm`` (default: the process-wide manager)."""
    return MetricRegistry(pm if pm is not None else get_plugin_manager())
