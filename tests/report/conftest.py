"""Session fixture: three real lm_eval runs of tiny models (see make_results.py)."""

from __future__ import annotations

import pytest
from make_results import run_lm_eval


@pytest.fixture(scope="session")
def real_runs(tmp_path_factory):
    """Folders of three real lm_eval runs (results JSON + samples JSONL, no geometry)."""
    return run_lm_eval(tmp_path_factory.mktemp("lm_eval_runs"))
