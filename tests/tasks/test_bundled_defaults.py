"""Every offline task lm-coupling ships runs at its own defaults on the bundled data and model.

One real ``lm_eval`` launch evaluates all of them (``--limit 2``, no
``--num_fewshot``, no data folder: the bundled sample documents). The task
list is read from the YAML files, so that a task added later is covered too.
MMLU subjects count where the bundled samples hold their documents; the other
subjects need the user's data (``lm_coupling/tasks/README.md``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lm_eval.tasks._yaml_loader import load_yaml

from lm_coupling.demo.assets import bundled_model_path

pytestmark = pytest.mark.slow

TASKS_DIR = Path(__file__).resolve().parents[2] / "lm_coupling" / "tasks"
BUNDLED = TASKS_DIR.parent / "demo" / "sample_tasks"  # the tasks' default data
DEMO_DATA = TASKS_DIR.parent / "demo" / "assets" / "tasks_data"  # `lm-coupling demo`'s data
LIMIT = 2


def bundled_subjects() -> set[str]:
    """MMLU subjects with documents in the bundled samples."""
    with (BUNDLED / "mmlu" / "test.jsonl").open(encoding="utf-8") as fh:
        return {json.loads(line)["subject"] for line in fh if line.strip()}


def offline_task_configs() -> dict[str, dict]:
    """``{task: resolved config}`` of every shipped offline task with bundled documents."""
    subjects = bundled_subjects()
    configs = {}
    for path in sorted(TASKS_DIR.rglob("*.yaml")):
        cfg = load_yaml(path, resolve_func=False)
        if "task" not in cfg or "custom_dataset" not in cfg:
            continue  # groups, the MMLU template, stock hub tasks
        subject = cfg.get("dataset_kwargs", {}).get("subject")
        if subject is None or subject in subjects:
            configs[cfg["task"]] = cfg
    return configs


def primary_key(cfg: dict) -> str:
    """The results key of a task's first metric under its first filter."""
    filters = cfg.get("filter_list") or [{"name": "none"}]
    return f"{cfg['metric_list'][0]['metric']},{filters[0]['name']}"


@pytest.fixture(scope="module")
def defaults_run(tmp_path_factory):
    """All offline tasks in one ``lm_eval`` launch on the bundled model, at their defaults."""
    configs = offline_task_configs()
    out = tmp_path_factory.mktemp("bundled_defaults")
    command = [str(Path(sys.executable).parent / "lm_eval"), "--model", "hf"]
    command += ["--model_args", f"pretrained={bundled_model_path()}"]
    command += ["--tasks", ",".join(configs), "--include_path", str(TASKS_DIR)]
    command += ["--limit", str(LIMIT), "--output_path", str(out / "results")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("LM_COUPLING_DATA_DIR", None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=out)
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = (out / "results").glob("*/results_*.json")
    return configs, json.loads(results.read_text(encoding="utf-8"))


def test_the_task_list_covers_every_offline_benchmark():
    configs = offline_task_configs()
    benchmarks = {cfg["dataset_kwargs"]["benchmark"] for cfg in configs.values()}
    assert benchmarks == {p.name for p in BUNDLED.iterdir() if p.is_dir()}
    assert "lmc_gsm8k_offline" in configs and "lmc_truthfulqa_mc1_offline" in configs
    kwargs = [cfg["dataset_kwargs"] for cfg in configs.values()]
    mmlu = {kw["subject"] for kw in kwargs if "subject" in kw}
    assert mmlu == bundled_subjects() and len(mmlu) >= 3


def test_every_task_runs_at_its_default_shots_with_a_finite_accuracy(defaults_run):
    configs, results = defaults_run
    for task, cfg in configs.items():
        assert task in results["results"], (task, sorted(results["results"]))
        assert results["n-shot"][task] == cfg.get("num_fewshot", 0), task
        value = results["results"][task][primary_key(cfg)]
        assert isinstance(value, float | int) and math.isfinite(value), (task, value)
        assert 0.0 <= value <= 1.0, (task, value)
        assert results["n-samples"][task]["effective"] == LIMIT, task


@pytest.mark.parametrize("data", [BUNDLED, DEMO_DATA], ids=["samples", "demo_data"])
def test_every_few_shot_split_holds_the_default_shots(data):
    for task, cfg in offline_task_configs().items():
        shots = cfg.get("num_fewshot", 0)
        if not shots:
            continue
        split = cfg.get("fewshot_split") or cfg["training_split"]
        path = data / cfg["dataset_kwargs"]["benchmark"] / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
        subject = cfg["dataset_kwargs"].get("subject")
        rows = [row for row in rows if subject is None or row["subject"] == subject]
        assert len(rows) >= shots, (task, split, len(rows), shots)
