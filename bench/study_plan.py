"""The sweep's ``--plan`` against the measured run: estimate and wall time per model.

Runs ``lm-coupling sweep --study STUDY ... --max-hours H --output_path OUT``
once (the plan is printed and recorded as ``OUT/sweep_plan.json``, then the
models run), and prints, per model, the plan's estimated seconds, the measured
seconds of its process (``OUT/sweep_status.csv``) and their ratio, plus the
totals. Without ``--study`` it builds a study of two tiny local models (GPT-2
and Llama shapes) on ``lmc_hellaswag_offline``, as the test does.

    python bench/study_plan.py                                   # tiny study, CPU
    python bench/study_plan.py --limit 20 --device cuda:0        # on a GPU
    python bench/study_plan.py --study pythia_emergence --device cuda:0 --limit 50 \\
        --extra "--shard 0/13"                                   # real checkpoints (hub)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from timing import machine_line, print_table


def tiny_study(root: Path) -> Path:
    """Two tiny random local models and a study file naming them."""
    from tiny_models import save_tiny_model, train_tokenizer

    tokenizer = train_tokenizer()
    save_tiny_model(root / "gpt2", "gpt2", tokenizer, d_model=32, n_layers=3, n_heads=4)
    save_tiny_model(root / "llama", "llama", tokenizer, d_model=48, n_layers=4, n_heads=4)
    study = {
        "name": "tiny",
        "tasks": "lmc_hellaswag_offline",
        "metrics": "coupling,lss",
        "model_args": "dtype=float32",
        "task_costs": {"lmc_hellaswag_offline": {"documents": 8, "requests": 4, "tokens": 60}},
        "models": [{"model": str(root / "gpt2")}, {"model": str(root / "llama")}],
    }
    path = root / "study.json"
    path.write_text(json.dumps(study))
    return path


def main(argv=None) -> None:
    """Run the study once and print estimate against measurement (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default=None, help="a shipped study or a .json (default: tiny)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", default="2")
    parser.add_argument("--max-hours", default="1000")
    parser.add_argument("--extra", default="", help="more sweep arguments, one string")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lmc_study_plan_") as tmp:
        root = Path(tmp)
        study = args.study or str(tiny_study(root))
        out = root / "out"
        command = [
            sys.executable, "-m", "lm_coupling", "sweep", "--study", study,
            "--device", args.device, "--limit", args.limit, "--max-hours", args.max_hours,
            "--output_path", str(out), "--no-report", "--quiet", *shlex.split(args.extra),
        ]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
        done = subprocess.run(command, env=env, text=True, capture_output=True)
        print(done.stdout)
        if done.returncode not in (0, 1):
            raise SystemExit(done.stderr[-3000:])
        plan = json.loads((out / "sweep_plan.json").read_text())
        status = pd.read_csv(out / "sweep_status.csv", keep_default_na=False)
    measured = {(r.model, str(r.revision)): float(r.seconds) for r in status.itertuples()}
    rows = []
    for model in plan["models"]:
        key = (model["model"], model["revision"])
        ran = measured.get(key, float("nan"))
        rows.append([f"{model['model']}@{model['revision']}".rstrip("@"), model["documents"],
                     model["coupled"], f"{model['estimated_s']:.1f}", f"{ran:.1f}",
                     f"{model['estimated_s'] / ran:.2f}"])  # fmt: skip
    total = sum(measured.get((m["model"], m["revision"]), 0.0) for m in plan["models"])
    rows.append(["total", "", "", f"{plan['total_s']:.1f}", f"{total:.1f}",
                 f"{plan['total_s'] / total:.2f}"])  # fmt: skip
    print(machine_line(args.device))
    header = ("model", "documents", "coupled", "estimated s", "measured s", "est/measured")
    print_table("--plan against the measured run", header, rows)


if __name__ == "__main__":
    main()
