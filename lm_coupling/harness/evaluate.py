"""`evaluate`: ``lm_eval run ... --metrics ...`` from Python.

One entry point for scripts, the demo, the benchmarks and the tests. It builds
the command line of lm-eval's ``run`` command, parses it with lm-eval's own
(patched) parser and executes the very command ``lm_eval ... --metrics``
executes, so a Python run and a shell run write the same files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from lm_coupling.selection import make_selection


def _pairs(value: str | Mapping[str, Any] | None) -> str | None:
    """``{"a": 1, "b": "x"}`` -> ``"a=1,b=x"`` (strings pass through)."""
    if value is None or isinstance(value, str):
        return value
    return ",".join(f"{key}={item}" for key, item in value.items())


def run_arguments(
    model: str = "hf",
    model_args: str | Mapping[str, Any] | None = None,
    tasks: str | Sequence[str] = "lmc_demo",
    metrics: str | Sequence[str] = "all",
    metric_args: str | Mapping[str, Any] | None = None,
    output_path: str | None = None,
    batch_size: int | str = 1,
    device: str | None = None,
    limit: int | float | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``lm_eval run`` arguments `evaluate` executes (see there)."""
    tasks = tasks if isinstance(tasks, str) else ",".join(tasks)
    metrics = metrics if isinstance(metrics, str) else ",".join(metrics)
    argv = ["--model", model, "--tasks", tasks, "--batch_size", str(batch_size)]
    argv += ["--metrics", metrics]
    optional = {
        "--model_args": _pairs(model_args),
        "--metric_args": _pairs(metric_args),
        "--output_path": output_path,
        "--device": device,
        "--limit": None if limit is None else str(limit),
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, value]
    return [*argv, *extra_args]


def evaluate(
    model: str = "hf",
    model_args: str | Mapping[str, Any] | None = None,
    tasks: str | Sequence[str] = "lmc_demo",
    metrics: str | Sequence[str] = "all",
    metric_args: str | Mapping[str, Any] | None = None,
    output_path: str | None = None,
    batch_size: int | str = 1,
    device: str | None = None,
    limit: int | float | None = None,
    extra_args: Sequence[str] = (),
) -> dict[str, Any] | None:
    """Run an lm-eval benchmark with geometry, exactly as ``lm_eval ... --metrics``.

    Example::

        results = lm_coupling.evaluate(
            model_args={"pretrained": "EleutherAI/pythia-160m"},
            tasks=["arc_easy"],
            metrics="all",
            metric_args={"coupling_docs": 25},
            batch_size="auto",
            device="cuda",
            extra_args=["--log_samples"],
        )
        results["results"]["arc_easy"]["coupling,none"]

    Args:
        model: lm-eval model type (``hf``; geometry needs a Hugging Face model).
        model_args: ``pretrained=...,dtype=...`` or a dict of them.
        tasks: lm-eval task names (comma string or list); lm-coupling's own
            tasks are on the include path.
        metrics: geometry metrics (comma string, list, or ``"all"``).
        metric_args: their options (``k=10,coupling_docs=25`` or a dict).
        output_path: where results and geometry files go (default ``results``).
        batch_size: an integer or ``"auto"``.
        device: torch device (lm-eval's default when None).
        limit: documents per task (an int) or a fraction (a float < 1).
        extra_args: further ``lm_eval run`` arguments, as on the command line
            (``["--log_samples", "--num_fewshot", "5"]``).

    Returns:
        lm-eval's results dictionary (with ``samples`` when ``--log_samples``
        is given), as written to the results file; per task its geometry
        values, and ``config.lm_coupling`` the options, capture counts and
        model shape. None on data-parallel ranks other than 0.

    Raises:
        ConfigurationError: unknown metric or option (before anything loads).
        SystemExit: lm-eval rejected its arguments, as the command line does.
    """
    names = metrics if isinstance(metrics, str) else ",".join(metrics)
    make_selection(names, _pairs(metric_args))  # fail before lm-eval loads anything
    argv = run_arguments(
        model, model_args, tasks, metrics, metric_args, output_path, batch_size, device, limit,
        extra_args,
    )  # fmt: skip
    return execute_run_command(argv)


def execute_run_command(argv: Sequence[str]) -> dict[str, Any] | None:
    """Parse ``argv`` with lm-eval's patched ``run`` parser and execute it.

    Returns:
        The results of a ``--metrics`` run (None without ``--metrics``).
    """
    from lm_coupling.harness.cli import patch_run_command

    patch_run_command()
    from lm_eval._cli.harness import HarnessCLI

    parser = HarnessCLI()._parser
    args = parser.parse_args(["run", *argv])
    return args.func(args)


def metadata_argument(metadata: Mapping[str, Any]) -> list[str]:
    """``["--metadata", json]`` for lm-eval (e.g. ``{"lmc_data_dir": path}``)."""
    return ["--metadata", json.dumps(dict(metadata))]
