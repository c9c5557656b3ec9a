"""``lm-coupling demo --where``: the bundled model and task data folders, printed without torch."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lm_coupling.demo.assets import bundled_model_path, bundled_tasks_data_path
from lm_coupling.demo.run import DATA_VARIABLE, MODEL_VARIABLE
from lm_coupling.tasks.offline_data import DATA_DIR_ENV


def _where(extra_code: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        "from lm_coupling.cli import main\n"
        "try:\n"
        "    main(['demo', '--where'])\n"
        "finally:\n"
        f"    {extra_code or 'pass'}\n"
    )
    # The same lm_coupling as this process: the installed one (not a checkout on the path).
    package_root = str(Path(bundled_model_path()).parents[3])
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd or package_root,
        env={**os.environ, "PYTHONPATH": package_root},
    )


def test_where_prints_the_bundled_folders_as_shell_lines():
    out = _where().stdout.splitlines()
    assert len(out) == 2
    parsed = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in out)
    assert Path(parsed[MODEL_VARIABLE]) == bundled_model_path()
    assert Path(parsed[DATA_VARIABLE]) == bundled_tasks_data_path()
    assert (Path(parsed[MODEL_VARIABLE]) / "config.json").is_file()
    assert (Path(parsed[DATA_VARIABLE]) / "arc_easy").is_dir()


def test_where_names_the_variable_the_offline_tasks_read():
    assert DATA_VARIABLE == DATA_DIR_ENV


def test_where_imports_neither_torch_nor_lm_eval():
    report = "print('loaded:', 'torch' in sys.modules, 'lm_eval' in sys.modules)"
    assert _where(report).stdout.splitlines()[-1] == "loaded: False False"


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_demo_threads_must_be_a_whole_number_of_at_least_one(value, capsys):
    from lm_coupling.cli import build_parser

    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["demo", "--threads", value])
    assert caught.value.code == 2
    assert "give a whole number of threads, 1 or more" in capsys.readouterr().err
    assert build_parser().parse_args(["demo", "--threads", "3"]).threads == 3
