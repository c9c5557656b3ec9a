"""Write ``summary.md``: the headline table and the primary test in words.

Every number is read back from the CSV files the report wrote, so the summary
never disagrees with the tables.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from lm_coupling.report.benchmarks import SCHEMA_VERSION
from lm_coupling.report.row_settings import ROW_SETTING_COLUMNS
from lm_coupling.report.stats import MIN_MODELS


def _fmt(value) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    text = "" if value is None or value is pd.NA else str(value)
    return text.replace("|", "\\|")  # a pipe in a cell would end it


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table of ``frame`` (no extra dependency)."""
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_fmt(v) for v in row) + " |")
    return "\n".join(lines)


def primary_sentence(correlations: pd.DataFrame) -> str:
    """The primary test in words, from a ``correlations.csv`` table."""
    rows = correlations[correlations["primary"].astype(str).str.lower() == "true"]
    if rows.empty:
        return "No primary test: the primary metric was not measured."
    row = rows.iloc[0]
    if isinstance(row["reason"], str) and row["reason"]:
        return f"Primary test ({row['metric']} vs {row['target']}) skipped: {row['reason']}."
    flag = ""
    if str(row.get("influential")).lower() == "true":
        flag = (
            f" Influence: {row['cooks_d_model']} has Cook's distance {row['cooks_d_max']:.3g} "
            f"(> 1); without it R^2 = {row['r2_without']:.3f}: read the rank statistics."
        )
    return (
        f"Primary test: across {int(row['n'])} independent models, {row['target']} score = "
        f"{row['intercept']:.4g} + {row['slope']:.4g} x {row['metric']} (OLS, R^2 = "
        f"{row['r2']:.3f}; HC3 p = {row['p_hc3']:.3g}, 95% CI of the slope "
        f"[{row['ci_low']:.4g}, {row['ci_high']:.4g}]; Holm-adjusted p = {row['p_holm']:.3g}). "
        f"Spearman rho = {row['spearman_rho']:.3f} (p = {row['spearman_p']:.3g}), Kendall tau = "
        f"{row['kendall_tau']:.3f} (p = {row['kendall_p']:.3g}); bootstrap 95% CI of the slope "
        f"over models [{row['boot_ci_low']:.4g}, {row['boot_ci_high']:.4g}]." + flag
    )


def settings_markdown(board: pd.DataFrame) -> str:
    """What each row was measured with: shots and limit per task, metric options, mixing."""
    columns = [c for c in ("model", "revision", "dtype", *ROW_SETTING_COLUMNS) if c in board]
    if len(columns) <= 3:
        return ""
    table = board[columns].astype(object).where(board[columns].notna(), "")
    headings = ("shots and limit per task", "--limit tasks", "metric options", "combines")
    table = table.rename(columns=dict(zip(ROW_SETTING_COLUMNS, headings, strict=True)))
    return (
        "Each row's values come from runs in one setting per task (the newest run's "
        "shots and `--limit`); the Open LLM v1 columns and `average` only from runs in "
        "that setting (ARC 25-shot, HellaSwag 10, MMLU 5, TruthfulQA 0, WinoGrande 5, "
        "GSM8K 5). `combines` names what a row mixes (also printed as a warning).\n\n"
        + markdown_table(table)
    )


def write_summary(
    out_dir: Path,
    primary_metric: str | None,
    figures: list[Path],
    notes: list[str],
    primary_target: str | None,
    timings: str,
    independent: int,
    checkpoints: list[str],
) -> Path:
    """Write ``out_dir/summary.md`` from the CSVs in ``out_dir``; return its path.

    Sections: warnings (notes starting ``WARNING``), the headline table, each
    row's settings, the primary test, the checkpoint series (``checkpoints``),
    the ``timings`` section, the other notes and links to every table and figure.
    ``independent``: the number of independent models.
    """
    board = pd.read_csv(out_dir / "leaderboard.csv")
    wanted = ("model", "revision", "dtype", primary_target, primary_metric)
    cols = [c for c in dict.fromkeys(wanted) if c and c in board.columns]
    parts = [
        f"# lm-coupling report\n\nSchema: `{SCHEMA_VERSION}`; {len(board)} model rows, "
        f"n = {independent} independent model{'' if independent == 1 else 's'} (a checkpoint "
        "series counts once). "
        f"A fit, p-value or Holm adjustment is reported only for pairs measured on at "
        f"least {MIN_MODELS} independent models; rows below that say why in `reason`."
    ]
    warned = [n for n in notes if n.startswith("WARNING")]
    if warned:
        parts.append("## Warnings\n\n" + "\n".join(f"- {n}" for n in warned))
    parts.append("## Leaderboard (headline)\n\n" + markdown_table(board[cols]))
    settings = settings_markdown(board)
    if settings:
        parts.append("## What each row was measured with\n\n" + settings)
    corr_path = out_dir / "correlations.csv"
    if corr_path.exists():
        parts.append(
            "## Primary test\n\n"
            + primary_sentence(pd.read_csv(corr_path, keep_default_na=True).fillna({"reason": ""}))
        )
    if checkpoints:
        parts.append("## Checkpoints\n\n" + "\n".join(f"- {c}" for c in checkpoints))
    if timings:
        parts.append("## Time spent on geometry\n\n" + timings)
    others = [n for n in notes if not n.startswith("WARNING")]
    if others:
        parts.append("## Notes\n\n" + "\n".join(f"- {n}" for n in others))
    tables = sorted(p.name for p in out_dir.glob("*.csv"))
    parts.append("## Tables\n\n" + "\n".join(f"- [{t}]({t})" for t in tables))
    if figures:
        links = [
            f"- [{p.relative_to(out_dir)}]({p.relative_to(out_dir).as_posix()})" for p in figures
        ]
        parts.append("## Figures\n\n" + "\n".join(links))
    path = out_dir / "summary.md"
    path.write_text("\n\n".join(parts) + "\n")
    return path
