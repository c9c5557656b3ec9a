"""Session fixture: three real lm_eval runs of tiny models (see make_results.py)."""

from __future__ import annotations

import pytest
from fixtures.shared import shared_value
from make_results import run_lm_eval, run_settings_runs


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory):
    """Folders of three real lm_eval runs (results JSON + samples JSONL, no geometry).

    Launched once per test run, also under pytest-xdist (`shared_value`).
    """
    return shared_value(tmp_path_factory, "lm_eval_runs", run_lm_eval)


@pytest.fixture(scope="session")
def settings_runs(real_runs, tmp_path_factory):
    """Real runs of one model in two settings, and one whose K was capped (see make_results)."""
    real_root = real_runs[0].parents[1]
    return shared_value(
        tmp_path_factory, "settings_runs", lambda folder: run_settings_runs(folder, real_root)
    )
