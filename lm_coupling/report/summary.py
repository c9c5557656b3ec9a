"""Write ``summary.md``: the headline table and the primary test in words.

Every number is read back from the CSV files the report wrote, so the summary
never disagrees with the tables.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from lm_coupling.report.benchmarks import AVERAGE, SCHEMA_VERSION


def _fmt(value) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None or value is pd.NA else str(value)


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
    return (
        f"Primary test: across {int(row['n'])} models, {row['target']} score = "
        f"{row['intercept']:.4g} + {row['slope']:.4g} x {row['metric']} (OLS, R^2 = "
        f"{row['r2']:.3f}; HC3 p = {row['p_hc3']:.3g}, 95% CI of the slope "
        f"[{row['ci_low']:.4g}, {row['ci_high']:.4g}]; Holm-adjusted p = {row['p_holm']:.3g}). "
        f"Spearman rho = {row['spearman_rho']:.3f} (p = {row['spearman_p']:.3g}), Kendall tau = "
        f"{row['kendall_tau']:.3f} (p = {row['kendall_p']:.3g}); bootstrap 95% CI of the slope "
        f"over models [{row['boot_ci_low']:.4g}, {row['boot_ci_high']:.4g}]."
    )


def write_summary(
    out_dir: Path, primary_metric: str | None, figures: list[Path], notes: list[str]
) -> Path:
    """Write ``out_dir/summary.md`` from the CSVs in ``out_dir``; return its path."""
    board = pd.read_csv(out_dir / "leaderboard.csv")
    cols = [
        c
        for c in ("model", "revision", "dtype", AVERAGE, primary_metric)
        if c and c in board.columns
    ]
    parts = [
        f"# lm-coupling report\n\nSchema: `{SCHEMA_VERSION}`; {len(board)} model rows.",
        "## Leaderboard (headline)\n\n" + markdown_table(board[cols]),
    ]
    corr_path = out_dir / "correlations.csv"
    if corr_path.exists():
        parts.append(
            "## Primary test\n\n"
            + primary_sentence(pd.read_csv(corr_path, keep_default_na=True).fillna({"reason": ""}))
        )
    if notes:
        parts.append("## Notes\n\n" + "\n".join(f"- {n}" for n in notes))
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
