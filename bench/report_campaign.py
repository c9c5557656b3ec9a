"""Time the report on a campaign-sized results folder: 50 models x 10 tasks (synthetic).

The folder is built as the report tests build theirs (``tests/report/make_results.py``):
one real ``lm_eval`` run of a tiny model on a local multiple-choice task, then
clones of its files with the identity, shape, scores and geometry of each of
``--models`` rows, the task entry repeated under ``--tasks`` task names (the
first two are ARC-Challenge and HellaSwag in the Open LLM v1 setting), with a
geometry file per task. Then it times:

* ``lm-coupling report`` (`build_report`) with the default figure formats (PNG)
  and per-model figures (``auto``: none above 12 model rows), with ``--svg``
  PNG and SVG, and with ``--all-figures`` every per-model figure
  (``--per-model-figures all``);
* the leaderboard written after every run (`refresh_leaderboard`, the whole
  table rebuilt from the folder) on a folder of ``--models`` rows, first,
  again with nothing changed, then after one more run (what the next run of
  a campaign pays); ``--refresh-sizes 10,50,100`` times only the leaderboard,
  on folders of each size: the median CPU seconds of ``--repeats`` rebuilds
  after one more run, in one table.

A ``--keep`` folder is reused: its real run (``real/runs``) is not run again.

Usage::

    python bench/report_campaign.py                 # 50 x 10, PNG
    python bench/report_campaign.py --svg --keep /tmp/campaign
    python bench/report_campaign.py --keep /tmp/campaign --refresh-sizes 10,50,100
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "tests"))  # fixtures.tiny, which make_results uses
sys.path.insert(0, str(HERE.parents[0] / "tests" / "report"))

import make_results as mr  # noqa: E402
from timing import machine_line  # noqa: E402


def campaign_rows(template_run: Path, n_models: int) -> list[dict]:
    """``n_models`` rows of growing size and quality, cloned from one real run."""
    results, _ = mr._read_run(template_run)
    rows = []
    for i in range(n_models):
        q = (i + 0.5) / n_models
        d_model, n_layers = 32 + 16 * (i % 5), 2 + i % 4
        rows.append(
            dict(
                run=template_run,
                model=str(Path(results["config"]["model_args"]["pretrained"]).parent / f"m{i:03d}"),
                name=f"m{i:03d}",
                revision="main",
                d_model=d_model,
                n_layers=n_layers,
                n_params=mr._n_params(d_model, n_layers),
                q=q,
                acc_norm=min(1.0, 0.2 + 0.6 * q),
            )
        )
    return rows


def write_campaign(dest: Path, template_run: Path, n_models: int, n_tasks: int) -> Path:
    """Write ``n_models`` rows of ``n_tasks`` tasks each into ``dest``."""
    extra = [f"lmc_campaign_task_{j}" for j in range(max(0, n_tasks - 2))]
    for i, row in enumerate(campaign_rows(template_run, n_models)):
        stamp = f"2025-02-{1 + i // 24:02d}T{i % 24:02d}-00-00.000000"
        folder = mr.write_row(dest, row["run"], row, stamp)
        add_tasks(folder, stamp, row, extra)
    return dest


def add_tasks(folder: Path, stamp: str, row: dict, tasks: list[str]) -> None:
    """Repeat the row's task entry under ``tasks`` (results, configs, geometry files)."""
    path = folder / f"results_{stamp}.json"
    results = json.loads(path.read_text())
    entry = results["results"][mr.TASK]
    for j, task in enumerate(tasks):
        results["results"][task] = dict(
            copy.deepcopy(entry), alias=task, name=task,
            **{"acc_norm,none": min(1.0, row["q"] * (0.5 + 0.05 * j))},
        )  # fmt: skip
        results["higher_is_better"][task] = dict(results["higher_is_better"][mr.TASK])
        results["configs"][task] = dict(results["configs"][mr.TASK], task=task, num_fewshot=0)
        results["n-shot"][task] = 0
        geo = json.loads((folder / f"geometry_{mr.TASK}_{stamp}.json").read_text())
        (folder / f"geometry_{task}_{stamp}.json").write_text(json.dumps(dict(geo, task=task)))
    path.write_text(json.dumps(results))


def real_runs(work: Path) -> list[Path]:
    """The real lm_eval runs under ``work/real`` (made once, then reused)."""
    found = sorted(p.parent for p in (work / "real" / "runs").rglob("results_*.json"))
    return found or mr.run_lm_eval(work / "real")


def refresh_sizes(work: Path, sizes: list[int], n_tasks: int, repeats: int = 3) -> None:
    """Time the leaderboard after one more run on folders of each size.

    Each size: the first build, one with nothing changed, then ``repeats``
    times one more run added, the leaderboard rebuilt and the run taken away
    again (median CPU seconds printed).
    """
    from lm_coupling.harness.outputs import refresh_leaderboard

    rows = []
    for size in sizes:
        folder = work / f"refresh_{size}"
        if not folder.exists():
            write_campaign(folder, real_runs(work)[0], size, n_tasks)
        timed(f"{size} models: refresh, first", lambda f=folder: refresh_leaderboard(f))
        timed(f"{size} models: refresh, nothing changed", lambda f=folder: refresh_leaderboard(f))
        cpu = [one_more(folder, refresh_leaderboard, f"{size} models: ") for _ in range(repeats)]
        rows.append((size, statistics.median(cpu)))
    print("models | leaderboard after one more run, median CPU s")
    for size, cpu in rows:
        print(f"{size:6d} | {cpu:.3f}")


def one_more(folder: Path, refresh, prefix: str = "") -> float:
    """Add one more run to ``folder``, time ``refresh(folder)``, take the run away again (CPU s)."""
    source = next(iter(sorted(folder.glob("m*__main"))))
    stamp_file = next(source.glob("results_*.json"))
    copy_dir = folder / "m999__main"
    if copy_dir.exists():
        shutil.rmtree(copy_dir)
    shutil.copytree(source, copy_dir)
    results = json.loads(stamp_file.read_text())
    results["config"]["model_args"]["pretrained"] += "-next"
    (copy_dir / stamp_file.name).write_text(json.dumps(results))
    cpu = timed(prefix + "leaderboard refresh after one more run", lambda: refresh(folder))
    shutil.rmtree(copy_dir)
    refresh(folder)  # the folder as it was (not timed)
    return cpu


def timed(label: str, call) -> float:
    """Run ``call`` once with its warnings silenced; print its wall and CPU seconds (CPU back)."""
    start, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"  {label}: wall {seconds:.2f} s, CPU {cpu:.2f} s", flush=True)
    return cpu


def main(argv=None) -> None:
    """Build the folder, time the report and the refresh, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=50)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--svg", action="store_true", help="also time PNG + SVG figures")
    parser.add_argument("--keep", type=Path, default=None, help="build (or reuse) the folder here")
    parser.add_argument(
        "--all-figures", action="store_true", help="also time --per-model-figures all"
    )
    parser.add_argument(
        "--refresh-sizes", default="", help="comma list of folder sizes: time only the refresh"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="one-more-run refreshes per size (median)"
    )
    args = parser.parse_args(argv)
    from lm_coupling.harness.outputs import refresh_leaderboard
    from lm_coupling.report.build import build_report

    work = args.keep or Path(tempfile.mkdtemp(prefix="lmc-campaign-"))
    print(machine_line("cpu"))
    if args.refresh_sizes:
        sizes = [int(n) for n in args.refresh_sizes.split(",")]
        refresh_sizes(work, sizes, args.tasks, args.repeats)
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        return
    folder = work / "results"
    if not folder.exists():
        write_campaign(folder, real_runs(work)[0], args.models, args.tasks)
    print(f"{args.models} models x {args.tasks} tasks in {folder}", flush=True)
    takes_formats = "figure_formats" in inspect.signature(build_report).parameters
    report = lambda formats: (  # noqa: E731
        build_report(folder, out_dir=work / "report", figure_formats=formats)
        if takes_formats
        else build_report(folder, out_dir=work / "report")
    )
    timed("report, default figure formats" + ("" if takes_formats else " (PNG+SVG)"),
          lambda: report("png"))  # fmt: skip
    if args.svg and takes_formats:
        timed("report, PNG and SVG", lambda: report("png,svg"))
    if args.all_figures:
        timed(
            "report, every per-model figure (PNG)",
            lambda: build_report(folder, out_dir=work / "report", per_model_figures="all"),
        )
    timed("leaderboard refresh, first", lambda: refresh_leaderboard(folder))
    timed("leaderboard refresh, nothing changed", lambda: refresh_leaderboard(folder))
    one_more(folder, refresh_leaderboard)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
