"""Layer by Layer and the Jacobian lens over training, beside coupling and the logit lens.

Evaluates every checkpoint of one size of the trained family (docs/family.md)
on its held-out ARC-Easy items (``lmc_arc_easy_offline``, 2-shot as in the
``lmc_demo`` group) with, in one run per checkpoint, the Layer by Layer
measures, the Jacobian lens (fitted on the checkpoint's own prompts in the
run), the logit lens and coupling; writes one CSV row per checkpoint and a
figure of each measure over training, titled with its Pearson r with ARC
acc_norm across the checkpoints.

The checkpoints are one training run, not independent models: r describes how
the measures move together over training, it is not a test (no p-value).

    python bench/train_family.py --out /tmp/fam --sizes tiny  # from git: docs/family.md
    python bench/family_layer_measures.py --family /tmp/fam --size tiny \
        --csv docs/family/layer_measures.csv --figure docs/family/layer_measures.png

``--independent`` measures the five independently trained bundled models
instead (``lm_coupling/demo/assets``: the bundled ``tiny-gpt2`` and the four
of ``models/``, on the bundled held-out items): independent training runs,
no training needed. The rows are then models, ordered by acc_norm.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import numpy as np

TASK = "lmc_arc_easy_offline"
SCORE = "acc_norm"
MEASURES = (
    "prompt_entropy",
    "curvature",
    "effective_rank",
    "dataset_entropy",
    "jlens_entropy",
    "jlens_tv_to_target",
    "logit_lens_entropy",
    "tv_to_target",
    "coupling",
)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default=None, help="a trained family folder")
    parser.add_argument("--independent", action="store_true", help="the bundled models")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--out", default=None, help="lm-eval outputs (default: FAMILY/layers)")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--figure", default=None)
    parser.add_argument("--docs", type=int, default=8, help="jlens_docs and coupling_docs")
    return parser.parse_args(argv)


def checkpoints(family: Path, size: str) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every checkpoint of ``size``, by step."""
    found = [(int(p.name.removeprefix("step")), p) for p in (family / size).glob("step*")]
    if not found:
        raise SystemExit(f"no checkpoint under {family / size}: train the family first")
    return sorted(found)


def measure(step_dir: Path, out: Path, data: Path, docs: int, task_manager) -> dict[str, float]:
    """One checkpoint's ARC acc_norm and measures (one lm-eval run)."""
    import lm_coupling

    results = lm_coupling.evaluate(
        model_args=f"pretrained={step_dir},dtype=float32",
        tasks=TASK,
        num_fewshot=2,
        metrics=",".join(MEASURES),
        metric_args=f"jlens_docs={docs},coupling_docs={docs}",
        batch_size=4,
        output_path=str(out),
        metadata={"lmc_data_dir": str(data)},
        task_manager=task_manager,
    )
    row = results["results"][TASK]
    return {name: float(row.get(f"{name},none", math.nan)) for name in (SCORE, *MEASURES)}


def pearson(x, y) -> float:
    """Pearson r over the finite pairs (NaN with fewer than 3 or a constant series)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3 or np.std(x[keep]) == 0 or np.std(y[keep]) == 0:
        return math.nan
    return float(np.corrcoef(x[keep], y[keep])[0, 1])


def draw(rows: list[dict], path: Path, size: str) -> None:
    """Each measure over training (log steps), or against acc_norm for independent models."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lm_coupling.report.labels import place_labels

    independent = len({r["step"] for r in rows}) == 1
    steps = np.array([r["step"] for r in rows]) + 1
    score = np.array([r[SCORE] for r in rows])
    names = (SCORE, *MEASURES)
    fig, axes = plt.subplots(2, 5, figsize=(17, 6.4), sharex=not independent)
    labelled = []  # (axes, xs, ys): labelled once the layout is fixed, clear of each other
    for ax, name in zip(axes.flat, names, strict=True):
        values = [r[name] for r in rows]
        color = "C3" if name == SCORE else "C0"
        if independent:  # independent models: each measure against the score
            ax.plot(score, values, "o", color=color)
            labelled.append((ax, score, values))
        else:
            ax.plot(steps, values, "o-", color=color)
            ax.set_xscale("log")
        r = pearson(values, [row[SCORE] for row in rows])
        ax.set_title(f"ARC {name}" if name == SCORE else f"{name}\nr with acc_norm = {r:+.2f}")
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel(f"ARC {SCORE}" if independent else "training step + 1")
    title = (
        "Five independently trained bundled models: held-out ARC-Easy (30 items, 2-shot)"
        if independent
        else f"Family '{size}': held-out ARC-Easy (30 items, 2-shot), one run per checkpoint "
        "(checkpoints of one training run: r is descriptive)"
    )
    fig.suptitle(title)
    fig.tight_layout()
    texts = [r["model"].removeprefix("gpt2-") for r in rows]
    for ax, xs, ys in labelled:  # the report's placement: no label on another or on a point
        place_labels(ax, xs, ys, texts, fontsize=6)
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    """Evaluate every checkpoint, then write the CSV and the figure."""
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.run import include_paths

    args = parse_args(argv)
    if args.independent:
        from lm_coupling.demo.assets import bundled_model_path, bundled_tasks_data_path

        bundled = bundled_model_path()
        others = sorted((bundled.parent / "models").glob("gpt2-*"))
        models = [(0, bundled), *((0, p) for p in others)]
        data, out = bundled_tasks_data_path(), Path(args.out or "/tmp/lmc-independent-layers")
    elif args.family:
        family = Path(args.family)
        models = checkpoints(family, args.size)
        data, out = family / "tasks_data", Path(args.out) if args.out else family / "layers"
    else:
        raise SystemExit("give --family DIR or --independent")
    task_manager = TaskManager(include_path=include_paths(None))  # indexed once
    rows = []
    for step, folder in models:
        start = time.perf_counter()
        values = measure(folder, out / folder.name, data, args.docs, task_manager)
        row = {"model": folder.name, "step": step, **values}
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.independent:
        rows.sort(key=lambda r: r[SCORE])
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    for name in MEASURES:
        r = pearson([row[name] for row in rows], [row[SCORE] for row in rows])
        print(f"r({name}, {SCORE}) = {r:+.3f}")
    if args.figure:
        draw(rows, Path(args.figure), args.size)


if __name__ == "__main__":
    main()
