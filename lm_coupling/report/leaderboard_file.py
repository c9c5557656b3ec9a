"""The leaderboard written after each run: ``<folder>/leaderboard.csv``, rebuilt whole.

The report's ``leaderboard.csv`` without statistics or figures (pandas only).
"""

from __future__ import annotations

from pathlib import Path

from lm_coupling.report.leaderboard import (
    benchmark_scores,
    build_leaderboard,
    settings_messages,
)
from lm_coupling.report.loading import load_results
from lm_coupling.report.newest import newest_values

__all__ = ["write_leaderboard"]


def write_leaderboard(results_dir: str | Path) -> Path:
    """Write ``results_dir/leaderboard.csv`` from every run in the folder; returns its path.

    Raises:
        ReportInputError: the folder does not exist or holds no readable results file.
    """
    root = Path(results_dir)
    loaded = load_results(root)
    selected, provenance = newest_values(loaded.values, loaded.paths)
    board, _ = build_leaderboard(selected, benchmark_scores(selected), loaded)
    settings_messages(board, provenance, selected)
    path = root / "leaderboard.csv"
    board.to_csv(path, index=False)
    return path
