"""Report step: lm-eval results folders -> leaderboard CSVs, statistics, figures, summary.

Never imports torch. Names are imported on first use (PEP 562): the command-line
parser loads neither pandas nor statsmodels, `write_leaderboard` needs pandas only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lm_coupling.report.benchmarks import SCHEMA_VERSION

if TYPE_CHECKING:
    from lm_coupling.report.build import ReportResult, build_report
    from lm_coupling.report.leaderboard_file import write_leaderboard
    from lm_coupling.report.loading import ReportInputError, ReportWarning, SettingsWarning

_HOMES = {
    "ReportInputError": "lm_coupling.report.loading",
    "ReportWarning": "lm_coupling.report.loading",
    "SettingsWarning": "lm_coupling.report.loading",
    "write_leaderboard": "lm_coupling.report.leaderboard_file",
    "build_report": "lm_coupling.report.build",
    "ReportResult": "lm_coupling.report.build",
}

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
    """The public names of `_HOMES`, imported from their module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
