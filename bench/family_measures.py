"""The trained family's checkpoints through the Layer by Layer measures and the J-lens.

Evaluates each model with the five multiple-choice benchmarks of the demo
(``lmc_arc_challenge_offline``, ``lmc_hellaswag_offline``, ``lmc_mmlu_sample``,
``lmc_truthfulqa_mc2_offline``, ``lmc_winogrande_offline``; the demo's shots)
in three ``lm_coupling.evaluate`` runs, the J-lens's fit-then-read route of
docs/metrics.md:

1. ``coupling,logit_lens_entropy,prompt_entropy,curvature,effective_rank,
   dataset_entropy`` on the five tasks;
2. ``jlens_fit`` on the first ``--jlens-docs`` documents of ARC-Challenge
   (its own output folder, so that the report does not mix it in);
3. ``jlens_entropy`` on the five tasks, read through that lens.

It writes one row per model to ``<out>/family_measures.csv`` (score: the mean
of the five benchmarks' leaderboard metrics, docs/family.md; each measure:
the mean over the seven measured tasks, MMLU's three subjects each, of its
per-task value; ``dataset_entropy`` from the geometry files, over the task's
``--limit`` documents), every value read back from the output files, and
draws ``--figure``: each measure against training step per size and, beside
it, against the score. Checkpoints of one run are not independent samples, so
the figure and the CSV give no p-values across checkpoints.

python bench/family_measures.py --family results/family --sizes tiny --steps 0 8 70 \\
    --model lm_coupling/demo/assets/tiny-gpt2=tiny:1200 --limit 4 \\
    --out results/family_measures --figure docs/family/measures.png \\
    --table docs/family/measures.csv
python bench/family_measures.py --out results/family_measures --plot-only  # redraw
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import time
from pathlib import Path

TASKS = [
    "lmc_arc_challenge_offline",
    "lmc_hellaswag_offline",
    "lmc_mmlu_sample",
    "lmc_truthfulqa_mc2_offline",
    "lmc_winogrande_offline",
]
# Leaderboard metric of each benchmark (lm_coupling.report.benchmarks).
SCORES = {
    "lmc_arc_challenge_offline": "acc_norm,none",
    "lmc_hellaswag_offline": "acc_norm,none",
    "lmc_mmlu_sample": "acc,none",
    "lmc_truthfulqa_mc2_offline": "acc,none",
    "lmc_winogrande_offline": "acc,none",
}
GEOMETRY_TASKS = [t for t in TASKS if t != "lmc_mmlu_sample"] + [
    "lmc_mmlu_offline_astronomy",
    "lmc_mmlu_offline_elementary_mathematics",
    "lmc_mmlu_offline_high_school_biology",
]
MEASURE_METRICS = (
    "coupling,logit_lens_entropy,prompt_entropy,curvature,effective_rank,dataset_entropy"
)
LENS_TASK = "lmc_arc_challenge_offline"
# (column, label with unit), in the figure's order.
MEASURES = [
    ("coupling", "coupling (K=10)"),
    ("logit_lens_entropy", "logit-lens entropy (/ ln V)"),
    ("jlens_entropy", "J-lens entropy (/ ln V)"),
    ("prompt_entropy", "prompt entropy (nats)"),
    ("curvature", "curvature (rad)"),
    ("effective_rank", "effective rank"),
    ("dataset_entropy", "dataset entropy (nats)"),
]
FIELDS = ["model", "size", "step", "kind", "score", *[m for m, _ in MEASURES], "seconds"]


def parse_model(spec: str) -> tuple[Path, str, int, str]:
    """``PATH=SIZE:STEP[:KIND]`` -> (path, size, step, kind)."""
    path, _, label = spec.partition("=")
    parts = label.split(":")
    if len(parts) < 2:
        raise SystemExit(f"--model {spec!r}: write PATH=SIZE:STEP[:KIND]")
    return Path(path), parts[0], int(parts[1]), parts[2] if len(parts) > 2 else "checkpoint"


def _value(results: dict, task: str, metric: str) -> float:
    row = results["results"].get(task, {})
    for key, value in row.items():
        if key.split(",")[0] == metric and "_stderr" not in key:
            return float(value)
    return math.nan


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def dataset_entropy(folder: Path) -> float:
    """Mean over the geometry tasks of the newest geometry file's ``dataset_entropy``."""
    values = []
    for task in GEOMETRY_TASKS:
        files = sorted(glob.glob(str(folder / f"geometry_{task}_*.json")))
        for path in reversed(files):
            section = json.loads(Path(path).read_text()).get("dataset_entropy")
            if section:
                values.append(float(section["value"]))
                break
    return _mean(values)


def task_values(folder: Path) -> dict[tuple[str, str], float]:
    """(task, metric) -> value from the model's ``results_*.json``, the newest file winning."""
    values: dict[tuple[str, str], float] = {}
    for path in sorted(glob.glob(str(folder / "results_*.json"))):
        for task, row in json.loads(Path(path).read_text())["results"].items():
            for key, value in row.items():
                metric = key.split(",")[0]
                if "_stderr" not in metric and isinstance(value, (int, float)):
                    values[(task, metric)] = float(value)
    return values


def model_row(folder: Path) -> dict[str, float]:
    """The score and the mean over the tasks of each measure, from the model's output folder."""
    values = task_values(folder)
    row = {"score": _mean([values.get((t, m.split(",")[0]), math.nan) for t, m in SCORES.items()])}
    for metric, _ in MEASURES:
        row[metric] = _mean([values.get((t, metric), math.nan) for t in GEOMETRY_TASKS])
    row["dataset_entropy"] = dataset_entropy(folder)
    return row


def evaluate_model(path: Path, out: Path, limit: int, jlens_docs: int, data: Path, index) -> float:
    """The three runs of one model (see the module docstring); returns their seconds."""
    from lm_eval.utils import sanitize_model_name

    from lm_coupling.harness.evaluate import evaluate

    common = {
        "model": "hf",
        "model_args": f"pretrained={path},dtype=float32",
        "tasks": ",".join(TASKS),
        "batch_size": 4,
        "device": "cpu",
        "output_path": str(out),
        "limit": limit,
        "metadata": {"lmc_data_dir": str(data)},
        "task_manager": index,
    }
    lens_dir = out / "lenses" / sanitize_model_name(str(path))
    start = time.perf_counter()
    evaluate(metrics=MEASURE_METRICS, **common)
    evaluate(
        metrics="jlens_fit",
        metric_args=f"jlens_docs={jlens_docs},jlens_save={lens_dir}",
        **{**common, "tasks": LENS_TASK, "output_path": str(out / "lens_fit")},
    )
    evaluate(
        metrics="jlens_entropy",
        metric_args=f"jlens_path={lens_dir / f'jlens_{LENS_TASK}.pt'}",
        **common,
    )
    return time.perf_counter() - start


def read_rows(csv_path: Path) -> list[dict]:
    if not csv_path.exists():
        return []
    with open(csv_path, newline="") as handle:
        return list(csv.DictReader(handle))


def write_rows(csv_path: Path, rows: list[dict]) -> None:
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def draw(rows: list[dict], figure: Path, note: str) -> None:
    """Each measure over training per size, and against the score, side by side."""
    import matplotlib.pyplot as plt

    columns = ["score", *[m for m, _ in MEASURES]]
    labels = {"score": "score (mean of 5 benchmarks)", **dict(MEASURES)}
    n_rows = math.ceil(len(columns) / 2)
    fig, axes = plt.subplots(n_rows, 4, figsize=(11, 2.35 * n_rows + 0.8))
    styles = {"tiny": ("C0", "o"), "small": ("C1", "s")}
    checkpoints = [r for r in rows if r["kind"] == "checkpoint"]
    independent = [r for r in rows if r["kind"] != "checkpoint"]
    for i, column in enumerate(columns):
        over, against = axes[i // 2, 2 * (i % 2)], axes[i // 2, 2 * (i % 2) + 1]
        for size in sorted({r["size"] for r in checkpoints}):
            run = sorted((r for r in checkpoints if r["size"] == size), key=lambda r: r["step"])
            colour, marker = styles.get(size, ("C2", "^"))
            values = [r[column] for r in run]
            scores = [r["score"] for r in run]
            steps = [r["step"] + 1 for r in run]
            for k in range(len(run) - 1):  # dotted across a gap of unmeasured checkpoints
                style = ":" if steps[k + 1] / steps[k] > 3 else "-"
                over.plot(steps[k : k + 2], values[k : k + 2], style, color=colour)
                against.plot(scores[k : k + 2], values[k : k + 2], style, color=colour, lw=0.6)
            over.plot(steps, values, marker, color=colour, ms=4)
            against.plot(
                scores, values, marker, color=colour, ms=4, label=f"{size}: checkpoints of one run"
            )
            for r in run:
                against.annotate(
                    str(r["step"]),
                    (r["score"], r[column]),
                    fontsize=6,
                    xytext=(2, 2),
                    textcoords="offset points",
                )
        if independent:
            against.scatter(
                [r["score"] for r in independent],
                [r[column] for r in independent],
                marker="D",
                color="C3",
                s=16,
                zorder=3,
                label="independent runs (last step)",
            )
        over.set_xscale("log")
        over.set_ylabel(labels[column], fontsize=8)
        against.set_ylabel(labels[column], fontsize=8)
        for axis in (over, against):
            axis.tick_params(labelsize=7)
            axis.grid(alpha=0.3)
        if i // 2 == n_rows - 1 or i + 2 >= len(columns):
            over.set_xlabel("training step + 1 (log)", fontsize=8)
            against.set_xlabel("score (mean of 5 benchmarks)", fontsize=8)
    for j in range(len(columns), 2 * n_rows):
        axes[j // 2, 2 * (j % 2)].axis("off")
        axes[j // 2, 2 * (j % 2) + 1].axis("off")
    handles, names = axes[0, 3].get_legend_handles_labels()
    axes[0, 1].clear()
    axes[0, 1].axis("off")
    axes[0, 1].legend(handles, names, loc="center", fontsize=8, frameon=False)
    fig.suptitle(
        "Trained family: each measure over training (left of each pair) and against the "
        "score (right). Checkpoints of one run are not independent samples: no p-values."
        + (f"\n{note}" if note else ""),
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.965 if note else 0.98))
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=150)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", type=Path, help="family folder (<size>/step<N>, tasks_data)")
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", nargs="+", type=int, default=[0, 8, 70, 291, 1200])
    parser.add_argument("--model", action="append", default=[], help="PATH=SIZE:STEP[:KIND]")
    parser.add_argument("--data", type=Path, help="tasks_data folder (default: the family's)")
    parser.add_argument("--limit", type=int, default=4, help="documents per task")
    parser.add_argument("--jlens-docs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/family_measures"))
    parser.add_argument("--figure", type=Path, default=Path("docs/family/measures.png"))
    parser.add_argument("--note", default="", help="second title line (limit, load, time)")
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--table", type=Path, help="also write the rows here, short names")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "family_measures.csv"
    rows = read_rows(csv_path)
    if not args.plot_only:
        from lm_coupling.demo.outputs import shared_task_index

        models = [parse_model(spec) for spec in args.model]
        if args.family:
            models = [
                (args.family / size / f"step{step}", size, step, "checkpoint")
                for size in args.sizes
                for step in args.steps
                if (args.family / size / f"step{step}" / "config.json").exists()
            ] + models
        data = args.data or (args.family / "tasks_data" if args.family else None)
        if data is None:
            raise SystemExit("give --family or --data (the held-out tasks_data folder)")
        index = shared_task_index()
        done = {row["model"] for row in rows}
        for path, size, step, kind in models:
            if str(path) in done:
                continue
            seconds = evaluate_model(path, args.out, args.limit, args.jlens_docs, data, index)
            row = {"model": str(path), "size": size, "step": step, "kind": kind}
            rows.append({**row, "seconds": round(seconds, 1)})
            write_rows(csv_path, rows)
            print(f"{size} step {step} ({kind}): {seconds:.0f} s", flush=True)
    from lm_eval.utils import sanitize_model_name

    for row in rows:  # every value from the output files: a rerun refreshes them
        row.update(model_row(args.out / sanitize_model_name(row["model"])))
    write_rows(csv_path, rows)
    typed = [
        {
            **row,
            "step": int(row["step"]),
            **{k: float(row[k]) for k in FIELDS if k not in ("model", "size", "step", "kind")},
        }
        for row in rows
    ]
    draw(typed, args.figure, args.note)
    print(args.figure)
    if args.table:
        write_table(typed, args.table)
    return 0


def short_name(model: str) -> str:
    """``.../tiny/step70`` -> ``tiny/step70``; another model -> its folder's name."""
    path = Path(model)
    return f"{path.parent.name}/{path.name}" if path.name.startswith("step") else path.name


def write_table(rows: list[dict], csv_path: Path) -> None:
    """Write the rows with short model names to ``csv_path``; print them as a Markdown table."""
    ordered = sorted(rows, key=lambda r: (r["kind"] != "checkpoint", r["size"], r["step"]))
    shown = [{**r, "model": short_name(r["model"])} for r in ordered]
    write_rows(csv_path, shown)
    for r in shown:
        cells = [f"{r[m]:.3f}" if m != "effective_rank" else f"{r[m]:.1f}" for m, _ in MEASURES]
        print(f"| {r['model']} | {r['step']} | {r['score']:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
