"""The library core: one evaluation with geometry, on lm-eval's public Python API.

`run_evaluation` is what `lm_coupling.evaluate`, ``lm-coupling run`` and the
literal ``lm_eval ... --metrics`` all execute, so the three write the same
files. It checks what can be checked before anything loads, builds the
`CouplingHFLM` and its `GeometrySession` and a `GeometryTaskManager` sharing
it, calls ``lm_eval.simple_evaluate``, and writes lm-eval's files through its
own ``EvaluationTracker`` with the geometry files beside them.

One evaluation runs at a time per process (`ConcurrentRunError` otherwise):
lm-eval seeds the global random generators and configures global logging in
``simple_evaluate``.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from lm_coupling.errors import ConcurrentRunError
from lm_coupling.harness.tasks_dir import TASKS_DIR
from lm_coupling.selection import Selection

if TYPE_CHECKING:
    from lm_coupling.harness.run_config import RunConfig

log = logging.getLogger("lm_coupling")
_RUN_LOCK = threading.Lock()  # a guard, not run state: see the module docstring


@dataclass
class RunRecord:
    """What one run measured and wrote.

    Attributes:
        results: lm-eval's results (None off rank 0).
        geometry: per task, its geometry document (what the geometry file holds).
        files: per task, the geometry file written (empty without an output path).
        results_file: lm-eval's results file, when written.
        session: the run's `GeometrySession` (per-document records and plans).
    """

    results: dict[str, Any] | None = None
    session: Any = None
    geometry: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    results_file: Path | None = None


def include_paths(user: str | Iterable[str] | None) -> list[str]:
    """lm-coupling's task folder, then the user's ``--include_path`` folders."""
    extra = user.split(",") if isinstance(user, str) else [str(p) for p in user or ()]
    return [str(TASKS_DIR), *[p for p in extra if p and p != str(TASKS_DIR)]]


def resolve_tasks(task_manager: Any, tasks: str | Iterable[Any]) -> list[Any]:
    """lm-eval's task names, groups, tags and YAML files, resolved before the model loads.

    Raises:
        ConfigurationError: a name matches no task (with close names).
    """
    import glob

    from lm_coupling.harness.lm_eval_adapter import load_task_yaml
    from lm_coupling.harness.task_names import unknown_tasks

    words = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    resolved: list[Any] = []
    missing = []
    for word in words:
        if not isinstance(word, str):
            resolved.append(word)
            continue
        word = word.strip()
        if word.endswith(".yaml"):
            matches = [load_task_yaml(f) for f in glob.glob(str(Path(word)))]
        else:
            matches = task_manager.match_tasks([word])
        if not matches:
            missing.append(word)
        resolved.extend(m for m in matches if m not in resolved)
    if missing:
        raise unknown_tasks(missing, task_manager.all_tasks)
    return resolved


def run_evaluation(run: RunConfig, *, stream: TextIO | None = None) -> RunRecord:
    """Evaluate with geometry; the one implementation behind every route.

    Args:
        run: the run's configuration (`RunConfig.from_keywords` or
            `RunConfig.from_command_line`: checked and frozen).
        stream: where the end-of-run account goes (default: standard error).

    Returns:
        The `RunRecord`: results, geometry documents and files written.

    Raises:
        LmCouplingError: a configuration, model or data problem, before the
            model loads where it can be known then.
    """
    from lm_coupling.harness.task_names import check_task_names

    if run.task_manager is None:  # an index given is already built: it resolves at once
        check_task_names(run.evaluator.tasks, include_paths(run.evaluator.include_path))
    if not _RUN_LOCK.acquire(blocking=False):
        raise ConcurrentRunError(
            "another lm-coupling evaluation is running in this process: lm-eval seeds the "
            "global random generators and logging in every run, so two at once could not "
            "both give their own values. Run them one after the other, or in two processes"
        )
    try:
        return _run(run, stream)
    finally:
        _RUN_LOCK.release()


def _run(run: RunConfig, stream: TextIO | None) -> RunRecord:
    """Tasks resolved, then the model, then its session, then lm-eval's evaluation."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker, WandbLogger
    from lm_eval.tasks import TaskManager

    from lm_coupling.files import output_root
    from lm_coupling.harness.lm_eval_registry import registered_metrics
    from lm_coupling.harness.offline_splits import check_offline_splits
    from lm_coupling.harness.outputs import (
        add_task_level_values,
        add_undefined_rows,
        geometry_documents,
    )
    from lm_coupling.harness.quiet import quiet_lm_eval
    from lm_coupling.harness.tasks import GeometryTaskManager

    config, selection = run.evaluator, run.selection
    metadata = config.metadata or {}
    index = run.task_manager or TaskManager(
        include_path=include_paths(config.include_path), metadata=metadata
    )
    tasks = resolve_tasks(index, config.tasks)  # task names fail before the model loads
    check_offline_splits(index, tasks, metadata)  # so does an offline data folder lacking a split
    hub_args = dict(config.hf_hub_log_args or {})
    if config.output_path:
        hub_args["output_path"] = config.output_path
    tracker = EvaluationTracker(**hub_args)
    wandb_logger = (
        WandbLogger(config.wandb_args, config.wandb_config_args) if config.wandb_args else None
    )
    with registered_metrics(selection.specs), quiet_lm_eval(selection.metrics):
        lm = build_model(run)
        session = lm.open_session(run)
        task_manager = GeometryTaskManager.sharing_index(
            index, session, metadata, measure_alone=lm.measure_alone
        )
        seed = config.seed or [None] * 4
        results = simple_evaluate(
            model=lm,
            # An in-memory model's name and weights fingerprint, else the user's model_args.
            model_args=dict(
                (run.model_record if run.model is not None else config.model_args) or {}
            ),
            tasks=tasks,
            num_fewshot=config.num_fewshot,
            batch_size=config.batch_size,
            max_batch_size=config.max_batch_size,
            device=config.device,
            use_cache=config.use_cache,
            cache_requests=config.cache_requests.get("cache_requests", False),
            rewrite_requests_cache=config.cache_requests.get("rewrite_requests_cache", False),
            delete_requests_cache=config.cache_requests.get("delete_requests_cache", False),
            limit=config.limit,
            samples=config.samples,
            bootstrap_iters=run.bootstrap_iters,
            check_integrity=config.check_integrity,
            write_out=config.write_out,
            log_samples=run.log_samples,
            evaluation_tracker=tracker,
            system_instruction=config.system_instruction,
            apply_chat_template=config.apply_chat_template,
            fewshot_as_multiturn=config.fewshot_as_multiturn,
            gen_kwargs=config.gen_kwargs,
            task_manager=task_manager,
            verbosity=config.verbosity,
            predict_only=config.predict_only,
            random_seed=seed[0],
            numpy_random_seed=seed[1],
            torch_random_seed=seed[2],
            fewshot_random_seed=seed[3],
            confirm_run_unsafe_code=config.confirm_run_unsafe_code,
            metadata=config.metadata,
        )
    record = RunRecord(session=session)
    if results is None:  # another data-parallel rank writes
        return record
    # The user's --model stays in config.model; lm-coupling's class is noted beside it.
    results["config"]["model"] = run.model_type
    results["config"].setdefault("lm_coupling", {})["model_class"] = "hf-coupling"
    samples = results.pop("samples", None) if run.log_samples else None
    directory = None
    if config.output_path:
        # The folder lm-eval's EvaluationTracker writes its results file into.
        directory = output_root(config.output_path)
        if Path(config.output_path).suffix != ".json":
            directory = directory / str(tracker.general_config_tracker.model_name_sanitized)
    # Before the results are shown or saved. lm-eval names its files when it saves them
    # (after this): the plugins' files get the run's own timestamp, in lm-eval's format.
    run_id = datetime.datetime.now().isoformat().replace(":", "-")
    record.geometry = geometry_documents(session, results, directory, run_id)
    add_task_level_values(results, record.geometry, session)
    add_undefined_rows(results, record.geometry, session)
    if config.show_config:
        from lm_eval.utils import handle_non_serializable

        print(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    if wandb_logger is not None:
        _log_to_wandb(wandb_logger, results, samples)
    if directory is not None:
        _write_outputs(tracker, directory, results, samples, record)
    if run.echo:
        _print_tables(config, results, run.model_type)
    record.results = results if samples is None else {**results, "samples": samples}
    _print_account(record, selection, stream)
    if config.output_path:
        from lm_coupling.harness.outputs import refresh_leaderboard

        refresh_leaderboard(output_root(config.output_path), stream)
    return record


def build_model(run: RunConfig) -> Any:
    """The run's `CouplingHFLM` (no session yet): from memory or from ``model_args``."""
    from lm_coupling.harness.model import CouplingHFLM

    config = run.evaluator
    sizes = {k: getattr(config, k) for k in ("batch_size", "max_batch_size", "device")}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if run.model is not None:
        return CouplingHFLM(pretrained=run.model, tokenizer=run.tokenizer, **sizes)
    return CouplingHFLM(**dict(config.model_args or {}), **sizes)


def _log_to_wandb(wandb_logger: Any, results: dict, samples: dict | None) -> None:
    """Log to W&B as lm-eval's command line does (geometry values are ordinary metrics)."""
    try:
        wandb_logger.post_init(results)
        wandb_logger.log_eval_result()
        if samples is not None:
            wandb_logger.log_eval_samples(samples)
    except Exception as exc:  # lm-eval's own behaviour: W&B never fails the run
        log.warning("lm-coupling: logging to W&B failed: %r", exc)
    finally:
        wandb_logger.run.finish()


def _write_outputs(tracker, directory: Path, results, samples, record: RunRecord) -> None:
    """lm-eval's results and samples files, then one geometry file per task."""
    from lm_coupling.harness.outputs import write_geometry_file

    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
        for task_name in results.get("configs", {}):
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    if tracker.push_results_to_hub or tracker.push_samples_to_hub:
        tracker.recreate_metadata_card()
    date_id = tracker.date_id
    record.results_file = next(iter(sorted(directory.glob(f"results_{date_id}.json"))), None)
    for task_name, document in record.geometry.items():
        path = write_geometry_file(directory, task_name, date_id, document)
        record.files[task_name] = path
        log.info("lm-coupling: wrote %s", path)


def _print_tables(config: Any, results: dict, model_type: str) -> None:
    """lm-eval's header line and results tables, as its command line prints them."""
    from lm_eval.utils import make_table

    model_args = {k: v for k, v in (config.model_args or {}).items() if k != "trust_remote_code"}
    batch_sizes = ",".join(map(str, results["config"].get("batch_sizes", [])))
    print(
        f"{model_type} ({model_args}), gen_kwargs: ({config.gen_kwargs}), "
        f"limit: {config.limit}, num_fewshot: {config.num_fewshot}, "
        f"batch_size: {config.batch_size}{f' ({batch_sizes})' if batch_sizes else ''}"
    )
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))


def _print_account(record: RunRecord, selection: Selection, stream: TextIO | None) -> None:
    """One line per task: the documents each selected metric was computed on."""
    from lm_coupling.harness.run_summary import leaf_tasks, summary_lines

    stream = stream if stream is not None else sys.stderr
    sampled = [m for m in selection.metrics if selection.specs[m].sampled]
    files = {
        task: (record.files.get(task, Path("(not written)")), document)
        for task, document in record.geometry.items()
    }
    expected = [m for m in selection.metrics if selection.specs[m].nan_expected]
    tasks = leaf_tasks(record.results)
    for line in summary_lines(tasks, files, sampled, selection.metrics, expected):
        level = "ERROR: " if line.error else ""
        print(f"lm-coupling: {level}{line.text}", file=stream)
