"""Run one model of a sweep: ``python -m lm_coupling run ...`` in its own process.

A process per model is the same code path as the command line, frees the
model (and its GPU memory) when it exits, and confines a crash or an
out-of-memory error to that model. Its output goes to the terminal (lm-eval's
own progress bars) and to ``<out>/sweep_logs/<model>.log``.
"""

from __future__ import annotations

import codecs
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lm_coupling.sweep.spec import ModelEntry

LOG_DIR = "sweep_logs"
_ERROR_WORDS = ("Error", "error:", "Exception", "Killed", "CUDA out of memory")


@dataclass
class RunOutcome:
    """How one model's process ended."""

    returncode: int
    seconds: float
    log: Path
    error: str


def model_args_for(entry: ModelEntry, model_args: str | None) -> str:
    """``pretrained=NAME[,revision=REV]`` plus the sweep's shared ``--model_args``."""
    args = [f"pretrained={entry.name}"]
    if entry.revision:
        args.append(f"revision={entry.revision}")
    if model_args:
        args.append(model_args.strip(","))
    return ",".join(args)


def run_command(
    entry: ModelEntry,
    tasks: Sequence[str],
    out_dir: Path,
    model_args: str | None,
    lm_eval_args: Sequence[str],
) -> list[str]:
    """The model's command line (the sweep's other lm-eval arguments passed on)."""
    return [
        sys.executable, "-m", "lm_coupling", "run",
        "--model_args", model_args_for(entry, model_args),
        "--tasks", ",".join(tasks),
        "--output_path", str(out_dir),
        *lm_eval_args,
    ]  # fmt: skip


def last_error(text: str) -> str:
    """The most telling line of a failed run's output: its last error line."""
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if any(word in line for word in _ERROR_WORDS)]
    chosen = errors[-1] if errors else (lines[-1] if lines else "no output")
    return chosen[:500]


def run_model(command: Sequence[str], log: Path, echo: bool = True) -> RunOutcome:
    """Run ``command``, copying its output to ``log`` (and stderr when ``echo``)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log.open("wb") as sink:
        sink.write(("$ " + " ".join(command) + "\n").encode())
        with subprocess.Popen(
            list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ) as process:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            while chunk := process.stdout.read1(65536):  # type: ignore[union-attr]
                sink.write(chunk)
                if echo:
                    sys.stderr.write(decoder.decode(chunk))
                    sys.stderr.flush()
            returncode = process.wait()
    seconds = time.monotonic() - start
    error = "" if returncode == 0 else last_error(log.read_text(errors="replace"))
    if returncode < 0:
        error = f"killed by signal {-returncode}; {error}"
    return RunOutcome(returncode, seconds, log, error)
