"""``lm-coupling sweep --study FILE --plan``/``--max-hours`` on local tiny models, for real.

The plan is computed from the models' configs alone (a model whose weights file
is missing is planned all the same), a limit below the estimate refuses the
sweep before any model runs, and the estimate of a small study is within the
factor docs/sweep.md states (3x) of the measured time of running it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from fixtures.tiny import save_tiny_model

pytestmark = pytest.mark.slow
FACTOR = 3.0  # docs/sweep.md, "Named studies"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The plans' cache of the startup seconds: measured by the first plan, read by the rest."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("study")
    save_tiny_model(root / "gpt2", "gpt2", tokenizer, d_model=32, n_layers=3, n_heads=4)
    save_tiny_model(root / "llama", "llama", tokenizer, d_model=48, n_layers=4, n_heads=4)
    shutil.copytree(root / "gpt2", root / "no_weights")
    (root / "no_weights" / "model.safetensors").unlink()
    return root


def study_file(root, names, path):
    study = {
        "name": "tiny",
        "tasks": "lmc_hellaswag_offline",
        "metrics": "coupling,lss",
        "model_args": "dtype=float32",
        "task_costs": {"lmc_hellaswag_offline": {"documents": 8, "requests": 4, "tokens": 60}},
        "models": [{"model": str(root / name)} for name in names],
        "excluded": [{"model": "t5-small", "reason": "not a causal LM"}],
    }
    path.write_text(json.dumps(study))
    return path


CACHE: dict[str, str] = {}
"""``LM_COUPLING_CACHE`` of this module's plans (set by the `cache_dir` fixture)."""

PEAK = (
    "import atexit, re, sys\n"
    "def peak():\n"
    "    status = open('/proc/self/status').read()\n"
    "    print('VmHWM', re.search(r'VmHWM:\\s+(\\d+)', status).group(1), file=sys.stderr)\n"
    "atexit.register(peak)\n"
    "from lm_coupling.cli import main\n"
    "main(sys.argv[1:])\n"
)
"""``lm-coupling ARGS`` that prints its process's peak resident memory (kB) at exit."""


def sweep(root, *args, peak: bool = False):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **CACHE)
    env.pop("LM_COUPLING_DATA_DIR", None)  # the bundled sample documents
    program = ["-c", PEAK] if peak else ["-m", "lm_coupling"]
    command = [sys.executable, *program, "sweep", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, cwd=root)


@pytest.fixture(autouse=True)
def _plan_cache(cache_dir, monkeypatch):
    monkeypatch.setitem(CACHE, "LM_COUPLING_CACHE", str(cache_dir))


def planned_hours(stdout: str) -> float:
    return float(re.search(r"([0-9.e+-]+) device-hours", stdout).group(1))


def test_the_plan_needs_no_weights_and_a_limit_below_it_refuses(models):
    path = study_file(models, ["no_weights", "gpt2"], models / "plan.json")
    out = models / "refused"
    done = sweep(models, "--study", str(path), "--limit", "2", "--max-hours", "1e-6",
                 "--output_path", str(out))  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "above --max-hours 1e-06: nothing was run" in done.stderr
    # The plan may shorten a long model path (pytest-xdist's folders are long): match the ends.
    rows = [
        line
        for line in done.stdout.splitlines()
        if re.search(r"(no_weights|gpt2)\s+config\s", line)
    ]
    assert len(rows) == 2 and all(" config " in row for row in rows), done.stdout  # config.json
    assert re.search(r"no_weights\s+config\s+3\s+32\s+2\s+2\s", done.stdout)  # docs, coupled
    assert "left out: t5-small: not a causal LM" in done.stdout
    assert planned_hours(done.stdout) > 0
    assert not (out / "sweep_logs").exists() and not (out / "sweep_status").exists()  # none ran
    assert json.loads((out / "sweep_plan.json").read_text())["models"][0]["documents"] == 2
    plan_only = sweep(models, "--study", str(path), "--plan", "--limit", "2")
    assert plan_only.returncode == 0, plan_only.stderr[-3000:]
    assert "device-hours on cpu" in plan_only.stdout


def test_the_estimate_is_within_the_stated_factor_of_the_measured_run(models):
    path = study_file(models, ["gpt2", "llama"], models / "run.json")
    out = models / "ran"
    done = sweep(models, "--study", str(path), "--limit", "2", "--max-hours", "1",
                 "--output_path", str(out), "--no-report", "--quiet")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    status = pd.read_csv(out / "sweep_status.csv")
    assert list(status["status"]) == ["done", "done"]
    plan = json.loads((out / "sweep_plan.json").read_text())  # the plan, recorded
    assert planned_hours(done.stdout) == pytest.approx(plan["total_s"] / 3600, rel=0.01)
    estimated = dict((m["model"], m["estimated_s"]) for m in plan["models"])
    measured = dict(zip(status["model"], status["seconds"], strict=True))
    assert set(estimated) == set(measured) == {str(models / "gpt2"), str(models / "llama")}
    for model, seconds in measured.items():
        print(f"{model}: estimated {estimated[model]:.1f} s, measured {seconds:.1f} s")
        assert seconds / FACTOR <= estimated[model] <= seconds * FACTOR
    total, ran = plan["total_s"], sum(measured.values())
    print(f"total: estimated {total:.1f} s, measured {ran:.1f} s, ratio {total / ran:.2f}")
    assert ran / FACTOR <= total <= ran * FACTOR


def test_a_study_of_large_models_is_planned_in_little_memory_without_building_them(
    models, cache_dir
):
    """aubry2025 (28 hub models up to 70B; offline: the study's shapes): no model is built.

    Building them (the earlier calibration) passed 16 GB; the imports alone take about
    0.5 GB. The startup seconds are those the first test of this module measured.
    """
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads the peak memory from /proc/self/status (Linux)")
    measured = (cache_dir / "sweep_startup.json").is_file()  # by the first test of the module
    elsewhere = models / "elsewhere"  # not beside the folder `gpt2`, which would name it
    elsewhere.mkdir(exist_ok=True)
    # The metrics of this module's other plans: their startup seconds are reused.
    args = ["--study", "aubry2025", "--plan", "--device", "cpu", "--metrics", "coupling,lss"]
    done = sweep(elsewhere, *args, peak=True)
    assert done.returncode == 0, done.stderr[-3000:]
    peak_kb = int(re.search(r"VmHWM (\d+)", done.stderr).group(1))
    print(f"aubry2025 --plan: peak {peak_kb / 1024:.0f} MiB")
    assert peak_kb < 1.5 * 2**20, done.stderr[-2000:]
    assert ("as measured before" in done.stderr) == measured  # not run again once measured
    assert "calibrating meta-llama/Llama-2-70b-hf" in done.stderr
    rows = re.findall(r"^\s+shape llama L=80 d=8192 .*not built: .* GFLOP/s", done.stdout, re.M)
    assert len(rows) == 1, done.stdout
    assert re.search(
        r"meta-llama/Llama-2-70b-hf\s+study file\s+80\s+8192\s+28659\s+1550\s", done.stdout
    )


def test_a_device_the_machine_lacks_is_refused_before_any_calibration(models):
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = f"cuda:{count}"  # cuda:0 without a GPU; one past the last device with GPUs
    done = sweep(models, "--study", "aubry2025", "--plan", "--device", device)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"lm-coupling sweep: error: --device {device}: this machine has" in done.stderr
    assert "Traceback" not in done.stderr and "calibrating" not in done.stderr
    assert "--device cpu" in done.stderr or "choose one of them" in done.stderr
