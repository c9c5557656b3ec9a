"""What the report says about its input: the error that stops it and the warnings it gives.

Apart from `lm_coupling.report.loading`, so that every report module can
warn without importing the loader.
"""

from __future__ import annotations

from lm_coupling.errors import LmCouplingError

__all__ = ["CatalogueWarning", "ReportInputError", "ReportWarning", "SettingsWarning"]


class ReportInputError(LmCouplingError, ValueError):
    """The results folder cannot be reported on (missing, or no usable results file)."""


class ReportWarning(UserWarning):
    """A file under the results folder was skipped or only partly used."""


class SettingsWarning(ReportWarning):
    """Runs of one model measured a task in different settings, or a row combines settings."""


class CatalogueWarning(ReportWarning):
    """A results file records no catalogue of metrics: the installed plugins' is used."""
