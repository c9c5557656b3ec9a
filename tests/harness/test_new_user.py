"""A new user's first hour (issue 27), through the real `lm_coupling.evaluate` and ``lm_eval``.

- in-memory models are filed under a name (``model_name=``); one without a
  usable name is refused; two different models under one name never share a
  leaderboard row;
- a ``--limit`` run never replaces a complete run of the same setting; a
  ``--limit`` row alone is marked;
- Ctrl-C (SIGINT to a real ``lm_eval`` process) ends with one line and 130;
- an unknown task, and a run without ``pretrained=``, fail before lm-eval
  indexes its tasks.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest
from harness_cli import (
    BIN,
    offline_env,
    require_startup_hook,
    run_in_process,
    sigint_as_at_a_terminal,
)

import lm_coupling
from lm_coupling.harness.run import TASKS_DIR

pytestmark = pytest.mark.slow
TASK = "lmc_arc_easy_offline"
SCORE_PREFIX = f"score:{TASK}:"


@pytest.fixture(scope="module")
def index_and_seconds():
    """lm-eval's task index with lm-coupling's tasks, built once, and the seconds it took."""
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    manager = TaskManager(include_path=[str(TASKS_DIR)])
    return manager, time.perf_counter() - start


def _evaluate(harness_setup, index, out: Path, **keywords):
    keywords.setdefault("limit", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = lm_coupling.evaluate(
            tasks=[TASK],
            metrics="lss",
            batch_size=2,
            device="cpu",
            output_path=str(out),
            metadata={"lmc_data_dir": str(harness_setup.data_dir)},
            task_manager=index,
            **keywords,
        )
    return results, [str(w.message) for w in caught]


def _board(out: Path) -> pd.DataFrame:
    return pd.read_csv(out / "leaderboard.csv", keep_default_na=False, na_values=[""])


# -- 1. in-memory models: a name, and never one row for two models ---------------------


def test_in_memory_model_without_a_name_is_refused(harness_setup, tmp_path):
    from fixtures.tiny import build_tiny_model

    model = build_tiny_model("gpt2", 512, n_layers=2)  # from a config: name_or_path is ""
    with pytest.raises(lm_coupling.ConfigurationError, match="model_name="):
        lm_coupling.evaluate(
            model=model, tokenizer=object(), tasks=[TASK], output_path=str(tmp_path)
        )
    assert not any(tmp_path.iterdir()), "nothing may be written for a refused run"


def test_in_memory_models_never_share_a_row(harness_setup, index_and_seconds, tmp_path):
    import torch
    from fixtures.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    index, _ = index_and_seconds
    path = str(harness_setup.models["gpt2"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path)
    out = tmp_path / "results"
    first, _ = _evaluate(harness_setup, index, out, model=base, tokenizer=tokenizer)
    changed = AutoModelForCausalLM.from_pretrained(path)  # keeps name_or_path == path
    with torch.no_grad():
        for parameter in changed.transformer.h[0].parameters():
            parameter.mul_(1.5)
    second, messages = _evaluate(harness_setup, index, out, model=changed, tokenizer=tokenizer)
    assert first["results"][TASK]["lss,none"] != second["results"][TASK]["lss,none"]
    board = _board(out)
    assert len(board) == 2, board[["model"]]
    assert all("gpt2 [weights " in name for name in board["model"]), list(board["model"])
    by_name = dict(zip(board["model"], board["lss"], strict=True))
    assert sorted(by_name.values()) == sorted(
        [first["results"][TASK]["lss,none"], second["results"][TASK]["lss,none"]]
    )
    assert any("model_name=" in m and "kept apart" in m for m in messages), messages

    # Two models built from configs, named: their own folders, their own rows.
    for name, layers in (("scratch-3layer", 3), ("scratch-2layer", 2)):
        model = build_tiny_model("gpt2", len(tokenizer), n_layers=layers, max_len=128, init_std=0.2)
        results, _ = _evaluate(
            harness_setup, index, out, model=model, tokenizer=tokenizer, model_name=name
        )
        assert results["config"]["model_args"]["pretrained"] == name
        assert (out / name).is_dir()
        (results_file,) = (out / name).glob("results_*.json")
        recorded = json.loads(results_file.read_text())["config"]["model_args"]
        assert recorded["pretrained"] == name and len(recorded["weights"]) == 16
    board = _board(out)
    assert len(board) == 4
    layers = dict(zip(board["model"], board["n_layers"], strict=True))
    assert layers["scratch-3layer"] == 3 and layers["scratch-2layer"] == 2


# -- 2. complete runs win over --limit runs ---------------------------------------------


def test_limit_run_never_replaces_a_complete_run(harness_setup, index_and_seconds, tmp_path):
    index, _ = index_and_seconds
    out = tmp_path / "results"
    model_args = {"pretrained": str(harness_setup.models["gpt2"])}
    full, _ = _evaluate(harness_setup, index, out, model_args=model_args, num_fewshot=0)
    limited, messages = _evaluate(
        harness_setup, index, out, model_args=model_args, num_fewshot=0, limit=2
    )
    assert full["results"][TASK]["lss,none"] != limited["results"][TASK]["lss,none"]
    (row,) = _board(out).to_dict("records")
    assert row["lss"] == pytest.approx(full["results"][TASK]["lss,none"])
    (score,) = [c for c in row if c.startswith(SCORE_PREFIX)]
    metric = score.removeprefix(SCORE_PREFIX)
    assert row[score] == pytest.approx(full["results"][TASK][f"{metric},none"])
    assert pd.isna(row["limited"]) or row["limited"] == ""
    assert any("complete run wins" in m for m in messages), messages

    # A --limit run alone is marked in its row.
    alone = tmp_path / "alone"
    llama = {"pretrained": str(harness_setup.models["llama"])}
    _evaluate(harness_setup, index, alone, model_args=llama, num_fewshot=0, limit=2)
    (row,) = _board(alone).to_dict("records")
    assert row["limited"] == TASK and "limit 2" in row["settings"]


# -- 3. Ctrl-C ---------------------------------------------------------------------------


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    require_startup_hook()
    from lm_coupling.demo.assets import bundled_model_path, bundled_tasks_data_path

    command = [
        str(BIN / "lm_eval"), "--model", "hf",
        "--model_args", f"pretrained={bundled_model_path()}",
        "--tasks", "lmc_demo", "--metrics", "all", "--batch_size", "1",
        "--metadata", json.dumps({"lmc_data_dir": str(bundled_tasks_data_path())}),
        "--use_cache", str(tmp_path / "cache"), "--output_path", str(tmp_path / "results"),
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=offline_env(),
        stderr=subprocess.PIPE,
        preexec_fn=sigint_as_at_a_terminal,
    )
    chunks: list[bytes] = []
    reader = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: process.stderr.read1(4096), b"")), daemon=True
    )
    reader.start()
    progress = re.compile(rb"Running loglikelihood requests:\s+\d+%.*?\| *[1-9]\d*/\d+")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        if progress.search(b"".join(chunks)):
            break
        time.sleep(0.05)
    seen = b"".join(chunks).decode(errors="replace")
    if process.poll() is not None or time.monotonic() >= deadline:
        process.kill()
        pytest.fail(f"no request was answered before the run ended:\n{seen[-3000:]}")
    process.send_signal(signal.SIGINT)
    process.wait(timeout=120)
    reader.join(timeout=30)
    process.stderr.close()
    seen = b"".join(chunks).decode(errors="replace")
    assert process.returncode == 130, seen[-3000:]
    assert "Traceback" not in seen, seen[-3000:]
    last = [line for line in seen.splitlines() if line.strip()][-1]
    match = re.fullmatch(
        r"lm-coupling: interrupted after (\d+) of (\d+) requests; rerun the same command "
        r"\(with the same --use_cache\) to resume",
        last,
    )
    assert match, repr(seen[-1500:])
    done, total = map(int, match.groups())
    assert 0 < done < total


# -- 5. unknown task and a missing model, before the model loads -------------------------


def test_unknown_task_is_reported_before_the_model_loads(harness_setup, index_and_seconds):
    index, _ = index_and_seconds
    with pytest.raises(lm_coupling.ConfigurationError, match="lmc_arc_easy_offline") as caught:
        lm_coupling.evaluate(
            model_args={"pretrained": str(harness_setup.models["gpt2"])},
            tasks="lmc_arc_eazy_offline",
            metrics="lss",
            task_manager=index,
        )
    assert "task(s) not found: lmc_arc_eazy_offline" in str(caught.value)


def test_unknown_task_is_named_from_the_task_files_without_an_index():
    """The early check reads the task YAMLs as text: a typo is named with close names."""
    from lm_coupling.harness.run import include_paths
    from lm_coupling.harness.task_names import check_task_names, lm_eval_tasks_dir, task_names

    folders = [lm_eval_tasks_dir(), *map(Path, include_paths(None))]
    known = task_names(folders)
    assert {"lmc_arc_easy_offline", "arc_easy", "winogrande"} <= known
    with pytest.raises(lm_coupling.ConfigurationError, match="lmc_arc_easy_offline"):
        check_task_names(["lmc_arc_eazy_offline"], include_paths(None))
    check_task_names(["lmc_arc_easy_offline", "mmlu_*"], include_paths(None))  # no error


def test_no_model_args_is_a_clear_early_error(tmp_path, capsys, monkeypatch):
    """In-process through the command line: the same exit path as the literal lm_eval's
    refusals (end to end in test_harness_errors.py)."""
    run = run_in_process(["--model", "hf", "--tasks", "arc", "--metrics", "coupling"], tmp_path,
                         capsys, monkeypatch)  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "TypeError" not in run.stderr
    assert "lm-coupling: error: no model given: add --model_args pretrained=" in run.stderr
