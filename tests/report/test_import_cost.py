"""The leaderboard refresh and the command-line parser import no statistics, plots or torch."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("statsmodels", "torch", "matplotlib", "scipy", "pandas")


def _loaded_after(code: str) -> list[str]:
    report = f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    probe = f"import sys, json\n{code}\n{report}"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_write_leaderboard_needs_pandas_only():
    loaded = _loaded_after("from lm_coupling.report import write_leaderboard, SettingsWarning")
    assert loaded == ["pandas"]


def test_report_parser_needs_no_tables_or_statistics():
    code = (
        "import argparse\nfrom lm_coupling.report.cli import add_report_arguments\n"
        "add_report_arguments(argparse.ArgumentParser())"
    )
    assert _loaded_after(code) == []


def test_build_report_is_still_importable_from_the_package():
    loaded = _loaded_after("from lm_coupling.report import build_report")
    assert "statsmodels" not in loaded  # imported by the functions that fit, on first use
