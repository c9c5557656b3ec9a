"""Figure formats of the report: PNG alone by default, others on request, unknown ones refused.

(The folder index and the leaderboard refresh are tested in `test_refresh.py`.)
"""

from __future__ import annotations

import pytest

from lm_coupling.report.build import check_figure_formats
from lm_coupling.report.loading import ReportInputError


def test_figure_formats_default_to_png_and_refuse_unknown():
    assert check_figure_formats("png") == ("png",)
    assert check_figure_formats("PNG, svg,png") == ("png", "svg")
    with pytest.raises(ReportInputError, match="jpeg"):
        check_figure_formats("png,jpeg")
    with pytest.raises(ReportInputError):
        check_figure_formats("")
