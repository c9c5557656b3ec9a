"""``lm-coupling report`` on a folder whose only results file is corrupt (issue 27, item 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lm_coupling.cli import main

BIN = Path(sys.executable).parent


def test_only_results_file_corrupt_names_it_and_its_error(tmp_path):
    broken = tmp_path / "results" / "org__model" / "results_2024-01-01T00-00-00.json"
    broken.parent.mkdir(parents=True)
    broken.write_text('{"results": {"arc_easy": {"acc,none": 0.5}', encoding="utf-8")  # cut short
    done = subprocess.run(
        [str(BIN / "lm-coupling"), "report", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert str(broken) in done.stderr
    assert "not valid JSON" in done.stderr
    assert "run lm_eval" not in done.stderr, "a run exists: the advice to run one is wrong"
    assert not (tmp_path / "results" / "report").exists()


def test_empty_folder_still_says_how_to_make_results(tmp_path, capsys):
    """The same exit path as above (end to end there): the message checked in-process."""
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "no lm-eval results_*.json" in stderr and "--output_path" in stderr
