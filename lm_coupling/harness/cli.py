"""``--metrics`` and ``--metric_args`` on lm-eval's own ``run`` command.

`patch_run_command` adds the two flags to lm-eval's argument parser (its own
flags are never re-declared) and wraps the command's execution: without
``--metrics`` the stock command runs untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from lm_coupling.errors import ConfigurationError, LmCouplingError
from lm_coupling.harness.session import GeometrySession, set_active_session
from lm_coupling.selection import make_selection

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
DEFAULT_OUTPUT = "results"
HF_MODEL_NAMES = ("hf", "hf-auto", "huggingface", "hf-coupling")
log = logging.getLogger("lm_coupling")


def add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    """Add lm-coupling's two flags to lm-eval's ``run`` parser."""
    group = parser.add_argument_group("geometry (lm-coupling)")
    group.add_argument(
        "--metrics",
        default=None,
        metavar="<names>",
        help="hidden-state geometry to measure: comma list of metric names, or 'all' "
        "(`lm-coupling metrics` lists them)",
    )
    group.add_argument(
        "--metric_args",
        default=None,
        metavar="<k=v,...>",
        help="options of the selected metrics, e.g. k=10,norm=l1,coupling_docs=25",
    )


def patch_run_command() -> None:
    """Teach lm-eval's ``Run`` sub-command the geometry flags (idempotent)."""
    from lm_eval._cli.run import Run

    if getattr(Run, "_lmc_patched", False):
        return
    stock_add_args = Run._add_args
    stock_execute = Run.__dict__["_execute"].__func__

    def _add_args(self) -> None:
        stock_add_args(self)
        add_geometry_arguments(self._parser)

    def _execute(args: argparse.Namespace) -> None:
        if getattr(args, "metrics", None) is None:
            if getattr(args, "metric_args", None):
                _fail(
                    "--metric_args was given but --metrics is missing: add --metrics with "
                    "the metrics the options are for (e.g. --metrics all)"
                )
            for name in ("metrics", "metric_args"):
                if hasattr(args, name):
                    delattr(args, name)
            return stock_execute(args)
        return run_with_geometry(args, stock_execute)

    Run._add_args = _add_args
    Run._execute = staticmethod(_execute)
    Run._lmc_patched = True


def _fail(message: str) -> None:
    print(f"lm-coupling: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def prepare_arguments(args: argparse.Namespace) -> GeometrySession:
    """Validate the geometry flags and adjust lm-eval's arguments in place.

    Everything is checked here, before any model or data loads.

    Raises:
        ConfigurationError: unknown metric or option, or a non-hf model type.
    """
    selection = make_selection(args.metrics, args.metric_args)
    del args.metrics, args.metric_args
    model = args.model or "hf"
    if model not in HF_MODEL_NAMES:
        raise ConfigurationError(
            f"--metrics needs a Hugging Face model: --model {model!r} is not supported. "
            f"Use one of: {', '.join(HF_MODEL_NAMES)}"
        )
    args.model = "hf-coupling"
    user_paths = [args.include_path] if args.include_path else []
    args.include_path = [str(TASKS_DIR), *user_paths]
    if not args.output_path:
        args.output_path = DEFAULT_OUTPUT
    return GeometrySession(selection)


def run_with_geometry(args: argparse.Namespace, execute: Callable) -> None:
    """Run lm-eval's command with geometry capture, then refresh the leaderboard."""
    try:
        session = prepare_arguments(args)
    except LmCouplingError as exc:
        _fail(str(exc))
    import lm_coupling.harness.model  # noqa: F401  (registers the "hf-coupling" model)
    from lm_coupling.harness.registry import register_with_lm_eval

    register_with_lm_eval(session.selection.specs)
    session.cache_path_prefix = args.use_cache
    with geometry_run(session):
        try:
            execute(args)
        except LmCouplingError as exc:
            _fail(str(exc))
    if int(os.environ.get("RANK", "0")) == 0:  # one writer under data parallelism
        update_leaderboard(Path(args.output_path))


@contextlib.contextmanager
def geometry_run(session: GeometrySession) -> Iterator[GeometrySession]:
    """Install the session and lm-eval hooks for one run; undo them after."""
    from lm_eval.loggers.evaluation_tracker import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.outputs import results_file_location, write_geometry_files
    from lm_coupling.harness.tasks import attach_geometry

    stock_load = TaskManager.load
    stock_save = EvaluationTracker.save_results_aggregated

    def load(self, task_list):
        loaded = stock_load(self, task_list)
        attach_geometry(loaded.get("tasks", {}), session)
        return loaded

    def save_results_aggregated(self, results, samples=None):
        stock_save(self, results, samples)
        date_id = getattr(self, "date_id", None)
        if self.output_path and date_id:
            model_dir = str(self.general_config_tracker.model_name_sanitized)
            directory = results_file_location(self.output_path, model_dir)
            for path in write_geometry_files(directory, date_id, session, results):
                log.info("lm-coupling: wrote %s", path)

    sampled_filter = _SampledMetricsFilter()
    evaluator_log = logging.getLogger("lm_eval.evaluator_utils")
    TaskManager.load = load
    EvaluationTracker.save_results_aggregated = save_results_aggregated
    evaluator_log.addFilter(sampled_filter)
    set_active_session(session)
    try:
        yield session
    finally:
        set_active_session(None)
        evaluator_log.removeFilter(sampled_filter)
        TaskManager.load = stock_load
        EvaluationTracker.save_results_aggregated = stock_save


class _SampledMetricsFilter(logging.Filter):
    """Drop lm-eval's warning that metrics had different document counts.

    Coupling is measured on a sample of documents by design; the geometry
    file records how many (``coupling.n_sampled``).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Metrics were not scored on the same number" not in record.getMessage()


def update_leaderboard(results_dir: Path) -> None:
    """Rebuild ``results_dir/leaderboard.csv`` from every run in the folder."""
    try:
        from lm_coupling.report import write_leaderboard
    except ImportError:
        return
    try:
        path = write_leaderboard(results_dir)
    except Exception as exc:  # the run's own results are already saved
        log.warning("lm-coupling: could not update the leaderboard in %s: %r", results_dir, exc)
        return
    print(f"lm-coupling: leaderboard updated: {path}")
