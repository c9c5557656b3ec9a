"""Report step: lm-eval results folders -> leaderboard CSVs, statistics, figures, summary.

Never imports torch. Entry point: `build_report`; command line: `lm_coupling.report.cli`.
`write_leaderboard` (the refresh after each run) needs pandas only: `build_report`
and its statistics (statsmodels, scipy, matplotlib) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lm_coupling.report.benchmarks import SCHEMA_VERSION
from lm_coupling.report.leaderboard import write_leaderboard
from lm_coupling.report.loading import ReportInputError, ReportWarning, SettingsWarning

if TYPE_CHECKING:
    from lm_coupling.report.build import ReportResult, build_report

__all__ = [
    "SCHEMA_VERSION",
    "ReportInputError",
    "ReportResult",
    "ReportWarning",
    "SettingsWarning",
    "build_report",
    "write_leaderboard",
]


def __getattr__(name: str) -> Any:
    """``build_report`` and ``ReportResult``, imported on first use (PEP 562)."""
    if name in ("build_report", "ReportResult"):
        from lm_coupling.report import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
