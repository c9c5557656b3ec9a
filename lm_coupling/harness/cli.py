"""The command-line shells: ``lm-coupling run`` and the literal ``lm_eval ... --metrics``.

Both parse lm-eval's own ``run`` arguments with lm-eval's own parser plus
``--metrics``/``--metric_args`` and call the library core
(`lm_coupling.harness.run.run_evaluation`); without ``--metrics`` lm-eval's
own command runs untouched. The literal ``lm_eval`` gets the flags by a patch
of its ``run`` sub-command (`patch_run_command`, applied by
`lm_coupling.harness.startup`, undone when the command ends). Errors become
exit codes here and nowhere else.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from lm_coupling.errors import LmCouplingError
from lm_coupling.selection import make_selection

GEOMETRY_FLAGS = ("metrics", "metric_args")


def add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    """Add lm-coupling's two flags to an lm-eval ``run`` parser."""
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


def run_parser() -> argparse.ArgumentParser:
    """lm-eval's own parser (a fresh instance) with the geometry flags on ``run``."""
    from lm_coupling.harness.lm_eval_adapter import run_command_parser

    return run_command_parser(add_geometry_arguments)


def execute(args: argparse.Namespace, stock: Callable[[argparse.Namespace], Any]) -> int:
    """Run parsed ``run`` arguments: stock lm-eval, or the core with geometry.

    Args:
        args: lm-eval's parsed ``run`` arguments, with ``metrics``/``metric_args``.
        stock: lm-eval's own execution of the ``run`` command.

    Returns:
        The exit code: 0; 2 after printing an lm-coupling error; 130 after Ctrl-C
        (`lm_coupling.harness.interrupt`).
    """
    metrics, metric_args = (vars(args).pop(name, None) for name in GEOMETRY_FLAGS)
    try:
        if metrics is None:
            if metric_args:  # options for metrics nobody selected: make_selection says so
                make_selection(metrics, metric_args)
            stock(args)
            return 0
        from lm_coupling.harness.run import run_evaluation
        from lm_coupling.harness.run_config import RunConfig

        run_evaluation(RunConfig.from_command_line(args, metrics, metric_args))
    except LmCouplingError as exc:
        print(f"lm-coupling: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, not a traceback
        from lm_coupling.harness.interrupt import EXIT_INTERRUPTED, interrupted_message

        print(interrupted_message(exc, getattr(args, "use_cache", None)), file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def run_command(argv: Sequence[str]) -> int:
    """``lm-coupling run ARGS``: lm-eval's ``run`` arguments plus the geometry flags."""
    args = run_parser().parse_args(["run", *argv])
    return execute(args, args.func)


def patch_run_command() -> None:
    """Teach lm-eval's ``run`` sub-command the geometry flags, its execution through `execute`."""
    from lm_coupling.harness.lm_eval_adapter import patch_run_command as patch

    patch(add_geometry_arguments, _execute_or_exit)


def _execute_or_exit(args: argparse.Namespace, stock: Callable[[argparse.Namespace], Any]) -> None:
    """`execute`, leaving the process with its exit code when that is not 0."""
    code = execute(args, stock)
    if code:
        raise SystemExit(code)
