"""The interpreter start-up hook behind the literal ``lm_eval ... --metrics``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness_cli import REPO_PTH, installed_startup_pth, offline_env, require_startup_hook

from lm_coupling.harness.startup import DISABLE_ENV, is_lm_eval_with_metrics

PY = "/usr/bin/python3"


@pytest.mark.parametrize(
    ("argv", "orig_argv", "expected"),
    [
        (["/venv/bin/lm_eval", "--metrics", "all"], [PY, "/venv/bin/lm_eval"], True),
        (["/venv/bin/lm-eval", "run", "--metrics=lss"], [PY, "/venv/bin/lm-eval"], True),
        (["lm_eval.exe", "--metrics", "lss"], [PY, "lm_eval.exe"], True),
        (["/x/lm_eval/__main__.py", "--metrics", "lss"], [PY, "-m", "lm_eval", "--metrics"], True),
        (["/x/__main__.py", "--metrics", "lss"], [PY, "-m", "lm_eval.__main__", "--metrics"], True),
        (["/venv/bin/lm_eval", "--tasks", "arc"], [PY, "/venv/bin/lm_eval"], False),
        (["/venv/bin/lm_eval", "--metric_args", "k=3"], [PY, "/venv/bin/lm_eval"], False),
        (["/venv/bin/pytest", "--metrics", "all"], [PY, "/venv/bin/pytest"], False),
        (["-c", "--metrics", "all"], [PY, "-c", "pass", "--metrics", "all"], False),
        (["/x/__main__.py", "--metrics", "lss"], [PY, "-m", "lm_coupling", "--metrics"], False),
        ([], [], False),
    ],
)
def test_is_lm_eval_with_metrics(argv, orig_argv, expected, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert is_lm_eval_with_metrics(argv, orig_argv) is expected


def test_disable_env_switches_the_hook_off(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    argv = ["/venv/bin/lm_eval", "--metrics", "all"]
    assert is_lm_eval_with_metrics(argv, [PY, *argv]) is False


def test_installed_hook_matches_the_repository():
    require_startup_hook()
    assert installed_startup_pth().read_text() == REPO_PTH.read_text()


PROBE = (
    "import sys, lm_coupling; "
    "print(sorted(m for m in ('lm_eval', 'lm_eval._cli.run', 'lm_coupling.harness.startup') "
    "if m in sys.modules))"
)


@pytest.mark.parametrize(
    ("extra", "imported"),
    [([], "[]"), (["--metrics", "all"], "['lm_coupling.harness.startup']")],
)
def test_startup_of_other_programs_never_imports_lm_eval(extra, imported):
    require_startup_hook()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *extra],
        capture_output=True, text=True, env=offline_env(), timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == imported
