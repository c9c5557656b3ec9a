"""The sweep passes lm-eval's per-model options on and refuses those it sets itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lm_coupling
from lm_coupling.errors import ConfigurationError
from lm_coupling.sweep.command import parse_sweep_args
from lm_coupling.sweep.runner import run_command
from lm_coupling.sweep.spec import ModelEntry

TASKS_DIR = Path(lm_coupling.__file__).parent / "tasks"
BASE = ["m1,m2", "--tasks", "my_arc", "--output_path", "out"]


def test_include_path_and_other_options_reach_every_models_run(tmp_path):
    options = [
        "--include_path", str(tmp_path), "--num_fewshot", "2", "--apply_chat_template",
        "--samples", '{"my_arc": [0, 2]}', "--seed", "3", "--gen_kwargs", "max_gen_toks=8",
    ]  # fmt: skip
    args, rest = parse_sweep_args(
        [*BASE, *options, "--model_args", "peft=/adapters/a,dtype=bfloat16", "--metrics", "lss"]
    )
    assert rest == [*options, "--metrics", "lss"]
    command = run_command(ModelEntry("org/m", "step1"), ["my_arc"], tmp_path, args.model_args, rest)
    assert command[command.index("--model_args") + 1] == (
        "pretrained=org/m,revision=step1,peft=/adapters/a,dtype=bfloat16"
    )
    assert command[command.index("--include_path") + 1] == str(tmp_path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "vllm"], "cannot pass --model on: every model of a sweep runs as"),
        (["-M", "vllm"], "cannot pass -M on"),
        (["-a", "pretrained=x"], "cannot pass -a on"),
        (["-o", "elsewhere"], "cannot pass -o on"),
        (["--model_args", "pretrained=x,dtype=float16"], "sets it per model from MODELS"),
        (["--metrics", "lss", "--predict_only"], "--predict_only cannot be combined"),
        (["--metrics", "lss", "--model_args", "tp_plan=auto"], "tp_plan=auto cannot be"),
    ],
)
def test_options_the_sweep_cannot_pass_on_are_refused_with_the_reason(extra, message):
    with pytest.raises(ConfigurationError, match=message.replace("-", r"\-")):
        parse_sweep_args([*BASE, *extra])


def test_a_config_file_may_not_set_what_the_sweep_sets(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: hf\nmodel_args: {pretrained: gpt2}\nnum_fewshot: 2\n")
    with pytest.raises(ConfigurationError, match="sets model, model_args.pretrained"):
        parse_sweep_args([*BASE, "--config", str(config)])
    config.write_text("num_fewshot: 2\n")
    _, rest = parse_sweep_args([*BASE, "--config", str(config), "--metrics", "lss"])
    assert rest[:2] == ["--config", str(config)]


@pytest.mark.slow
def test_a_sweep_over_a_users_own_task_folder(tmp_path):
    from fixtures.tiny import save_tiny_model, train_tokenizer

    model = save_tiny_model(tmp_path / "tiny", "gpt2", tokenizer=train_tokenizer(), max_len=128)
    tasks = tmp_path / "my_tasks"
    tasks.mkdir()
    (tasks / "my_arc.yaml").write_text(
        f"include: {TASKS_DIR / 'lmc_arc_easy_offline.yaml'}\ntask: my_arc\n", encoding="utf-8"
    )
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "lm_coupling", "sweep", str(model), "--tasks", "my_arc",
        "--output_path", str(out), "--include_path", str(tasks), "--limit", "2",
        "--num_fewshot", "1", "--metrics", "lss", "--quiet", "--no-report",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("LM_COUPLING_DATA_DIR", None)  # the bundled sample documents
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (geometry,) = out.rglob("geometry_my_arc_*.json")
    document = json.loads(geometry.read_text(encoding="utf-8"))
    assert document["capture"]["in_batch"] == 2 and document["capture"]["alone"] == 0
    (results,) = out.rglob("results_*.json")
    recorded = json.loads(results.read_text())["config"]["lm_coupling"]["lm_eval_options"]
    assert recorded["include_path"] == str(tasks) and recorded["num_fewshot"] == 1
