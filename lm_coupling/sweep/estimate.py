"""The sweep's ``--plan``: documents, coupled documents and estimated time per model.

Per model, over the tasks of the study (``study.TaskCost``), with ``--limit``
applied per leaf task:

- documents ``N = sum_task leaves * min(limit, documents / leaves)``;
- coupled documents ``C = sum_task leaves * min(S, documents per leaf)``, with S
  the sample size of the selected sampled (Jacobian) metrics, read from
  ``--metric_args`` or the option's default as their plugin declares it
  (``coupling_docs``, default 25, for the built-in coupling); 0 when no sampled
  metric is selected;
- time ``= startup + sum_task N_task (requests * tokens * f + gen_tokens * g)
  + C * L * j``, with f and g the forward seconds per token and per generated
  token and j one layer's Jacobian seconds from the calibration on the device
  (`lm_coupling.sweep.calibrate`), and startup the measured seconds of a whole
  one-document run of a tiny model (what each model's process pays once).

The estimate leaves out model loading and downloads; docs/sweep.md states the
factor within which it matched a measured sweep.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_coupling.errors import ConfigurationError
from lm_coupling.plugins.specs import DEFAULT_SAMPLE_OPTION
from lm_coupling.sweep import calibrate
from lm_coupling.sweep.spec import ModelEntry
from lm_coupling.sweep.study import Study, TaskCost


@dataclass(frozen=True)
class RunSettings:
    """The per-model run settings the plan reads from the sweep's arguments."""

    device: str
    batch: int
    limit: float | None
    coupling_docs: int | None  # the sample size S; None: all documents
    coupled: bool
    k: float
    dtype: str
    sample_option: str = DEFAULT_SAMPLE_OPTION  # the option S was read from


def parse_run_args(lm_eval_args: Sequence[str], model_args: str | None = None):
    """``lm_eval run``'s parse of a model run's arguments (lm-coupling's flags included).

    Raises:
        ConfigurationError: arguments ``lm_eval run`` refuses (argparse has printed why).
    """
    from lm_coupling.harness.cli import run_parser

    argv = ["run", *lm_eval_args, *(["--model_args", model_args] if model_args else [])]
    try:
        return run_parser().parse_args(argv)
    except SystemExit as exc:
        raise ConfigurationError(
            "lm_eval run does not accept the sweep's lm-eval arguments "
            f"{' '.join(lm_eval_args)!r} (see the message above)"
        ) from exc


def sample_settings(metrics: str | None, metric_args: str | None) -> tuple[str, Any, Any, bool]:
    """The sample the Jacobian work is paid on, from the plugins' declarations.

    The selected sampled metrics (`MetricSpec.sampled`; with none selected,
    every installed one, to show the size a run with them would take), the
    option sizing the first one's sample, its value (None: all documents) and
    the first K (`MetricSpec.k_option`) among them, parsed as the run parses
    them (presets expanded, defaults filled in).

    Returns:
        ``(sample option, sample size, K, whether a sampled metric is selected)``.

    Raises:
        ConfigurationError: ``--metrics`` or ``--metric_args`` the run would refuse.
    """
    from lm_coupling.plugins.manager import get_registry
    from lm_coupling.selection import make_selection, parse_metric_args

    registry = get_registry()
    try:
        chosen = make_selection(metrics or "", metric_args) if metrics else None
        selected = [s for s in (chosen.specs.values() if chosen else ()) if s.sampled]
        specs = selected or [s for s in registry.metrics.values() if s.sampled]
        options = parse_metric_args(None, {s.name: s for s in specs}, registry)
        options.update(chosen.options if chosen else {})
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"--metric_args: cannot plan with {metric_args} ({exc}); give the options as "
            "the run takes them (`lm-coupling metrics` lists them)"
        ) from None
    option = specs[0].sample_option if specs else DEFAULT_SAMPLE_OPTION
    k_option = next((s.k_option for s in specs if s.k_option), None)
    return option, options.get(option), options.get(k_option, 0), bool(selected)


def read_settings(lm_eval_args: Sequence[str], metrics: str | None, model_args: str | None):
    """The plan's settings from the model runs' arguments (``--device``, ``--limit``, ...).

    ``--batch_size auto`` is calibrated at batch 1 (an overestimate where auto
    finds a larger batch); a CPU run is calibrated in float32 whatever ``dtype=``.

    Raises:
        ConfigurationError: options the run would refuse (`sample_settings`), or
            a device this machine does not have (`check_device`).
    """
    import torch

    from lm_coupling.harness.run_options import effective_options

    namespace = parse_run_args(lm_eval_args, model_args)
    options = effective_options(namespace)  # the --config YAML read too
    default_device = "cuda" if torch.cuda.is_available() else "cpu"  # lm-eval's hf default
    device = str(options.get("device") or default_device)
    check_device(device)
    batch_text = str(options.get("batch_size", 1))
    batch = int(batch_text) if batch_text.isdigit() else 1
    limit = float(options["limit"]) if "limit" in options else None
    option, size, k, coupled = sample_settings(metrics, namespace.metric_args)
    dtype = str(options["model_args"].get("dtype", "float32"))
    if dtype in ("auto", "float16", "bfloat16") and device == "cpu":
        dtype = "float32"
    return RunSettings(device, batch, limit, size, coupled, k, dtype, option)


def check_device(device: str) -> None:
    """Refuse a device the plan cannot time on here (before anything is built).

    Raises:
        ConfigurationError: a CUDA or MPS device this machine does not have.
    """
    import torch

    kind, _, index = device.partition(":")
    counts = {
        "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "mps": int(torch.backends.mps.is_available()),
    }
    count = counts.get(kind)
    if count is not None and (count == 0 or index.isdigit() and int(index) >= count):
        raise ConfigurationError(
            f"--device {device}: this machine has {count} {kind} device(s) (torch "
            f"{torch.__version__}), and --plan times the models' shapes on the device it "
            "plans for. Plan on the machine that will run the sweep, or plan for this one "
            f"with --device cpu{f' or {kind}:0' if count else ''}"
        )


def documents(cost: TaskCost, limit: float | None) -> int:
    """Documents run of one task under ``--limit`` (per leaf task, as lm-eval applies it)."""
    per_leaf = cost.documents / cost.leaves
    if limit is None:
        return cost.documents
    if limit < 1:
        return cost.leaves * math.ceil(limit * per_leaf)
    return int(cost.leaves * min(limit, per_leaf))


def coupled(cost: TaskCost, run_documents: int, sample_size: int | None) -> int:
    """Documents of one task that get the Jacobian metrics: ``sample_size`` per leaf."""
    if sample_size is None:
        return run_documents
    per_leaf = run_documents / cost.leaves
    smallest = min(per_leaf, cost.smallest_leaf or per_leaf)
    return int(cost.leaves * min(sample_size, smallest))


@dataclass(frozen=True)
class ModelPlan:
    """One model's row of the plan."""

    entry: ModelEntry
    shape: calibrate.Shape
    documents: int
    coupled: int
    forward_s: float
    jacobian_s: float
    startup_s: float

    @property
    def seconds(self) -> float:
        """Estimated seconds of the model's run."""
        return self.startup_s + self.forward_s + self.jacobian_s


def model_plan(
    entry: ModelEntry,
    shape: calibrate.Shape,
    calibration: calibrate.Calibration,
    study: Study,
    settings: RunSettings,
    startup: float,
    tasks: Sequence[str] | None = None,
) -> ModelPlan:
    """Documents, coupled documents and estimated seconds of one model (module docstring).

    ``tasks``: the tasks run (default: the study's).
    """
    n_docs = n_coupled = 0
    forward = 0.0
    for task in tasks or study.tasks.split(","):
        cost = study.task_costs[task]
        n = documents(cost, settings.limit)
        n_docs += n
        n_coupled += coupled(cost, n, settings.coupling_docs) if settings.coupled else 0
        per_doc = cost.requests * cost.tokens * calibration.forward_per_token
        forward += n * (per_doc + cost.gen_tokens * calibration.decode_per_token)
    jacobian = n_coupled * shape.n_layers * calibration.jacobian_per_layer
    return ModelPlan(entry, shape, n_docs, n_coupled, forward, jacobian, startup)


def _hms(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class SweepPlan:
    """The plan of a sweep: its settings, the calibrations and one `ModelPlan` per model."""

    study: Study
    tasks: Sequence[str]
    settings: RunSettings
    startup: float
    calibrations: dict[tuple, calibrate.Calibration]
    models: list[ModelPlan]
    skipped: Sequence[str] = ()

    @property
    def seconds(self) -> float:
        """Estimated seconds of every model's run."""
        return sum(p.seconds for p in self.models)

    def text(self) -> str:
        """The plan as printed by ``--plan``."""
        settings = self.settings
        sample = "all" if settings.coupling_docs is None else settings.coupling_docs
        lines = [
            f"lm-coupling sweep --plan: study {self.study.name} ({self.study.path})",
            f"  tasks {','.join(self.tasks)}; device {settings.device}, batch {settings.batch}, "
            f"limit {settings.limit if settings.limit is not None else 'none'}, "
            f"{settings.sample_option} {sample}"
            + ("" if settings.coupled else " (no sampled metric selected: none coupled)"),
            f"  calibration on {settings.device}: startup of a model's process "
            f"{self.startup:.1f} s (a whole one-document run of a tiny model, timed in a "
            "fresh process)",
        ]
        for key, cal in self.calibrations.items():
            lines.append(
                f"    shape {key[0]} L={key[1]} d={key[2]} heads={key[3]} vocab={key[4]} "
                f"d_ff={key[5]}: forward {cal.forward_per_token * 1e3:.4g} ms/token, decode "
                f"{cal.decode_per_token * 1e3:.4g} ms/token, one layer's Jacobian "
                f"{cal.jacobian_per_layer:.4g} s (K={cal.k}, {cal.tokens} tokens, batch "
                f"{cal.batch}; {cal.layers_built})"
            )
        lines.append(
            f"  {'model':<48} {'shape from':<11} {'L':>3} {'d':>5} {'documents':>9} "
            f"{'coupled':>7} {'forward':>9} {'Jacobians':>9} {'total':>9}"
        )
        for plan in self.models:
            lines.append(
                f"  {plan.entry.label[-48:]:<48} {plan.shape.source:<11} "
                f"{plan.shape.n_layers:>3} {plan.shape.d_model:>5} {plan.documents:>9} "
                f"{plan.coupled:>7} {_hms(plan.forward_s):>9} {_hms(plan.jacobian_s):>9} "
                f"{_hms(plan.seconds):>9}"
            )
        if any(p.shape.source == "study file" for p in self.models):
            lines.append(
                "  shape from 'study file': no config could be read here (offline or not "
                "cached); the shape recorded in the study was calibrated instead"
            )
        lines += [f"  {label}: complete in the folder, not planned" for label in self.skipped]
        lines += [f"  left out: {x.get('model')}: {x.get('reason')}" for x in self.study.excluded]
        lines.append(
            f"  total: {len(self.models)} model(s), {sum(p.documents for p in self.models)} "
            f"documents, {sum(p.coupled for p in self.models)} coupled, "
            f"{self.seconds / 3600:.3g} device-hours on {settings.device} "
            f"({_hms(self.seconds)}; model downloads and loading not included)"
        )
        return "\n".join(lines)

    def write(self, path: Path) -> Path:
        """Record the plan as JSON (``sweep_plan.json`` of the results folder), beside the run."""
        data = {
            "study": self.study.name,
            "study_file": str(self.study.path),
            "settings": dataclasses.asdict(self.settings),
            "startup_s": self.startup,
            "calibrations": [
                {"shape": list(key), **dataclasses.asdict(cal)}
                for key, cal in self.calibrations.items()
            ],
            "models": [
                {
                    "model": p.entry.name,
                    "revision": p.entry.revision or "",
                    "shape_from": p.shape.source,
                    "documents": p.documents,
                    "coupled": p.coupled,
                    "forward_s": p.forward_s,
                    "jacobian_s": p.jacobian_s,
                    "estimated_s": p.seconds,
                }
                for p in self.models
            ],
            "total_s": self.seconds,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path


def build_plan(
    study: Study,
    tasks: Sequence[str],
    entries: Sequence[ModelEntry],
    settings: RunSettings,
    metrics: str | None,
    skipped: Sequence[str] = (),
) -> SweepPlan:
    """Calibrate each distinct shape once and plan every entry.

    Raises:
        ConfigurationError: a task the study has no ``task_costs`` for, or a model
            with neither a readable config nor a recorded shape.
    """
    unknown = [task for task in tasks if task not in study.task_costs]
    if unknown:
        raise ConfigurationError(
            f"--plan: the study {study.name} gives no task_costs for {', '.join(unknown)}; "
            "plan the study's own tasks, or add their documents to a study file of your own"
        )
    tokens = max(1, round(max(study.task_costs[t].tokens for t in tasks)))
    startup, measured = calibrate.cached_startup_seconds(metrics)
    print(
        f"lm-coupling sweep --plan: startup of a model's process {startup:.1f} s "
        + ("measured now" if measured else "as measured before")
        + f" (kept in {calibrate.startup_cache_path()}; delete it to measure again)",
        file=sys.stderr,
    )
    calibrations: dict[tuple, calibrate.Calibration] = {}
    plans = []
    for entry in entries:
        try:
            shape = calibrate.shape_of(entry, study.shape_of(entry))
        except ValueError as exc:
            raise ConfigurationError(f"--plan: {exc}; add its shape to the study") from exc
        if shape.key not in calibrations:
            print(f"lm-coupling sweep --plan: calibrating {entry.label} ...", file=sys.stderr)
            calibrations[shape.key] = calibrate.calibrate(
                shape, settings.device, tokens, settings.batch, settings.k, settings.dtype
            )
        calibration = calibrations[shape.key]
        plans.append(model_plan(entry, shape, calibration, study, settings, startup, tasks))
    return SweepPlan(study, tasks, settings, startup, calibrations, plans, skipped)


def check_limit(plans: Sequence[ModelPlan], max_hours: float | None) -> None:
    """Refuse a sweep whose estimate passes ``--max-hours``.

    Raises:
        ConfigurationError: the total estimate is above ``max_hours``.
    """
    total = sum(p.seconds for p in plans) / 3600
    if max_hours is not None and total > max_hours:
        raise ConfigurationError(
            f"the sweep's estimate is {total:.3g} device-hours, above --max-hours {max_hours:g}: "
            "nothing was run; lower --limit or the sample size, choose fewer models (--shard, "
            "--max-models), or raise --max-hours"
        )
