"""Helpers of the harness tests: run the real CLI and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import site
import subprocess
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fixtures.benchmarks import BUNDLED_SAMPLES

from lm_coupling.harness.run import TASKS_DIR

BIN = Path(sys.executable).parent
STARTUP_PTH = "lm_coupling_startup.pth"
REPO_PTH = Path(__file__).resolve().parents[2] / STARTUP_PTH
# Subjects of the `lmc_mmlu_sample` group (used by `lmc_demo`).
SAMPLE_MMLU_SUBJECTS = ("astronomy", "high_school_biology", "elementary_mathematics")
MAX_LEN = 128  # tiny context: lm-eval truncates (and the harness must follow it)
RUN_TIMEOUT_S = 900
LLAMA_METRIC_ARGS = "coupling_docs=2,k=1000"


def installed_startup_pth() -> Path | None:
    """The start-up hook file in this interpreter's site-packages, if installed."""
    for directory in site.getsitepackages():
        candidate = Path(directory) / STARTUP_PTH
        if candidate.is_file():
            return candidate
    return None


def require_startup_hook() -> None:
    """Fail (never skip) when the literal ``lm_eval ... --metrics`` cannot work here."""
    if installed_startup_pth() is None:
        pytest.fail(
            f"{STARTUP_PTH} is not in site-packages {site.getsitepackages()}: the literal "
            "`lm_eval ... --metrics` command needs it. Install lm-coupling non-editable "
            f"(pip install . ; the wheel ships it) or copy {REPO_PTH} into site-packages."
        )


@dataclass
class RunOutput:
    """One finished CLI run: exit code, streams and the files it wrote."""

    returncode: int
    stdout: str
    stderr: str
    output_dir: Path
    results: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    geometry: dict[str, dict[str, Any]] = field(default_factory=dict)
    timestamp: str = ""

    def docs(self, task: str) -> dict[int, dict[str, Any]]:
        """One sample row per doc_id (the first filter's)."""
        rows: dict[int, dict[str, Any]] = {}
        for row in self.samples[task]:
            rows.setdefault(row["doc_id"], row)
        return rows


def read_outputs(run: RunOutput) -> RunOutput:
    """Load the newest results_*.json, its samples and geometry files."""
    found = sorted(run.output_dir.glob("*/results_*.json"))
    if not found:
        return run
    path = found[-1]
    run.timestamp = path.stem.removeprefix("results_")
    run.results = json.loads(path.read_text(encoding="utf-8"))
    samples = defaultdict(list)
    for file in path.parent.glob(f"samples_*_{run.timestamp}.jsonl"):
        task = file.name.removeprefix("samples_").removesuffix(f"_{run.timestamp}.jsonl")
        with file.open(encoding="utf-8") as fh:
            samples[task] = [json.loads(line) for line in fh if line.strip()]
    run.samples = dict(samples)
    for file in path.parent.glob(f"geometry_*_{run.timestamp}.json"):
        document = json.loads(file.read_text(encoding="utf-8"))
        run.geometry[document["task"]] = document
    return run


def sigint_as_at_a_terminal() -> None:
    """``Popen(preexec_fn=...)`` for a child that a test interrupts with SIGINT (Ctrl-C).

    A test run started in the background by a shell without job control (a CI
    runner may start it so) inherits SIGINT *ignored*, and Python keeps an
    inherited "ignore" instead of raising KeyboardInterrupt: the child would
    never see the Ctrl-C. This gives it the disposition a terminal gives.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("LM_COUPLING_NO_STARTUP_HOOK", None)
    return env


def run_cli(program: str, args: list[str], cwd: Path, timeout: int = RUN_TIMEOUT_S) -> RunOutput:
    """Run ``program`` (``lm_eval``, ``lm-coupling``, ``python -m lm_coupling``) in ``cwd``."""
    if program == "lm_eval":
        command = [str(BIN / "lm_eval"), *args]
    elif program == "lm-coupling":
        command = [str(BIN / "lm-coupling"), "run", *args]
    elif program == "python -m lm_coupling":
        command = [sys.executable, "-m", "lm_coupling", "run", *args]
    else:
        command = [program, *args]
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        command, cwd=cwd, env=offline_env(), capture_output=True, text=True, timeout=timeout
    )
    (cwd / "stdout.txt").write_text(done.stdout, encoding="utf-8")  # kept for debugging
    (cwd / "stderr.txt").write_text(done.stderr, encoding="utf-8")
    out = RunOutput(done.returncode, done.stdout, done.stderr, cwd / "results")
    return read_outputs(out)


def run_in_process(args: list[str], cwd: Path, capsys, monkeypatch) -> RunOutput:
    """``lm-coupling run ARGS`` through the real command line (`lm_coupling.cli.main`) in-process.

    For a test that checks a refusal's message: no interpreter start-up and imports
    per test (about 5 s each on CI). One end-to-end process test per exit path stays
    (`run_cli`).
    """
    from lm_coupling.cli import main

    cwd.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    capsys.readouterr()  # what earlier steps printed is not this run's
    try:
        main(["run", *args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return read_outputs(RunOutput(code, captured.out, captured.err, cwd / "results"))


def check_ok(run: RunOutput) -> RunOutput:
    """Fail with the run's stderr tail when it did not succeed."""
    if run.returncode != 0 or not run.results:
        pytest.fail(f"CLI run failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    return run


@dataclass(frozen=True)
class HarnessSetup:
    """Tiny models and the converted real benchmark items."""

    root: Path
    models: dict[str, Path]
    data_dir: Path

    def args(
        self, model: str = "gpt2", batch_size: int | str = 4, tasks: str = "lmc_demo", *extra: str
    ) -> list[str]:
        """lm-eval ``run`` arguments over the offline tasks and the real items."""
        return [
            "--model", "hf",
            "--model_args", f"pretrained={self.models[model]}",
            "--tasks", tasks,
            "--include_path", str(TASKS_DIR),
            "--metadata", json.dumps({"lmc_data_dir": str(self.data_dir)}),
            "--batch_size", str(batch_size),
            "--log_samples",
            "--output_path", "results",
            *extra,
        ]  # fmt: skip


def add_sample_mmlu_subjects(mmlu_dir: Path) -> None:
    """Append the bundled sample rows of `lmc_mmlu_sample` subjects the real files lack."""
    for split in ("test", "dev"):
        target = mmlu_dir / f"{split}.jsonl"
        lines = target.read_text(encoding="utf-8").splitlines()
        have = {json.loads(line)["subject"] for line in lines if line.strip()}
        bundled = (BUNDLED_SAMPLES / "mmlu" / f"{split}.jsonl").read_text(encoding="utf-8")
        extra = [
            line
            for line in bundled.splitlines()
            if line.strip() and json.loads(line)["subject"] not in have
        ]
        target.write_text("\n".join(lines + extra) + "\n", encoding="utf-8")


def prompt_of(hflm, row: dict[str, Any]) -> tuple[list[int], int]:
    """Rebuild a document's measured prompt and gold token from lm-eval's own log.

    Multiple choice: the gold request (``target`` index; WinoGrande: the gold
    option's context), encoded and left-truncated like HFLM's
    ``_loglikelihood_tokens``. Generation: the prompt truncated like HFLM's
    ``generate_until`` with the request's ``max_gen_toks``; the lens target is
    the first token of the gold answer.
    """
    arguments = row["arguments"]
    first = arguments["gen_args_0"]
    if isinstance(first["arg_1"], dict):
        context, gen_kwargs = first["arg_0"], first["arg_1"]
        tokens = hflm.tok_encode(context)[-(hflm.max_length - gen_kwargs["max_gen_toks"]) :]
        gold = hflm._encode_pair(context, f" {row['target']}")[1][0]
        return tokens, gold
    doc = row["doc"]
    index = int(doc["answer"]) - 1 if "option1" in doc else int(row["target"])
    request = arguments[f"gen_args_{index}"]
    context_enc, continuation_enc = hflm._encode_pair(request["arg_0"], request["arg_1"])
    inp = (context_enc + continuation_enc)[-(hflm.max_length + 1) :][:-1]
    last = len(inp) - len(continuation_enc)
    return inp[: last + 1], continuation_enc[0]


def result_key(task: str, metric: str) -> str:
    """The results-JSON key of ``metric`` (GSM8K reports per filter)."""
    return f"{metric},{'strict-match' if 'gsm8k' in task else 'none'}"


@contextlib.contextmanager
def plugin_registered(plugin: object, name: str) -> Iterator[list[warnings.WarningMessage]]:
    """Register ``plugin`` with lm-coupling's plugin manager for the block; yield its warnings.

    Every warning raised inside the block is recorded (``simplefilter("always")``)
    in the yielded list; the plugin is unregistered on the way out.
    """
    from lm_coupling.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        pm.unregister(name=name)
