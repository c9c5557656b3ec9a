"""Each plugin's hooks, called on their own (with the arguments it takes, as pluggy does).

An exception, or an answer that does not match its declaration, makes only
that plugin's metrics NaN on the documents it fails on (a failing batch is
retried row by row where its reduction cuts into rows), recorded in
``DocumentGeometry.failures`` and reported by one `GeometryWarning` per
plugin and cause. Every other value stands.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

from lm_coupling.errors import GeometryWarning
from lm_coupling.states import STREAMED_NEEDS

if TYPE_CHECKING:
    from lm_coupling.plugins.specs import MetricSpec
    from lm_coupling.states import BatchInfo, DocumentGeometry, DocumentRef, GeometryStates


class _Specs(Protocol):
    """What the calls read of a run's selection (`lm_coupling.selection.Selection`)."""

    specs: Mapping[str, MetricSpec]


_SHOWN_DOCUMENTS = 5
"""Documents a warning names before it says how many more."""


class PluginCalls:
    """Call the selected metrics' plugins one by one and check their answers.

    Args:
        pm: the plugin manager.
        selection: the run's metrics (each spec names its plugin).
    """

    def __init__(self, pm: pluggy.PluginManager, selection: _Specs):
        self.pm, self.selection = pm, selection
        self._warned: set[tuple[str, str]] = set()
        self.deferred = False
        """Record failures without warning: the harness warns once per task (`warn_failures`)."""
        declaring = {plugin_name(pm, i) for i in pm.hook.lmc_declare_metrics.get_hookimpls()}
        self.observers = tuple(
            name
            for name in (plugin_name(pm, i) for i in pm.hook.lmc_compute_batch.get_hookimpls())
            if name not in declaring
        )
        """Plugins computing without declaring metrics (observers), called with ``selected=()``."""

    def owners(self, metrics: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """``{plugin name: its metrics among metrics}``, in selection order."""
        owned: dict[str, list[str]] = {}
        for name in metrics:
            owned.setdefault(self.selection.specs[name].plugin, []).append(name)
        return {plugin: tuple(names) for plugin, names in owned.items()}

    def implementation(self, hook: str, plugin: str) -> pluggy.HookImpl | None:
        """The plugin's implementation of ``hook`` (None: it has none)."""
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if plugin_name(self.pm, impl) == plugin:
                return impl
        return None

    def lenses(self, metrics: Sequence[str]) -> dict[str, str]:
        """``{plugin name: the lens its metrics among metrics read}`` (`MetricSpec.lens`)."""
        return {
            plugin: self.selection.specs[m].lens
            for plugin, own in self.owners(metrics).items()
            for m in own
            if "lens" in self.selection.specs[m].needs
        }

    def reducers(
        self, metrics: Sequence[str], options: Mapping[str, Any]
    ) -> dict[str, Callable[[BatchInfo], Any]]:
        """Per plugin owning a metric among ``metrics`` that streams: its reducer factory."""
        out = {}
        for plugin, own in self.owners(metrics).items():
            impl = self.implementation("lmc_layer_reducer", plugin)
            if impl is not None and any(
                STREAMED_NEEDS.intersection(self.selection.specs[m].needs) for m in own
            ):
                kwargs = dict(selected=own, options=options)
                out[plugin] = lambda batch, impl=impl, kwargs=kwargs: call(
                    impl, {**kwargs, "batch": batch}
                )
        return out

    def compute(
        self,
        metrics: Sequence[str],
        states: GeometryStates,
        docs: list[DocumentGeometry],
        reduced: Mapping[str, Any],
        errors: Mapping[str, str],
        lens_errors: Mapping[str, str],
        options: Mapping[str, Any],
    ) -> dict[str, float]:
        """Fill ``docs`` with each owning plugin's ``lmc_compute_batch`` answer, one at a time.

        Plugins that declare no metric at all (observers) are called too, with
        ``selected=()``; their failure is reported and changes no value.

        Returns:
            Per plugin, the wall seconds of its call (and retries) on the batch.
        """
        import time

        calls = {**dict.fromkeys(self.observers, ()), **self.owners(metrics)}
        seconds: dict[str, float] = {}
        for plugin, own in calls.items():
            start = time.perf_counter()
            self._compute_one(plugin, own, states, docs, reduced, errors, lens_errors, options)
            seconds[plugin] = time.perf_counter() - start
        return seconds

    def _compute_one(self, plugin, own, states, docs, reduced, errors, lens_errors, options):
        """One plugin's ``lmc_compute_batch`` on the batch, checked (see `compute`)."""
        error = errors.get(plugin)
        lens = self.lenses(own).get(plugin)
        if error is None and lens in lens_errors:
            error = f"the lens {lens!r} failed: {lens_errors[lens]}"
        impl = self.implementation("lmc_compute_batch", plugin)
        if error is not None:
            self.fail(plugin, own, states, docs, error)
            return
        if impl is None:
            return
        mine = reduced.get(plugin)
        result, error = self._answer(impl, own, states, mine, options)
        answer, failed = self._check(plugin, own, result, states, error)
        if failed and own and states.size > 1:
            rows = _rows_of(mine, states)
            if rows is not None:  # retried row by row: a failure is that document's
                self._row_by_row(plugin, own, impl, rows, states, docs, options)
                return
        self._keep(plugin, own, answer, failed, states, docs)

    def complete_task(
        self,
        metrics: Sequence[str],
        docs: list[DocumentGeometry],
        refs: Sequence[DocumentRef],
        options: Mapping[str, Any],
        parts: Any,
    ) -> None:
        """Fill ``docs`` with each owning plugin's ``lmc_complete_task`` answer (deferred metrics).

        The answer is checked as ``lmc_compute_batch``'s (one row per document);
        a plugin that raises or answers badly makes its deferred metrics NaN on
        the task's documents, reported like any plugin failure.
        """
        import types

        states = types.SimpleNamespace(
            size=len(docs),
            documents=tuple((ref,) for ref in refs),
            n_layers=getattr(parts, "n_layers", None),
        )
        task = refs[0].task if refs else ""
        for plugin, own in self.owners(metrics).items():
            impl = self.implementation("lmc_complete_task", plugin)
            if impl is None:
                self.fail(plugin, own, states, docs, "it has no lmc_complete_task hook")
                continue
            kwargs = dict(
                selected=own,
                options=options,
                documents=docs,
                task=task,
                doc_ids=[ref.doc_id for ref in refs],
                parts=parts,
            )
            try:
                result, error = call(impl, kwargs), None
            except Exception as exc:  # a plugin's failure is its own
                result, error = None, f"lmc_complete_task raised {exc!r}"
            answer, failed = self._check(plugin, own, result, states, error)
            self._keep(plugin, own, answer, failed, states, docs)

    def _row_by_row(self, plugin, own, impl, rows, states, docs, options) -> None:
        """Call the plugin on each row alone; fail only the rows that fail, one report per cause."""
        import dataclasses

        groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        for b, (state_b, mine_b) in enumerate(rows):
            result, error = self._answer(impl, own, state_b, mine_b, options)
            answer_b, failed_b = self._check(plugin, own, result, state_b, error)
            self._keep(plugin, own, answer_b, {}, state_b, docs[b : b + 1])
            for error, names in failed_b.items():
                groups.setdefault((error, tuple(dict.fromkeys(names))), []).append(b)
        for (error, names), index in groups.items():
            documents = tuple(states.documents[b] for b in index) if states.documents else ()
            subset = dataclasses.replace(states, size=len(index), documents=documents)
            self.fail(plugin, names, subset, [docs[b] for b in index], error)

    def _answer(self, impl, own, states, reduced, options) -> tuple[Any, str | None]:
        """``(answer, None)`` of one plugin's ``lmc_compute_batch``, or ``(None, error)``."""
        kwargs = dict(selected=own, states=states, options=options, reduced=reduced)
        try:
            return call(impl, kwargs), None
        except Exception as exc:  # a plugin's failure is its own
            return None, repr(exc)

    def _keep(self, plugin, own, answer, failed, states, docs) -> None:
        """Store the well-formed parts of an answer in ``docs``; fail the others' metrics."""
        for kind, name, rows in answer:
            if kind == "values":  # Python floats, made in one call
                for doc, value in zip(docs, rows.tolist(), strict=True):
                    doc.values[name] = value
            else:
                for doc, row in zip(docs, rows, strict=True):
                    getattr(doc, kind)[name] = row
        for error, names in failed.items():
            self.fail(plugin, tuple(dict.fromkeys(names)), states, docs, error)

    def _check(
        self, plugin: str, own: tuple[str, ...], result: Any, states: Any, error: str | None
    ) -> tuple[list[tuple[str, str, Any]], dict[str, list[str]]]:
        """``(well-formed parts as (kind, name, rows), {error: metrics})`` of one answer.

        Each part is checked against its declaration: a value is one real
        number per document, finite or NaN; a profile has the length of its
        axis (states: L + 1, blocks: L: its first dimension), a matrix at
        least two dimensions.
        """
        size, n_layers = states.size, getattr(states, "n_layers", None)
        if error is not None:
            return [], {error: list(own)}
        if result is None:
            return [], {}
        if not isinstance(result, Mapping):
            return [], {f"returned {type(result).__name__}, not a mapping": list(own)}
        declared = {p: m for m in own for p in self.selection.specs[m].profiles}
        answer: list[tuple[str, str, Any]] = []
        failed: dict[str, list[str]] = {}
        for name, tensor in (result.get("values") or {}).items():
            if name not in own:
                self._warn_once(
                    plugin,
                    f"unowned:{name}",
                    f"plugin {plugin!r} returned a value for {name!r}, which it does not own "
                    "among the metrics being computed; it is ignored",
                )
                continue
            column, error = _rows(tensor, size, f"values of {name!r}", per_row=())
            if isinstance(tensor, Exception):  # a short-form function raised
                error = f"{name} raised {tensor!r}"
            if error is not None:
                failed.setdefault(error, []).append(name)
            else:
                answer.append(("values", name, column))
        for kind in ("profiles", "summaries"):
            for name, tensor in (result.get(kind) or {}).items():
                if kind == "profiles" and name not in declared:
                    self._warn_once(
                        plugin,
                        f"undeclared:{name}",
                        f"plugin {plugin!r} returned the profile {name!r}, which none of its "
                        f"selected metrics ({', '.join(own)}) declares in MetricSpec.profiles; "
                        "it is ignored",
                    )
                    continue
                wide = kind == "profiles"  # summaries keep float32: never written, half the memory
                shape = None
                if wide and n_layers is not None:
                    shape = self.selection.specs[declared[name]].profile(name).shape(n_layers)
                rows, error = _rows(tensor, size, f"{kind[:-1]} {name!r}", shape, wide)
                if error is not None:
                    owner = [declared[name]] if kind == "profiles" else list(own)
                    failed.setdefault(error, []).extend(owner)
                else:
                    answer.append((kind, name, rows))
        return answer, failed

    def fail(
        self,
        plugin: str,
        metrics: tuple[str, ...],
        states: GeometryStates,
        docs: list[DocumentGeometry],
        error: str,
    ) -> None:
        """Make ``metrics`` NaN on every row, record the failure, warn once per plugin and cause."""
        record = {"plugin": plugin, "metrics": list(metrics), "error": error}
        for doc in docs:
            for name in metrics:
                doc.values[name] = math.nan
                for profile in self.selection.specs[name].profiles:
                    doc.profiles.pop(profile, None)
            if record not in doc.failures:
                doc.failures.append(dict(record))
        if not self.deferred:
            where = _documents(states.documents, len(docs))
            message = f"plugin {plugin!r} failed on {where}: {error}; {_consequence(metrics)}"
            self._warn_once(plugin, error.split("(", 1)[0], message)

    def _warn_once(self, plugin: str, cause: str, message: str) -> None:
        if (plugin, cause) in self._warned:
            return
        self._warned.add((plugin, cause))
        warnings.warn(f"lm-coupling: {message}", GeometryWarning, stacklevel=4)


def _consequence(metrics: Sequence[str]) -> str:
    if not metrics:
        return "it declares no metric, so no value changes"
    return (
        f"its metrics {', '.join(metrics)} are NaN there (the geometry file's failures name it); "
        "every other metric keeps its value"
    )


def warn_failures(task: str, failures: Sequence[Mapping[str, Any]]) -> None:
    """One warning per plugin and cause, counting every document of ``task`` it failed on.

    The first documents are named; the warning says where the others are
    (the geometry file's ``failures``, which lists every one).
    """
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for failure in failures:
        if "plugin" in failure and "metrics" in failure:
            cause = str(failure["error"]).split("(", 1)[0]
            groups.setdefault((failure["plugin"], cause), []).append(failure)
    for (plugin, _), group in groups.items():
        ids = list(dict.fromkeys(f["doc_id"] for f in group))
        metrics = list(dict.fromkeys(m for f in group for m in f["metrics"]))
        shown, rest = ", ".join(map(str, ids[:_SHOWN_DOCUMENTS])), len(ids) - _SHOWN_DOCUMENTS
        if rest > 0:
            shown += f" and {rest} more, every one in the geometry file's failures"
        plural = "s" if len(ids) > 1 else ""
        warnings.warn(
            f"lm-coupling: plugin {plugin!r} failed on {len(ids)} document{plural} of task "
            f"{task!r} (document{plural} {shown}): {group[0]['error']}; {_consequence(metrics)}",
            GeometryWarning,
            stacklevel=2,
        )


def plugin_name(pm: pluggy.PluginManager, impl: pluggy.HookImpl) -> str:
    """The name a plugin is registered under (its repr when it has none)."""
    return pm.get_name(impl.plugin) or repr(impl.plugin)


def call(impl: pluggy.HookImpl, kwargs: Mapping[str, Any]) -> Any:
    """Call one implementation with the arguments it takes (as pluggy does)."""
    return impl.function(**{name: kwargs[name] for name in impl.argnames})


def answers(pm: pluggy.PluginManager, hook: str, **kwargs: Any) -> dict[str, Any]:
    """``{plugin name: answer}`` of every implementation of ``hook``, in registration order.

    The one way every hook is called: each implementation on its own, with
    the arguments it takes. Errors propagate (`isolated_answers` keeps them).
    """
    return {
        plugin_name(pm, impl): call(impl, kwargs) for impl in getattr(pm.hook, hook).get_hookimpls()
    }


def isolated_answers(
    pm: pluggy.PluginManager, hook: str, **kwargs: Any
) -> dict[str, tuple[Any, Exception | None]]:
    """``{plugin name: (answer, None) or (None, error)}``: a plugin's failure is its own."""
    out: dict[str, tuple[Any, Exception | None]] = {}
    for impl in getattr(pm.hook, hook).get_hookimpls():
        try:
            out[plugin_name(pm, impl)] = (call(impl, kwargs), None)
        except Exception as exc:  # a plugin's failure is its own
            out[plugin_name(pm, impl)] = (None, exc)
    return out


class _Unsliceable(Exception):
    """A reduction that cannot be cut into rows."""


def _rows_of(reduced: Any, states: GeometryStates) -> list[tuple[GeometryStates, Any]] | None:
    """Per row b, ``(states of row b, reduction of row b)``; None when a part cannot be cut.

    A reduction is cut where it is made of tensors (or arrays) whose first
    dimension is B, inside mappings, lists, tuples and dataclasses; None, numbers
    and strings are shared by every row.
    """
    import dataclasses

    size = states.size

    def cut(value: Any, b: int) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if hasattr(value, "shape") and hasattr(value, "__getitem__"):
            if len(value.shape) == 0 or value.shape[0] != size:
                raise _Unsliceable
            return value[b : b + 1]
        if isinstance(value, Mapping):
            return {key: cut(item, b) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(cut(item, b) for item in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: cut(getattr(value, f.name), b) for f in dataclasses.fields(value)}
            return dataclasses.replace(value, **fields)
        raise _Unsliceable

    out = []
    try:
        for b in range(size):
            per_row = {  # documents and every engine list (jacobians, tokenwise, ...)
                f.name: getattr(states, f.name)[b : b + 1]
                for f in dataclasses.fields(states)
                if isinstance(getattr(states, f.name), (list, tuple))
            }
            row = dataclasses.replace(states, size=1, **per_row)
            out.append((row, cut(reduced, b)))
    except (_Unsliceable, TypeError, ValueError):
        return None
    return out


def _rows(
    tensor: Any, size: int, what: str, per_row: tuple | None, wide: bool = True
) -> tuple[Any, str | None]:
    """``(float64 rows on the host, None)``, or ``(None, error)`` for a wrong shape.

    ``per_row``: the shape of each row (``()``: one number per row, ``[B]``; a
    profile's `ProfileSpec.shape`, None entries of any length); None: any shape.
    ``wide=False`` (plugin summaries) keeps float32 (and narrower floats) as float32.
    """
    import numpy as np
    import torch

    try:
        if isinstance(tensor, torch.Tensor):
            narrow = not wide and tensor.is_floating_point() and tensor.dtype != torch.float64
            dtype = torch.float32 if narrow else torch.float64
            # Always a copy: a stored row never shares memory with a plugin's tensor.
            array = tensor.detach().to("cpu", dtype, copy=True).numpy()
        else:
            array = np.asarray(tensor)
            narrow = not wide and array.dtype in (np.float32, np.float16)
            array = array.astype(np.float32 if narrow else np.float64)
        if array.dtype.kind not in "biuf":
            raise TypeError(f"dtype {array.dtype}")
    except (TypeError, ValueError, RuntimeError) as exc:
        return None, f"{what} is not real numbers ({exc!r})"
    if array.ndim == 0 or array.shape[0] != size:
        found = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
        return None, f"{what} has {found} for {size} documents (shape {tuple(array.shape)})"
    if per_row == () and array.ndim != 1:
        return None, f"{what} must be one number per document, found shape {tuple(array.shape)}"
    if per_row == () and np.isinf(array).any():
        return None, f"{what} are infinite (a value is finite, or NaN where undefined)"
    found = array.shape[1:]
    if per_row and (
        len(found) != len(per_row)
        or any(want is not None and want != got for want, got in zip(per_row, found, strict=True))
    ):
        needs = " x ".join("any" if want is None else str(want) for want in per_row)
        needs += "" if len(per_row) > 1 else " entries"
        where = "axes need" if len(per_row) > 1 else "axis needs"
        return None, f"{what} has shape {found} per document where its declared {where} {needs}"
    return array, None


def _documents(documents: Sequence[Sequence[DocumentRef]], size: int) -> str:
    """``task 'arc' documents 3, 4`` (or ``rows 0..B-1`` without document identities)."""
    refs = [ref for row in documents for ref in row]
    if not refs:
        return f"{size} row(s) of a batch"
    by_task: dict[str, list[int]] = {}
    for ref in refs:
        by_task.setdefault(ref.task, []).append(ref.doc_id)
    parts = []
    for task, ids in by_task.items():
        shown = ", ".join(str(i) for i in ids[:_SHOWN_DOCUMENTS])
        more = f" and {len(ids) - _SHOWN_DOCUMENTS} more" if len(ids) > _SHOWN_DOCUMENTS else ""
        parts.append(f"task {task!r} document{'s' if len(ids) > 1 else ''} {shown}{more}")
    return "; ".join(parts)
