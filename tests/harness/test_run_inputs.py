"""A run without a task, a ``--limit`` of 0, an ``--output_path`` that is a file, an empty
data file: each an ``LmCouplingError`` naming the fix, before the model loads.

One end-to-end process test for the exit path (``lm-coupling run``: exit code 2, the
message, no file changed, no weights loaded); the other messages are checked in-process,
through the real command line (``lm_coupling.cli.main``) and ``lm_coupling.evaluate``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lm_eval.tasks import TaskManager

import lm_coupling
from lm_coupling.cli import main
from lm_coupling.errors import ConfigurationError, DataUnavailableError, LmCouplingError

TASKS_DIR = Path(lm_coupling.__file__).resolve().parent / "tasks"
BUNDLED = TASKS_DIR.parent / "demo" / "sample_tasks"
TASK = "lmc_hellaswag_offline"
NO_TASK = "no task given: name one or more with --tasks"
NO_DOCUMENT = "--limit 0 selects no document"
A_FILE = "is an existing file, not a folder"


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny GPT-2 saved to disk: a model the run would load if nothing stopped it."""
    from fixtures.tiny import save_tiny_model, train_tokenizer

    return save_tiny_model(tmp_path_factory.mktemp("model") / "gpt2", "gpt2", train_tokenizer())


def cli(saved_model, *extra: str) -> list[str]:
    return ["run", "--model", "hf", "--model_args", f"pretrained={saved_model}",
            "--metrics", "lss", *extra]  # fmt: skip


def test_an_output_path_that_is_a_file_stops_the_command_before_the_model(saved_model, tmp_path):
    """The exit path, end to end: exit code 2, one line, the file untouched, no weights read."""
    target = tmp_path / "notes.txt"
    target.write_text("keep me\n")
    command = [sys.executable, "-m", "lm_coupling",
               *cli(saved_model, "--tasks", TASK, "--output_path", str(target))]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"lm-coupling: error: --output_path {target}: {target} {A_FILE}" in done.stderr
    assert "Traceback" not in done.stderr
    assert "Loading weights" not in done.stderr + done.stdout  # refused before the model
    assert target.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing else written


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ((), NO_TASK),
        (("--tasks", ""), NO_TASK),
        (("--tasks", TASK, "--limit", "0"), NO_DOCUMENT),
        (("--tasks", TASK, "--limit", "-3"), "--limit -3 selects no document"),
    ],
    ids=["no-tasks", "empty-tasks", "limit-0", "limit-negative"],
)
def test_the_command_line_refuses_before_the_task_index(
    saved_model, tmp_path, capsys, extra, message
):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main([*cli(saved_model, *extra), "--output_path", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("lm-coupling: error: ") and message in err, err
    assert "or leave --limit out" in err or "--tasks lmc_arc_easy_offline" in err  # the fix
    assert not out.exists()


def test_a_json_output_path_under_a_file_is_refused(saved_model, tmp_path, capsys):
    """lm-eval writes ``x.json`` into its folder: that folder being a file is refused too."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        main([*cli(saved_model, "--tasks", TASK), "--output_path", str(blocker / "r.json")])
    assert f"{blocker} {A_FILE}" in capsys.readouterr().err
    assert blocker.read_text() == ""


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"tasks": []}, NO_TASK),
        ({"tasks": ""}, NO_TASK),
        ({"tasks": TASK, "limit": 0}, NO_DOCUMENT),
        ({"tasks": TASK, "limit": 0.0}, NO_DOCUMENT),
    ],
    ids=["tasks-empty-list", "tasks-empty-string", "limit-0", "limit-0.0"],
)
def test_evaluate_raises_an_lm_coupling_error_before_looking_for_the_model(keywords, message):
    # No model at this path: the input is refused first (the model would be checked next).
    with pytest.raises(ConfigurationError, match=message) as info:
        lm_coupling.evaluate(model_args="pretrained=/nonexistent/model", metrics="lss", **keywords)
    assert isinstance(info.value, LmCouplingError)


def test_evaluate_refuses_an_output_path_that_is_a_file(tmp_path):
    target = tmp_path / "results.txt"
    target.write_text("old\n")
    with pytest.raises(ConfigurationError, match=A_FILE):
        lm_coupling.evaluate(
            model_args="pretrained=/nonexistent/model", tasks=TASK, output_path=str(target)
        )
    assert target.read_text() == "old\n"


def test_an_empty_data_file_is_an_lm_coupling_error(tiny_model, tokenizer, tmp_path):
    folder = tmp_path / "hellaswag"
    folder.mkdir()
    (folder / "validation.jsonl").write_text("\n", encoding="utf-8")
    (folder / "train.jsonl").write_text(
        (BUNDLED / "hellaswag" / "train.jsonl").read_text(encoding="utf-8"), encoding="utf-8"
    )
    index = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    with pytest.raises(DataUnavailableError) as info:
        lm_coupling.evaluate(
            model=tiny_model("gpt2"), tokenizer=tokenizer, model_name="tiny", tasks=TASK,
            metrics="lss", limit=1, metadata={"lmc_data_dir": str(tmp_path)}, task_manager=index,
        )  # fmt: skip
    assert isinstance(info.value, LmCouplingError)
    assert f"{folder / 'validation.jsonl'} has no rows" in str(info.value)
