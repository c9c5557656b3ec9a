"""``python bench/report_campaign.py`` runs to its end in its default mode.

The bench's default mode (the report, then the leaderboard refresh: first,
with nothing changed, after one more run) is the command docs/benchmarks.md
gives for the 15 s target; the test runs it as a user would (a subprocess in
the checkout) on a small campaign cloned from the session's real lm_eval
runs, and checks what it leaves behind, never the timings themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def test_default_mode_times_report_and_refreshes_and_leaves_the_folder_as_built(
    real_runs, tmp_path
):
    work = tmp_path / "campaign"
    work.mkdir()
    (work / "real").symlink_to(real_runs[0].parents[1])  # the bench reuses a kept real run
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "bench/report_campaign.py", "--models", "4", "--tasks", "2",
         "--keep", str(work)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only: about a minute on a quiet 2-core machine
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for label in (
        "report, default figure formats",
        "leaderboard refresh, first",
        "leaderboard refresh, nothing changed",
        "leaderboard refresh after one more run",
    ):
        assert f"  {label}: wall " in proc.stdout, proc.stdout
    folder = work / "results"
    assert not (folder / "m999__main").exists()  # the one more run was taken away again
    leaderboard = pd.read_csv(folder / "leaderboard.csv")
    # Refreshed once more after the extra run was removed: the four models, not five.
    assert len(leaderboard) == 4
    assert not leaderboard.astype(str).apply(lambda c: c.str.endswith("-next")).any().any()
    assert (work / "report" / "summary.md").is_file()
