"""The package's shape: a library whose command lines are thin shells.

- Only the command-line entry points exit the process.
- ``import lm_coupling``, ``lm-coupling --help`` and ``lm-coupling metrics``
  import neither torch nor statsmodels.
- Every error class is importable from ``lm_coupling`` and is an ``LmCouplingError``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lm_coupling

PACKAGE = Path(lm_coupling.__file__).resolve().parent
ENTRY_POINTS = {
    "cli.py",
    "__main__.py",
    "harness/cli.py",
    "sweep/command.py",
}


def test_only_entry_points_exit_the_process():
    exits = re.compile(r"^[^#]*\b(sys\.exit|raise SystemExit|exit\()")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in ENTRY_POINTS:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if exits.search(line):
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert not offenders, "library code exits the process:\n" + "\n".join(offenders)


def _imported_modules(*argv: str) -> set[str]:
    """Top-level modules a fresh interpreter imported running ``argv`` (``-X importtime``)."""
    env = {**os.environ, "LM_COUPLING_NO_STARTUP_HOOK": "1"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize(
    "argv",
    [
        ["-c", "import lm_coupling"],
        ["-m", "lm_coupling", "--help"],
        ["-m", "lm_coupling", "metrics"],
    ],
    ids=["import", "help", "metrics"],
)
def test_light_commands_import_no_torch_nor_statsmodels(argv):
    imported = _imported_modules(*argv)
    assert "lm_coupling" in imported  # the measurement could fail
    assert not {"torch", "statsmodels", "lm_eval", "transformers"} & imported


@pytest.mark.parametrize(
    "name",
    [
        "ConfigurationError",
        "ModelNotFoundError",
        "UnsupportedModelError",
        "DataUnavailableError",
        "PluginError",
        "ConcurrentRunError",
        "JacobianMismatchError",
    ],
)
def test_errors_are_importable_from_the_package(name):
    assert issubclass(getattr(lm_coupling, name), lm_coupling.LmCouplingError)
