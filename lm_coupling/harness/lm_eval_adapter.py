"""The one module that uses lm-eval beyond its documented public API.

lm-coupling's public route into lm-eval is ``simple_evaluate``, ``EvaluatorConfig``,
``TaskManager``, ``HFLM``'s public methods and the registry's public functions.
Everything else it relies on lives here, one function (or hook) per use, each
commented with the lm-eval behaviour it relies on;
``tests/harness/test_lm_eval_contract.py`` checks every use against the installed
lm-eval and names the use that broke. No other module of the package reads or
writes a private name of lm-eval (a test greps for it).

Built and tested against lm-eval 0.4.13 (docs/compatibility.md: the versions,
and the route a run takes where lm-eval has entry-point plugins).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from types import MappingProxyType
from typing import Any

from lm_eval.models.huggingface import HFLM

METRIC_TABLES = ("metric_registry", "metric_agg_registry", "higher_is_better_registry")
"""The registries ``lm_eval.api.registry.register_metric`` writes one metric into."""


# -- HFLM's private steps, as public hooks ------------------------------------------------
class HFLMWithHooks(HFLM):
    """lm-eval's ``HFLM`` whose private steps call public hooks a subclass overrides.

    HFLM has no public hook for any of these four steps (lm-eval's own
    ``SteeredModel`` overrides ``_model_call`` and ``_model_generate`` the same
    way); each override here only forwards, so the subclass (`CouplingHFLM`)
    overrides public names only. Without overridden hooks it is exactly HFLM.
    """

    def encoded_requests(self, requests: list[Any]) -> contextlib.AbstractContextManager:
        """Hook: a context around the scoring of encoded log-likelihood requests.

        ``requests`` are ``(cache_key, context_enc, continuation_enc)`` as HFLM
        encoded them; the batches of these requests run inside the context.
        """
        return contextlib.nullcontext()

    def forward_batch(self, inps: Any, call: Callable[..., Any]) -> Any:
        """Hook: one causal forward batch ``inps [B, T]``; ``call()`` runs HFLM's own.

        ``call(batch)`` runs HFLM's forward on another ``[B', T]`` batch instead
        (``inps`` with rows appended, say); lm-eval reads only the first ``B``
        rows of what the hook returns.
        """
        return call()

    def generate_batch(
        self, context: Any, generation_kwargs: dict[str, Any], call: Callable[[], Any]
    ) -> Any:
        """Hook: one generation batch ``context [B, T]``; ``call()`` runs HFLM's own."""
        return call()

    def batch_size_search(self) -> contextlib.AbstractContextManager:
        """Hook: a context around ``--batch_size auto``'s search (probes call `forward_batch`)."""
        return contextlib.nullcontext()

    # Relies on: HFLM.loglikelihood encodes every request to (cache_key, context_enc,
    # continuation_enc) and scores them all in one call of _loglikelihood_tokens.
    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        with self.encoded_requests(requests):
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)

    # Relies on: every forward pass of HFLM (scoring batches, batch-size probes) goes
    # through _model_call(inps) with a right-padded [B, T] batch; seq2seq passes a mask.
    def _model_call(self, inps, attn_mask=None, labels=None):
        if attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

        def call(batch=inps):
            return super(HFLMWithHooks, self)._model_call(batch)

        return self.forward_batch(inps, call)

    # Relies on: generate_until runs each batch through _model_generate(context, max_length,
    # stop, **generation_kwargs), generation_kwargs holding the left-padding attention_mask.
    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        def call():
            return super(HFLMWithHooks, self)._model_generate(
                context, max_length, stop, **generation_kwargs
            )

        return self.generate_batch(context, generation_kwargs, call)

    # Relies on: ``--batch_size auto`` searches through _detect_batch_size, whose probe
    # batches go through _model_call.
    def _detect_batch_size(self, requests=None, pos=0):
        with self.batch_size_search():
            return super()._detect_batch_size(requests, pos)


def encode_pair(lm: HFLM, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """HFLM's encoding of a non-empty context and its continuation (token ids each).

    Relies on: ``HFLM._encode_pair`` is the encoding ``loglikelihood`` applies
    to each request (trailing spaces of the context moved to the continuation).
    """
    return lm._encode_pair(context, continuation)


def loglikelihood_input(
    lm: HFLM, context_enc: list[int], continuation_enc: list[int]
) -> tuple[list[int], int]:
    """The model input HFLM builds for a request, and the position of its last context token.

    Relies on: ``HFLM._loglikelihood_tokens`` (causal models) feeds
    ``(context_enc + continuation_enc)[-(max_length + 1):][:-1]``, truncated
    from the left; HFLM exposes no function for this, so the rule is written
    here once and the contract test compares it with the input HFLM feeds
    the model. The position is negative when the truncation cut into the continuation.
    """
    inp = (context_enc + continuation_enc)[-(lm.max_length + 1) :][:-1]
    return inp, len(inp) - len(continuation_enc)


# -- tasks ------------------------------------------------------------------------------
@contextlib.contextmanager
def templates_compiled_once() -> Iterator[None]:
    """Inside the context, lm-eval compiles each Jinja template string once, not per call.

    Planning reads each document's gold answer (``task.doc_to_target``), and
    lm-eval compiles the task's template anew on every call (about 0.5 ms per
    document, most of the planning cost). A compiled template renders what a
    fresh compile of the same string would.

    Relies on: ``lm_eval.utils.apply_template`` renders through
    ``lm_eval.utils.env.from_string(template)`` (a module-level Jinja
    environment). Not thread-safe: used around planning, on the calling thread.
    """
    from lm_eval import utils

    env = utils.env
    compile_ = env.from_string
    before = env.__dict__.get("from_string", _ABSENT)
    compile_once = functools.cache(compile_)

    def from_string(source: Any, globals: Any = None, template_class: Any = None) -> Any:
        if globals is not None or template_class is not None or not isinstance(source, str):
            return compile_(source, globals, template_class)
        return compile_once(source)

    env.from_string = from_string
    try:
        yield
    finally:
        if before is _ABSENT:
            del env.from_string
        else:
            env.from_string = before


_ABSENT = object()


def share_task_index(shared: Any, manager: Any, metadata: dict[str, Any] | None) -> None:
    """Make ``shared`` (a new, uninitialised ``TaskManager``) use ``manager``'s task index.

    Relies on: a ``TaskManager`` keeps its index and name lists as instance
    attributes and merges ``metadata`` into loaded tasks through its
    ``_factory`` (a ``TaskFactory(meta=...)``); lm-eval has no public way to
    build a manager from an existing index (indexing every task folder takes ~15 s).
    """
    shared.__dict__.update(manager.__dict__)
    shared.metadata = metadata
    shared._factory = type(manager._factory)(meta=metadata)


def declare_task_metric(
    task: Any, name: str, aggregation: Callable, higher_is_better: bool
) -> None:
    """Make ``task`` aggregate metric ``name`` with ``aggregation`` and know its direction.

    Relies on: ``Task.aggregation()`` and ``Task.higher_is_better()`` return the
    task's ``_aggregation_list`` and ``_higher_is_better`` dicts, which lm-eval's
    evaluator reads per metric after scoring.
    """
    task._aggregation_list[name] = aggregation
    task._higher_is_better[name] = higher_is_better


def load_task_yaml(path: str) -> Any:
    """A task config read from a YAML file, its ``!function`` tags resolved.

    Relies on: ``lm_eval.tasks._yaml_loader.load_yaml(path, resolve_func=True)``
    reads a task YAML as ``lm_eval --tasks file.yaml`` does (lm-eval has no
    public reader of one file).
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=True)


# -- the documents a task evaluates -----------------------------------------------------
def evaluated_documents(
    task: Any, limit: float | None, samples: Sequence[int] | None
) -> list[tuple[int, int, Any]]:
    """The documents lm-eval evaluates for ``task``: ``(request id, reported id, document)``.

    The request id is the ``doc_id`` of the document's requests; the reported
    id is the one lm-eval's samples file gives (`reported_doc_id`).

    Relies on: lm-eval's evaluator builds a task's requests from
    ``Task.doc_iterator(limit=get_sample_size(task, limit), samples=...)``,
    whose ``doc_id`` under ``--samples`` is the position in the selection
    (0, 1, ...: lm-eval 0.4.13 enumerates the selected documents), not the
    listed index; a ``--limit`` below 1 is a fraction of the documents.
    """
    from lm_eval.evaluator_utils import get_sample_size

    indices = list(samples) if samples else None
    limit = get_sample_size(task, limit)
    pairs = task.doc_iterator(rank=0, world_size=1, limit=limit, samples=indices)
    return [(doc_id, reported_doc_id(indices, doc_id), doc) for doc_id, doc in pairs]


def reported_doc_id(samples: Sequence[int] | None, doc_id: int) -> int:
    """The ``doc_id`` lm-eval's samples file gives the document of requests ``doc_id``.

    Relies on: lm-eval's evaluator writes ``samples[doc_id]`` (the task's
    ``--samples`` list, in the order given) for a request ``doc_id``, and
    ``doc_id`` itself without ``--samples``.
    """
    return int(samples[doc_id]) if samples else doc_id


# -- the metric registries --------------------------------------------------------------
def registry_is_frozen(table: Any) -> bool:
    """Whether an lm-eval ``Registry`` was frozen (``Registry.freeze``, ``freeze_all``).

    Relies on: ``freeze`` replaces the registry's ``_objs`` dict by a ``MappingProxyType``.
    """
    return isinstance(getattr(table, "_objs", None), MappingProxyType)


@contextlib.contextmanager
def thawed(table: Any) -> Iterator[None]:
    """Let ``table`` be written for the block, frozen again after it if it was frozen.

    Relies on: a frozen registry's entries are ``_objs`` (a ``MappingProxyType``)
    and ``freeze`` makes a read-only view of a plain dict again.
    """
    frozen = registry_is_frozen(table)
    if frozen:
        table._objs = dict(table._objs)
    try:
        yield
    finally:
        if frozen:
            table.freeze()


def unregister(table: Any, name: str) -> bool:
    """Remove ``name`` from an lm-eval registry (frozen or not); whether it was there.

    Relies on: a ``Registry`` keeps its entries in ``_objs`` (no public removal).
    """
    with thawed(table):
        return table._objs.pop(name, None) is not None


def has_entry_point_plugins() -> bool:
    """Whether the installed lm-eval discovers plugins (models, metrics) through entry points.

    lm-eval 0.4.13 has none; its main branch adds a plugin loader to
    ``lm_eval.api.registry`` (``load_plugins``/``load_entry_points``), reading the
    ``lm_eval.models``/``lm_eval.metrics`` groups.
    """
    import lm_eval.api.registry as registry

    return any(hasattr(registry, name) for name in ("load_plugins", "load_entry_points"))


# -- a run's noise (harness/quiet.py) -----------------------------------------------------
TASK_LOGGER = "lm_eval.api.task"
"""The logger lm-eval's ``Task`` warns through (its ``--metadata`` hint per task).

Relies on: ``lm_eval.api.task`` logs through ``logging.getLogger(__name__)``.
"""


@contextlib.contextmanager
def git_commit_probe(probe: Callable[[], str | None]) -> Iterator[None]:
    """Within the block, lm-eval records ``probe()`` as a run's ``git_hash``.

    Relies on: ``lm_eval.evaluator`` imports ``get_git_commit_hash`` by name
    from ``lm_eval.loggers.utils`` and calls it once per run for
    ``results["git_hash"]`` (lm-eval has no option to skip or quiet that
    probe). The stock function is restored after the block; where the
    evaluator has no such name, nothing is replaced.
    """
    import lm_eval.evaluator as evaluator

    stock = evaluator.__dict__.get("get_git_commit_hash")
    if stock is not None:
        evaluator.get_git_commit_hash = probe
    try:
        yield
    finally:
        if stock is not None:
            evaluator.get_git_commit_hash = stock


def commit_from_path(path: str) -> str | None:
    """lm-eval's fallback when git cannot run: the commit read from ``path``'s ``.git``.

    Relies on: ``lm_eval.loggers.utils.get_commit_from_path(path)`` is what
    ``get_git_commit_hash`` returns when ``git describe`` fails.
    """
    from lm_eval.loggers.utils import get_commit_from_path

    return get_commit_from_path(path)


# -- the run command ----------------------------------------------------------------------
def run_command_parser(add_arguments: Callable[[argparse.ArgumentParser], None]):
    """lm-eval's command-line parser (a fresh instance) with ``add_arguments`` on ``run``.

    Relies on: ``lm_eval._cli.harness.HarnessCLI`` builds the parser in
    ``_parser`` with the sub-commands in ``_subparsers`` (``run`` among them).
    """
    from lm_eval._cli.harness import HarnessCLI

    cli = HarnessCLI()
    add_arguments(cli._subparsers.choices["run"])
    return cli._parser


def patch_run_command(
    add_arguments: Callable[[argparse.ArgumentParser], None],
    execute: Callable[[argparse.Namespace, Callable[[argparse.Namespace], Any]], None],
) -> None:
    """Give lm-eval's ``run`` sub-command ``add_arguments`` and route it through ``execute``.

    Stands in for a command-line plugin mechanism lm-eval 0.4.13 does not
    have. Relies on: ``lm_eval._cli.run.Run`` adds its arguments in
    ``_add_args`` (to ``self._parser``) and runs through the static
    ``_execute(args)``. The class is restored when the command ends
    (idempotent while applied).
    """
    from lm_eval._cli.run import Run

    if getattr(Run, "_lmc_patched", False):
        return
    stock_add_args = Run.__dict__["_add_args"]
    stock_execute = Run.__dict__["_execute"]

    def _add_args(self) -> None:
        stock_add_args(self)
        add_arguments(self._parser)

    def _execute(args: argparse.Namespace) -> None:
        try:
            execute(args, stock_execute.__func__)
        finally:
            Run._add_args, Run._execute = stock_add_args, stock_execute
            del Run._lmc_patched

    Run._add_args = _add_args
    Run._execute = staticmethod(_execute)
    Run._lmc_patched = True
