"""Precision of a task's coupling mean against ``coupling_docs``, on the bundled model.

Measures ``coupling`` on every document of two tasks from the bundled items
(all 50 ARC-Easy-format items of every split, and the first ``--gsm8k`` of
the 30 GSM8K-format test items, none by default: slow on a shared CPU),
then, for each sample size n, gives the standard error of the task's
coupling mean over a sample of n documents:

* ``se_formula``: ``s / sqrt(n) * sqrt((N - n) / (N - 1))`` (simple random
  sampling without replacement from N documents, s the documents' standard
  deviation);
* ``se_drawn``: the standard deviation of the sample mean over ``--seeds``
  samples drawn the way a run draws them (`lm_coupling.harness.sample`:
  seeded, stratified by the gold answer), around the all-document mean.

The figure in docs/metrics.md was measured on all 96 ARC-Easy-format items
of the demo world, which the deleted generator of commit 5139ea0 wrote
(``lm_coupling/demo/assets/PROVENANCE.md``).

Writes the figure ``docs/sample_precision.png`` (or ``--figure``), its table
beside it (``.csv``) and prints the table.

Usage::

    python bench/sample_precision.py
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
from pathlib import Path

from timing import machine_line

SIZES = (2, 5, 10, 15, 25, 40, 50, 75, 100, 150, 200)


def write_items(folder: Path, n_gsm8k: int) -> None:
    """The bundled ARC-Easy items (every split, as the test split) and GSM8K's first ``n_gsm8k``.

    The few-shot splits stay as they are, so some items are also few-shot examples.
    """
    from lm_coupling.demo.assets import bundled_tasks_data_path

    bundled = bundled_tasks_data_path()
    for benchmark, count in (("arc_easy", None), ("gsm8k", n_gsm8k)):
        if count == 0:
            continue
        target = folder / benchmark
        target.mkdir(parents=True)
        rows = []
        for path in sorted((bundled / benchmark).glob("*.jsonl")):
            rows += path.read_text(encoding="utf-8").splitlines() if benchmark == "arc_easy" else []
            if path.stem != "test":
                shutil.copy(path, target / path.name)
        if benchmark == "gsm8k":
            rows = (bundled / benchmark / "test.jsonl").read_text(encoding="utf-8").splitlines()
        (target / "test.jsonl").write_text("\n".join(rows[:count]) + "\n", encoding="utf-8")


def coupling_values(data_dir: Path, out: Path, tasks: list[str]) -> dict[str, dict]:
    """``{task: {doc_id: (coupling, gold)}}`` from one run with ``coupling_docs=all``."""
    import lm_coupling
    from lm_coupling.demo.assets import bundled_model_path

    results = lm_coupling.evaluate(
        model_args={"pretrained": str(bundled_model_path()), "dtype": "float32"},
        tasks=tasks,
        metrics="coupling",
        metric_args={"coupling_docs": "all"},
        batch_size=8,
        device="cpu",
        output_path=str(out),
        log_samples=True,
        metadata={"lmc_data_dir": str(data_dir)},
    )
    return {
        task: {
            row["doc_id"]: (row["coupling"], row.get("target"))
            for row in rows
            if math.isfinite(row.get("coupling", math.nan))
        }
        for task, rows in results["samples"].items()
    }


def precision_table(values: dict[int, tuple[float, object]], task: str, seeds: int) -> list[dict]:
    """Per sample size: the formula's and the drawn samples' standard error."""
    from lm_coupling.harness.sample import drawing_order

    ids = sorted(values)
    x = {d: values[d][0] for d in ids}
    strata = [str(values[d][1]) for d in ids] if "arc" in task else None
    big_n = len(ids)
    mean = statistics.fmean(x.values())
    s = statistics.stdev(x.values())
    orders = [drawing_order(ids, strata, seed, task) for seed in range(seeds)]
    rows = []
    for n in (size for size in SIZES if size < big_n):
        means = [statistics.fmean(x[d] for d in order[:n]) for order in orders]
        drawn = math.sqrt(statistics.fmean((m - mean) ** 2 for m in means))
        formula = s / math.sqrt(n) * math.sqrt((big_n - n) / (big_n - 1))
        rows.append({"task": task, "N": big_n, "n": n, "mean": mean, "sd": s,
                     "se_formula": formula, "se_drawn": drawn})  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Standard error of the coupling mean against n, one colour per task."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, task in enumerate(sorted({r["task"] for r in rows})):
        part = [r for r in rows if r["task"] == task]
        label = f"{task} (N={part[0]['N']}, sd={part[0]['sd']:.3f})"
        ax.plot([r["n"] for r in part], [r["se_formula"] for r in part], "-", color=f"C{i}",
                label=f"{label}: s/sqrt(n), finite population")  # fmt: skip
        ax.plot([r["n"] for r in part], [r["se_drawn"] for r in part], "o", color=f"C{i}",
                label=f"{task}: {part[0]['seeds']} seeded draws")  # fmt: skip
    ax.axvline(25, color="grey", linestyle=":", label="default coupling_docs=25")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([n for n in SIZES if n <= max(r["n"] for r in rows)])
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("coupling_docs (documents in the sample)")
    ax.set_ylabel("standard error of the task's coupling mean")
    ax.set_title("Coupling sample precision, bundled demo model", fontsize=10)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    """Measure, print the table, write the figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", type=int, default=0, help="GSM8K items (0: none)")
    parser.add_argument("--seeds", type=int, default=500)
    default_figure = Path(__file__).resolve().parents[1] / "docs" / "sample_precision.png"
    parser.add_argument("--figure", type=Path, default=default_figure)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        write_items(Path(tmp) / "data", args.gsm8k)
        tasks = ["lmc_arc_easy_offline"] + ["lmc_gsm8k_offline"] * bool(args.gsm8k)
        values = coupling_values(Path(tmp) / "data", Path(tmp) / "out", tasks)
    rows = []
    for task, task_values in sorted(values.items()):
        for row in precision_table(task_values, task, args.seeds):
            rows.append({**row, "seeds": args.seeds})
    print(machine_line("cpu"))
    print(f"{'task':24} {'N':>4} {'n':>4} {'mean':>7} {'sd':>6} {'se_formula':>10} {'se_drawn':>9}")
    for r in rows:
        print(f"{r['task']:24} {r['N']:4d} {r['n']:4d} {r['mean']:7.4f} {r['sd']:6.4f} "
              f"{r['se_formula']:10.4f} {r['se_drawn']:9.4f}")  # fmt: skip
    plot(rows, args.figure)
    table = args.figure.with_suffix(".csv")
    columns = ["task", "N", "n", "mean", "sd", "se_formula", "se_drawn", "seeds"]
    lines = [",".join(columns)] + [",".join(str(r[c]) for c in columns) for r in rows]
    table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.figure} and {table}")


if __name__ == "__main__":
    main()
