"""Session fixture: three real lm_eval runs of tiny models (see make_results.py)."""

from __future__ import annotations

import pytest
from make_results import run_lm_eval, run_settings_runs


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory):
    """Folders of three real lm_eval runs (results JSON + samples JSONL, no geometry)."""
    return run_lm_eval(tmp_path_factory.mktemp("lm_eval_runs"))


@pytest.fixture(scope="session")
def settings_runs(real_runs, tmp_path_factory):
    """Real runs of one model in two settings, and one whose K was capped (see make_results)."""
    real_root = real_runs[0].parents[1]
    return run_settings_runs(tmp_path_factory.mktemp("settings_runs"), real_root)
