"""Report step: lm-eval results folders -> leaderboard CSVs, statistics, figures, summary.

Never imports torch. Entry point: `build_report`; command line: `lm_coupling.report.cli`.
"""

from lm_coupling.report.benchmarks import SCHEMA_VERSION
from lm_coupling.report.build import ReportResult, build_report
from lm_coupling.report.leaderboard import write_leaderboard
from lm_coupling.report.loading import ReportInputError, ReportWarning

__all__ = [
    "SCHEMA_VERSION",
    "ReportInputError",
    "ReportResult",
    "ReportWarning",
    "build_report",
    "write_leaderboard",
]
