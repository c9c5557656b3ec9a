"""The ``lm-coupling report`` subcommand: arguments and runner (wired in by lm_coupling.cli)."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parser is built for `lm-coupling --help`: no statsmodels there
    from lm_coupling.report.build import ReportResult


def add_report_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the report arguments: RESULTS_DIR, --out, --scores, --primary, --seed, and options."""
    parser.add_argument(
        "results_dir",
        metavar="RESULTS_DIR",
        help="folder of lm_eval runs (its --output_path), searched recursively",
    )
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="output folder (default: RESULTS_DIR/report)"
    )
    parser.add_argument(
        "--scores",
        default=None,
        metavar="CSV",
        help="external benchmark scores: a 'model' column and benchmark "
        "columns (arc, hellaswag, mmlu, truthfulqa, winogrande, gsm8k)",
    )
    parser.add_argument(
        "--primary",
        default=None,
        metavar="METRIC",
        help="geometry metric of the primary test against the average (default: the one "
        "its plugin declares primary: coupling)",
    )
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    parser.add_argument(
        "--checkpoint",
        default="last",
        metavar="WHICH",
        help="the checkpoint a series of one model (revisions, steps) contributes to the "
        "across-model statistics: last (default; main counts as last), first, or a "
        "revision name every series has (e.g. step1000)",
    )
    parser.add_argument(
        "--figure-formats",
        default="png",
        metavar="LIST",
        help="comma list of figure formats: png, svg, pdf (default: png)",
    )
    parser.add_argument(
        "--per-model-figures",
        default="auto",
        metavar="WHICH",
        help="each model's profiles and coupling figures: auto (default: drawn when the "
        "report has at most 12 model rows), all, none",
    )
    return parser


def format_result(result: ReportResult) -> str:
    """A short human summary of a report."""
    rows, models = len(result.leaderboard), result.n_independent
    counted = f" ({models} independent model(s))" if models != rows else ""
    lines = [f"lm-coupling report: {rows} model row(s){counted} -> {result.out_dir}"]
    if result.correlations is not None:
        prim = result.correlations[result.correlations["primary"]]
        for row in prim.to_dict("records"):
            if row["reason"]:
                lines.append(f"primary {row['metric']} vs {row['target']}: {row['reason']}")
            else:
                lines.append(
                    f"primary {row['metric']} vs {row['target']}: n={int(row['n'])}, "
                    f"R^2={row['r2']:.3f}, p_hc3={row['p_hc3']:.3g}, "
                    f"p_holm={row['p_holm']:.3g}"
                )
    lines += result.notes
    lines.append(f"summary: {result.summary}")
    return "\n".join(lines)


def run_report(args: argparse.Namespace) -> int:
    """Run the report for parsed arguments; print a short summary; return the exit code 0.

    Each `ReportWarning` (a skipped file, settings that differ) is printed once
    to stderr as ``lm-coupling report: warning: ...``; other warnings pass on.
    """
    from lm_coupling.report.build import build_report
    from lm_coupling.report.loading import ReportWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReportWarning)
        result = build_report(
            args.results_dir,
            out_dir=args.out,
            scores_csv=args.scores,
            primary=args.primary,
            seed=args.seed,
            figure_formats=args.figure_formats,
            checkpoint=args.checkpoint,
            per_model_figures=args.per_model_figures,
        )
    for item in caught:
        if any(str(item.message) in note for note in result.notes):
            continue  # printed with the notes below
        if issubclass(item.category, ReportWarning):
            print(f"lm-coupling report: warning: {item.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
    print(format_result(result))
    return 0
