"""Session fixture: three real lm_eval runs of tiny models (see make_results.py)."""

from __future__ import annotations

import pytest
from fixtures.shared import shared_value
from make_results import run_lm_eval


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory):
    """Folders of three real lm_eval runs (results JSON + samples JSONL, no geometry).

    Launched once per test run, also under pytest-xdist (`shared_value`).
    """
    return shared_value(tmp_path_factory, "lm_eval_runs", run_lm_eval)
