"""``--metrics`` and ``--metric_args`` on lm-eval's own ``run`` command.

`patch_run_command` adds the two flags to lm-eval's argument parser (its own
flags are never re-declared) and wraps the command's execution: without
``--metrics`` the stock command runs untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from lm_coupling.errors import ConfigurationError, DataUnavailableError, LmCouplingError
from lm_coupling.harness.run_options import check_run_options
from lm_coupling.harness.run_summary import leaf_tasks, summary_lines
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

    def _execute(args: argparse.Namespace) -> dict | None:
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
    lm_eval_options = check_run_options(args)  # refused lm-eval options stop here
    args.model = "hf-coupling"
    user_paths = [args.include_path] if args.include_path else []
    args.include_path = [str(TASKS_DIR), *user_paths]
    if not args.output_path:
        args.output_path = DEFAULT_OUTPUT
    session = GeometrySession(selection)
    session.lm_eval_options = lm_eval_options  # config.lm_coupling.lm_eval_options
    return session


def run_with_geometry(args: argparse.Namespace, execute: Callable) -> dict | None:
    """Run lm-eval's command with geometry capture, then refresh the leaderboard.

    Returns:
        lm-eval's results (with ``samples`` when logged); None off rank 0.
    """
    model_type = args.model or "hf"
    try:
        session = prepare_arguments(args)
    except LmCouplingError as exc:
        _fail(str(exc))
    import lm_coupling.harness.model  # noqa: F401  (registers the "hf-coupling" model)
    from lm_coupling.harness.registry import register_with_lm_eval

    register_with_lm_eval(session.selection.specs)
    session.cache_path_prefix = args.use_cache
    run = GeometryRun(session)
    with geometry_run(session, model_type=model_type, run=run):
        try:
            execute(args)
        except LmCouplingError as exc:
            _fail(str(exc))
    print_run_summary(run)
    if int(os.environ.get("RANK", "0")) == 0:  # one writer under data parallelism
        output = Path(args.output_path)  # a folder, or a results file name
        update_leaderboard(output.parent if output.suffix == ".json" else output)
    return session.results


@dataclass
class GeometryRun:
    """What one run wrote: the session, its tasks, and per task its geometry file."""

    session: GeometrySession
    tasks: list[str] = field(default_factory=list)
    files: dict[str, tuple[Path, dict]] = field(default_factory=dict)
    saved: bool = False


@contextlib.contextmanager
def geometry_run(
    session: GeometrySession, model_type: str | None = None, run: GeometryRun | None = None
) -> Iterator[GeometrySession]:
    """Install the session and lm-eval hooks for one run; undo them after.

    Args:
        session: the run's geometry session.
        model_type: the ``--model`` the user typed; the results keep it as
            ``config.model`` and record the class lm-coupling substituted as
            ``config.lm_coupling.model_class``.
        run: filled with the tasks and geometry files written (for
            `print_run_summary`).
    """
    from lm_eval.loggers.evaluation_tracker import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.tasks import attach_geometry

    run = run if run is not None else GeometryRun(session)
    stock_load = TaskManager.load
    stock_save = EvaluationTracker.save_results_aggregated

    def load(self, task_list):
        try:
            loaded = stock_load(self, task_list)
        except ConnectionError as exc:
            raise DataUnavailableError(offline_hint(task_list, exc)) from exc
        attach_geometry(loaded.get("tasks", {}), session)
        return loaded

    def save_results_aggregated(self, results, samples=None):
        if model_type is not None:
            _record_model_type(results, model_type)
        stock_save(self, results, samples)
        session.results = results if samples is None else {**results, "samples": samples}
        _write_geometry(self, results, run)

    sampled_filter = _SampledMetricsFilter(session.selection.metrics)
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


def _record_model_type(results: dict, model_type: str) -> None:
    """Keep the user's ``--model`` in ``config.model``; note the substituted class."""
    config = results.get("config")
    if not isinstance(config, dict):
        return
    substituted = config.get("model")
    config["model"] = model_type
    if isinstance(substituted, str) and substituted != model_type:
        config.setdefault("lm_coupling", {})["model_class"] = substituted


def _write_geometry(tracker, results: dict, run: GeometryRun) -> None:
    """Write the geometry files beside lm-eval's results file; remember them."""
    from lm_coupling.harness.outputs import results_file_location, write_geometry_files

    run.tasks = leaf_tasks(results)
    date_id = getattr(tracker, "date_id", None)
    if not (tracker.output_path and date_id):
        return
    run.saved = True
    model_dir = str(tracker.general_config_tracker.model_name_sanitized)
    directory = results_file_location(tracker.output_path, model_dir)
    for path in write_geometry_files(directory, date_id, run.session, results):
        log.info("lm-coupling: wrote %s", path)
        document = json.loads(path.read_text(encoding="utf-8"))
        run.files[str(document.get("task"))] = (path, document)


def print_run_summary(run: GeometryRun, stream: TextIO | None = None) -> None:
    """Print one line per task: the documents each selected metric was computed on."""
    if not run.saved or int(os.environ.get("RANK", "0")) != 0:
        return
    stream = stream if stream is not None else sys.stderr
    selection = run.session.selection
    sampled = [m for m in selection.metrics if selection.specs[m].sampled]
    for line in summary_lines(run.tasks, run.files, sampled, selection.metrics):
        level = "ERROR: " if line.error else ""
        print(f"lm-coupling: {level}{line.text}", file=stream)


def offline_hint(task_list, exc: Exception) -> str:
    """The message for a hub task whose data cannot be downloaded."""
    offline = sorted(p.stem for p in TASKS_DIR.glob("lmc_*_offline.yaml"))
    return (
        f"the data of {task_list!r} cannot be downloaded ({exc}). Without network, run "
        f"lm-coupling's offline variants, which read local JSONL files: {', '.join(offline)}, "
        "lmc_mmlu_offline (all six benchmarks: lmc_openllm_v1_offline). Point "
        "$LM_COUPLING_DATA_DIR at your converted files (layout: lm_coupling/tasks/README.md); "
        "without it they run on the bundled sample documents."
    )


class _SampledMetricsFilter(logging.Filter):
    """Drop lm-eval's warning that metrics had different document counts, for geometry only.

    Coupling is measured on a sample of documents by design; the geometry
    file records how many (``coupling.n_sampled``). The warning is dropped
    only when the benchmark's own metrics all have one count and no geometry
    metric has more; any other mismatch is the benchmark's and is kept.
    """

    COUNTS = re.compile(r"Metrics were not scored on the same number of documents \((.*?)\)\.")

    def __init__(self, geometry_metrics: Iterable[str] = ()):
        super().__init__()
        self.geometry_metrics = frozenset(geometry_metrics)

    def filter(self, record: logging.LogRecord) -> bool:
        """False only for the count warning caused by sampled geometry metrics."""
        match = self.COUNTS.search(record.getMessage())
        if match is None:
            return True
        own, geometry = set(), set()
        for item in match.group(1).split(", "):
            key, _, count = item.rpartition("=")
            if not count.isdigit():
                return True
            metric = key.split(",", 1)[0]
            (geometry if metric in self.geometry_metrics else own).add(int(count))
        return not (len(own) == 1 and all(n <= min(own) for n in geometry))


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
