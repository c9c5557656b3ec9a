"""The interpreter start-up hook behind the literal ``lm_eval ... --metrics``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness_cli import (
    REPO_PTH,
    STARTUP_PTH,
    installed_startup_pth,
    offline_env,
    require_startup_hook,
)

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
        (["/venv/bin/lm_eval", "--metric_args", "k=3"], [PY, "/venv/bin/lm_eval"], True),
        (["/venv/bin/lm_eval", "--metrics_file", "m"], [PY, "/venv/bin/lm_eval"], False),
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
    "import sys; print(sorted(m for m in ('torch', 'lm_coupling', 'lm_eval') if m in sys.modules))"
)


@pytest.mark.parametrize("extra", [[], ["--metrics", "all"], ["--metrics_file", "x"]])
def test_startup_of_other_programs_never_imports_lm_eval(extra):
    """The installed hook: another program with ``--metrics`` imports nothing of ours."""
    require_startup_hook()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *extra],
        capture_output=True, text=True, env=offline_env(), timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "[]"


# -- the repository's .pth line, processed by `site` exactly as at start-up ---------------------

WATCHED = ("lm_coupling", "lm_coupling.harness.startup", "torch", "lm_eval")
SCRIPT = """import json, site, sys
sys.path.append({venv_site!r})  # dependencies importable; no .pth file of theirs runs
before = set(sys.modules)
site.addsitedir({hook_site!r})  # runs the .pth line the way interpreter start-up does
hooked = any(type(f).__name__ == "_PatchAfterImport" for f in sys.meta_path)
print(json.dumps({{"new": sorted(set(sys.modules) - before), "hooked": hooked}}))
"""


@pytest.fixture(scope="module")
def pth_programs(tmp_path_factory):
    """A site folder holding the repository's .pth, and programs that process it.

    ``python -m lm_eval`` runs a stand-in ``lm_eval`` package (found first on
    the path) whose ``__main__`` processes the .pth.
    """
    root = tmp_path_factory.mktemp("pth")
    hook_site = root / "site"
    hook_site.mkdir()
    (hook_site / STARTUP_PTH).write_text(REPO_PTH.read_text())
    venv_site = next(p for p in map(str, sys.path) if p.endswith("site-packages"))
    programs = {}
    for name in ("lm_eval", "other.py"):
        path = root / name
        path.write_text(programs_script(venv_site, hook_site))
        programs[name] = [str(path)]
    package = root / "fake" / "lm_eval"
    package.mkdir(parents=True)
    (package / "__main__.py").write_text(programs_script(venv_site, hook_site))
    programs["-m lm_eval"] = ["-m", "lm_eval"]
    programs["-m other"] = ["-m", "other_module"]
    (root / "fake" / "other_module.py").write_text(programs_script(venv_site, hook_site))
    programs["path"] = str(root / "fake")
    return programs


def programs_script(venv_site: str, hook_site: Path) -> str:
    return SCRIPT.format(venv_site=venv_site, hook_site=str(hook_site))


def _start(programs, name, args, disable: bool = False) -> dict:
    env = offline_env()
    env["PYTHONPATH"] = os.pathsep.join([programs["path"], env.get("PYTHONPATH", "")])
    if disable:
        env[DISABLE_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-S", *programs[name], *args],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_repository_hook_is_one_import_line():
    lines = [line for line in REPO_PTH.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("import ")


@pytest.mark.parametrize(
    ("program", "args", "disable", "hooked"),
    [
        ("lm_eval", ["run", "--metrics", "all"], False, True),
        ("lm_eval", ["--metrics=lss"], False, True),
        ("lm_eval", ["--metric_args", "k=3"], False, True),
        ("lm_eval", ["--metrics", "all"], True, False),
        ("lm_eval", ["--metrics_file", "m.json"], False, False),
        ("lm_eval", ["--tasks", "arc"], False, False),
        ("other.py", ["--metrics", "all"], False, False),
        ("other.py", ["--metrics=all"], False, False),
        ("-m lm_eval", ["run", "--metrics", "all"], False, True),
        ("-m lm_eval", ["--metrics_file", "m.json"], False, False),
        ("-m other", ["--metrics", "all"], False, False),
    ],
)
def test_repository_hook_decides_from_argv(pth_programs, program, args, disable, hooked):
    started = _start(pth_programs, program, args, disable)
    assert started["hooked"] is hooked
    assert "torch" not in started["new"] and "lm_eval" not in started["new"]
    if hooked:
        assert "lm_coupling.harness.startup" in started["new"]
    else:
        assert started["new"] == []  # exactly as without the package


def test_lm_eval_is_patched_only_when_it_runs(pth_programs):
    """The hook imports lm_coupling's start-up module alone: no torch, no lm-eval yet."""
    started = _start(pth_programs, "lm_eval", ["--metrics", "all"])
    ours = [m for m in started["new"] if m.startswith("lm_coupling")]
    assert set(ours) == {
        "lm_coupling",
        "lm_coupling.errors",  # exported by the package: plain classes
        "lm_coupling.harness",
        "lm_coupling.harness.startup",
    }


def test_report_imports_no_torch():
    code = "import lm_coupling.report, sys; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=offline_env(),
        timeout=300, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "False"


def test_report_command_imports_no_torch(tmp_path):
    """``lm-coupling report`` through the package's own CLI dispatch, on an empty folder."""
    folder = tmp_path / "results"
    folder.mkdir()
    code = (
        "import sys\nfrom lm_coupling.cli import main\n"
        f"try:\n    main(['report', {str(folder)!r}])\nexcept SystemExit as exc:\n"
        "    print('exit', exc.code)\n"
        "print('lm_coupling.report.build' in sys.modules, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=offline_env(),
        timeout=300, check=True,
    )  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "True False", done.stdout + done.stderr
