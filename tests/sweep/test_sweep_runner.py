"""One model's process: its command line, its log, its error line; the sweep's time estimate."""

from __future__ import annotations

import io
import sys

from lm_coupling.sweep.progress import SweepProgress
from lm_coupling.sweep.runner import run_command, run_model
from lm_coupling.sweep.spec import ModelEntry


def test_command_passes_model_revision_and_shared_arguments(tmp_path):
    command = run_command(
        ModelEntry("org/m", "step8"), ["a", "b"], tmp_path, "dtype=bfloat16,parallelize=True",
        ["--limit", "2", "--metrics", "coupling"],
    )  # fmt: skip
    assert command[1:4] == ["-m", "lm_coupling", "run"]
    args = dict(zip(command[4::2], command[5::2], strict=False))
    assert args["--model_args"] == "pretrained=org/m,revision=step8,dtype=bfloat16,parallelize=True"
    assert args["--tasks"] == "a,b" and args["--output_path"] == str(tmp_path)
    assert command[-4:] == ["--limit", "2", "--metrics", "coupling"]
    local = run_command(ModelEntry("/runs/tiny/step0"), ["a"], tmp_path, None, [])
    assert local[local.index("--model_args") + 1] == "pretrained=/runs/tiny/step0"


def test_a_failing_process_is_logged_with_its_last_error_line(tmp_path, capsys):
    script = "import sys; print('loading'); sys.stderr.write('Traceback\\n'); "
    script += "raise MemoryError('CUDA out of memory. Tried to allocate 2 GiB')"
    outcome = run_model([sys.executable, "-c", script], tmp_path / "logs" / "m.log")
    assert outcome.returncode == 1
    assert outcome.error == "MemoryError: CUDA out of memory. Tried to allocate 2 GiB"
    log = (tmp_path / "logs" / "m.log").read_text()
    assert "loading" in log and "MemoryError" in log
    assert "loading" in capsys.readouterr().err  # echoed for the terminal too
    ok = run_model([sys.executable, "-c", "print('fine')"], tmp_path / "ok.log", echo=False)
    assert (ok.returncode, ok.error) == (0, "")


def test_time_left_is_the_mean_model_time_times_the_models_left():
    stream = io.StringIO()
    progress = SweepProgress(total=5, to_run=4, stream=stream)
    assert progress.eta() is None
    progress.begin("a", "complete in the folder, skipped")
    progress.end("a", "complete", 0.0, ran=False)
    progress.begin("b", "running")
    progress.end("b", "done", 30.0)
    progress.begin("c", "running")
    progress.end("c", "failed", 10.0)
    assert progress.eta() == 2 * 20.0
    last = stream.getvalue().splitlines()[-1]
    assert "3/5" in last and "1 done, 1 failed, 1 complete" in last and "~00:40 left" in last
    assert "|############........|" in last  # 3 of 5 finished
