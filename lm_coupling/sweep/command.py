"""``lm-coupling sweep MODELS --tasks ... --output_path DIR [lm_eval arguments]``.

Every model of MODELS (see `lm_coupling.sweep.spec`) runs through the same
lm-eval evaluation, one process per model, into one results folder; then the
report is built on the folder. Models (and tasks) already complete in the
folder are skipped (the rule: `lm_coupling.sweep.plan`), a failing model is
recorded (`lm_coupling.sweep.status`) and the sweep goes on.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lm_coupling.errors import ConfigurationError
from lm_coupling.sweep import status as records
from lm_coupling.sweep.plan import PlannedModel, parse_shard, plan_sweep
from lm_coupling.sweep.progress import SweepProgress
from lm_coupling.sweep.runner import LOG_DIR, run_command, run_model
from lm_coupling.sweep.spec import parse_models, split_top_level
from lm_coupling.sweep.study import Study, load_study, study_names

EXIT_SOME_FAILED = 1
PLAN_JSON = "sweep_plan.json"


def build_parser() -> argparse.ArgumentParser:
    """The sweep's own options; every other argument goes to ``lm_eval run``."""
    parser = argparse.ArgumentParser(
        prog="lm-coupling sweep",
        allow_abbrev=False,
        usage="lm-coupling sweep (MODELS --tasks TASKS | --study NAME) --output_path DIR "
        "[--plan] [--max-hours H] [options] [any lm_eval run argument]",
        description="Run every model of MODELS through the same lm-eval evaluation into one "
        "results folder, then write the report. MODELS: a YAML/CSV file or a comma list of "
        "name[@revision]; braces expand, e.g. EleutherAI/pythia-160m@step{0,1000,...,143000}. "
        f"--study NAME (first) runs a named study instead: {', '.join(study_names())} or a "
        "study .json file (docs/sweep.md).",
    )
    parser.add_argument("--tasks", required=True, help="lm-eval tasks, as for lm_eval")
    parser.add_argument(
        "--output_path", default=None, help="the shared results folder (required unless --plan)"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="with --study: print each model's documents, coupled documents and estimated "
        "time on the device (from a short calibration there), and run nothing",
    )
    parser.add_argument(
        "--max-hours",
        type=float,
        default=None,
        help="with --study: refuse to start when the estimate passes this many device-hours",
    )
    parser.add_argument(
        "--model_args",
        default=None,
        help="added to every model's pretrained= (peft=, dtype=, ...; never pretrained=)",
    )
    parser.add_argument("--metrics", default=None, help="lm-coupling metrics, as for run")
    parser.add_argument("--shard", default=None, help="i/n: run every n-th model from the i-th")
    parser.add_argument(
        "--max-models",
        type=int,
        default=None,
        help="stop after running this many models (a rerun finishes the rest)",
    )
    parser.add_argument(
        "--no-report", action="store_true", help="do not build the report (default with --shard)"
    )
    parser.add_argument("--quiet", action="store_true", help="lm-eval's output to the logs only")
    return parser


# lm-eval ``run`` flags a sweep sets per model itself, and why each cannot be passed on.
SET_BY_THE_SWEEP = {
    "--model": "every model of a sweep runs as a Hugging Face model (--model hf); MODELS "
    "names the models and --model_args adds arguments to each",
    "-M": "-M is --model: every model of a sweep runs as --model hf",
    "-a": "-a is --model_args: give the sweep's --model_args (added to every model)",
    "-o": "-o is --output_path: give the sweep's --output_path folder",
    "-t": "-t is --tasks: give the sweep's --tasks",
}


def parse_sweep_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``MODELS [options]`` into the sweep's options and lm-eval's arguments.

    Every lm-eval ``run`` option that makes sense per model is passed on to
    each model's run (``--include_path`` too: lm-coupling's task folder is
    added to it); they are checked once, before any model runs
    (`check_lm_eval_options`).

    Raises:
        ConfigurationError: MODELS missing or not first, an option the sweep
            sets per model (``--model``, ``pretrained=`` in ``--model_args``,
            ``--output_path`` of a model), or options `check_lm_eval_options` refuses.
    """
    argv = list(argv)
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        raise SystemExit(0)
    study, argv = _study_argv(argv)
    if not argv or argv[0].startswith("-"):
        raise ConfigurationError(
            "lm-coupling sweep needs MODELS first: a YAML/CSV file or a comma list of "
            "name[@revision], e.g. lm-coupling sweep gpt2,gpt2-medium --tasks hellaswag "
            "--output_path results"
        )
    args, rest = build_parser().parse_known_args(argv[1:])
    args.models = argv[0]
    args.study = study
    args.metric_names = split_top_level(args.metrics) if args.metrics else None
    if args.output_path is None and not args.plan:
        raise ConfigurationError("lm-coupling sweep needs --output_path DIR (the results folder)")
    if study is None and (args.plan or args.max_hours is not None):
        raise ConfigurationError(
            "--plan and --max-hours need a named study (--study NAME or a study .json file): "
            "the plan reads each task's documents from it (docs/sweep.md, 'Named studies')"
        )
    for flag, reason in SET_BY_THE_SWEEP.items():
        if any(word == flag or word.startswith(flag + "=") for word in rest):
            raise ConfigurationError(f"lm-coupling sweep cannot pass {flag} on: {reason}")
    if args.model_args and "pretrained=" in args.model_args:
        raise ConfigurationError(
            "--model_args of a sweep must not hold pretrained=: the sweep sets it per model "
            "from MODELS (add the model to MODELS instead)"
        )
    if args.metrics is not None:
        rest += ["--metrics", args.metrics]
    check_lm_eval_options(args, rest)
    return args, rest


def _study_argv(argv: list[str]) -> tuple[Study | None, list[str]]:
    """``--study NAME`` (anywhere) -> the study and ``MODELS --tasks ... [study args] [args]``.

    The study's own arguments come first, so that those typed beside it win.
    """
    at = next((i for i, w in enumerate(argv) if w == "--study" or w.startswith("--study=")), None)
    if at is None:
        return None, argv
    if "=" in argv[at]:
        name, typed = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1 :]
    elif at + 1 < len(argv):
        name, typed = argv[at + 1], argv[:at] + argv[at + 2 :]
    else:
        raise ConfigurationError(f"--study needs a name: {', '.join(study_names())} or a file")
    study = load_study(name)
    words = [f"study:{study.name}", "--tasks", study.tasks]
    if study.metrics:
        words += ["--metrics", study.metrics]
    if study.model_args:
        words += ["--model_args", study.model_args]
    return study, [*words, *study.lm_eval_args, *typed]


def check_lm_eval_options(args: argparse.Namespace, lm_eval_args: Sequence[str]) -> None:
    """Check the options every model's run will get, once, before any model runs.

    Raises:
        ConfigurationError: arguments ``lm_eval run`` refuses, a ``--config``
            YAML that sets what the sweep sets per model, or an option
            lm-coupling refuses with ``--metrics``.
    """
    from lm_coupling.harness.run_options import check_run_options, effective_options
    from lm_coupling.sweep.estimate import parse_run_args

    namespace = parse_run_args(lm_eval_args)
    # The flags that set these were refused above: what is left comes from --config
    # (or from a flag lm-eval's parser completes, e.g. --output for --output_path).
    options = effective_options(namespace)
    keys = [key for key in ("model", "tasks", "output_path") if key in options]
    keys += ["model_args.pretrained"] if "pretrained" in options["model_args"] else []
    if keys:
        where = f"--config {namespace.config}" if namespace.config else "an abbreviated flag"
        raise ConfigurationError(
            f"{where} sets {', '.join(keys)}, which the sweep sets per model; leave them out "
            "(models: MODELS; tasks: the sweep's --tasks; folder: its --output_path)"
        )
    if args.metrics is not None:
        namespace.tasks, namespace.model_args = args.tasks, args.model_args
        check_run_options(namespace)


def _run_one(planned: PlannedModel, args, lm_eval_args, out: Path, progress) -> str:
    entry = planned.entry
    progress.begin(entry.label, f"running {len(planned.tasks)} task(s): {','.join(planned.tasks)}")
    command = run_command(entry, planned.tasks, out, args.model_args, lm_eval_args)
    outcome = run_model(command, out / LOG_DIR / f"{entry.slug}.log", echo=not args.quiet)
    missing = plan_sweep([entry], planned.tasks, args.metric_names, out)[0].tasks
    error = outcome.error
    if outcome.returncode == 0 and missing:
        error = f"finished, but no complete results and geometry for {','.join(missing)}"
    state = "failed" if outcome.returncode != 0 or missing else "done"
    log = str(outcome.log.relative_to(out))
    tasks = ";".join(planned.tasks)
    status = records.ModelStatus(
        entry.name, entry.revision or "", state, tasks, round(outcome.seconds, 1), error, log
    )
    records.record(out, entry, status)
    progress.end(entry.label, state, outcome.seconds)
    if error:
        progress.line(entry.label, f"error: {error} (log: {outcome.log})")
    return state


def run_sweep(argv: Sequence[str]) -> int:
    """Run the sweep; returns the exit status (1 when a model failed)."""
    args, lm_eval_args = parse_sweep_args(argv)
    entries = args.study.entries if args.study else parse_models(args.models)
    shard = parse_shard(args.shard)
    tasks = split_top_level(args.tasks)
    out = Path(args.output_path) if args.output_path else None
    # --plan without a folder: nothing counts as done (os.devnull is no folder to read).
    plan = plan_sweep(entries, tasks, args.metric_names, out or Path(os.devnull), shard)
    to_run = [p for p in plan if not p.done]
    if args.max_models is not None:
        to_run = to_run[: args.max_models]
    if args.plan or args.max_hours is not None:
        _estimate(args, lm_eval_args, to_run, [p.entry.label for p in plan if p.done])
        if args.plan:
            return 0
    assert out is not None
    out.mkdir(parents=True, exist_ok=True)
    progress = SweepProgress(len(plan), len(to_run))
    failed = 0
    for planned in plan:
        if planned.done:
            progress.begin(planned.entry.label, "complete in the folder, skipped")
            progress.end(planned.entry.label, "complete", 0.0, ran=False)
        elif planned in to_run:
            failed += _run_one(planned, args, lm_eval_args, out, progress) == "failed"
    stopped = len(to_run) < sum(not p.done for p in plan)
    if stopped:
        print(f"lm-coupling sweep: stopped after {len(to_run)} model(s) (--max-models); "
              "rerun the same command to finish", file=sys.stderr)  # fmt: skip
    if failed:
        print(f"lm-coupling sweep: {failed} model(s) failed; see {out / records.STATUS_CSV}",
              file=sys.stderr)  # fmt: skip
    reported = True
    if not (args.no_report or args.shard or stopped):
        reported = _report(out)
    return EXIT_SOME_FAILED if failed or not reported else 0


def _estimate(args, lm_eval_args, to_run: list[PlannedModel], skipped: list[str]) -> None:
    """Print (and, with --output_path, record) the plan; refuse it when it passes --max-hours."""
    from lm_coupling.sweep import estimate

    settings = estimate.read_settings(lm_eval_args, args.metrics, args.model_args)
    tasks = split_top_level(args.tasks)
    entries = [p.entry for p in to_run]
    plan = estimate.build_plan(args.study, tasks, entries, settings, args.metrics, skipped)
    print(plan.text(), flush=True)
    if args.output_path:
        plan.write(Path(args.output_path) / PLAN_JSON)
    estimate.check_limit(plan.models, args.max_hours)


def _report(out: Path) -> bool:
    """Build the report on the folder; False (with the error printed) when it fails."""
    import traceback

    from lm_coupling.report.build import build_report
    from lm_coupling.report.cli import format_result
    from lm_coupling.report.loading import ReportInputError

    try:
        print(format_result(build_report(out)))
    except ReportInputError as exc:
        print(f"lm-coupling sweep: no report: {exc}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001  (a report bug must not hide the finished sweep)
        traceback.print_exc()
        print(
            f"lm-coupling sweep: the report failed ({type(exc).__name__}: {exc}); the results "
            f"in {out} are complete; rerun `lm-coupling report {out}`",
            file=sys.stderr,
        )
        return False
    return True
