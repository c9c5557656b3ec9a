"""Build realistic results folders for the report tests.

The lm-eval files are real: `run_lm_eval` runs the real ``lm_eval`` command
line (once per tiny model, three models of different sizes) on a local
multiple-choice task with ``--log_samples``.

GEOMETRY IS ADDED HERE, NOT MEASURED: when these tests were written the
lm-eval integration (``--metrics``) was not yet available, so `add_geometry`
writes the geometry entries a ``--metrics`` run would write (metric values in
the results JSON and the samples JSONL, ``config["lm_coupling"]`` with the
catalogue of the metrics as the harness records it, and
``geometry_<task>_<timestamp>.json`` following docs/outputs.md), computed
deterministically from each row's shape and scores with a seeded generator.
``catalogue=False`` writes the results file of the previous release, without
a catalogue.
Once ``--metrics`` works, switch `run_lm_eval` to pass ``--metrics all`` and
drop `add_geometry`.

SETTINGS ARE DECLARED, NOT RUN: `write_row` writes lm-eval's ``n-shot`` and
``configs[task].num_fewshot`` of the Open LLM v1 setting for the benchmark
tasks (ARC 25-shot, HellaSwag 10-shot: the tiny task has 24 documents, too
few to draw 25 examples from), so that the rows fill the benchmark columns.
The settings tests run real ``--num_fewshot``/``--limit`` runs instead
(`run_settings_runs`).

Extra rows (revisions ``step1000``, ``checkpoint-2000``, ``step_3000`` of
the first model and three larger shapes) are clones of the real files with
their identity, shape and scores replaced, so that the across-model statistics
and the size controls have enough models.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
from fixtures.tiny import save_tiny_model

from lm_coupling.catalogue import CONFIG_KEY, Catalogue
from lm_coupling.plugins.manager import get_registry

TASK = "lmc_arc_challenge_offline"
EXTRA_TASK = "lmc_hellaswag_offline"
OPEN_LLM_SHOTS = {TASK: 25, EXTRA_TASK: 10}
N_DOCS = 24
REAL_MODELS = [
    dict(name="tiny-a", d_model=32, n_layers=2, seed=1),
    dict(name="tiny-b", d_model=48, n_layers=3, seed=2),
    dict(name="tiny-c", d_model=64, n_layers=4, seed=3),
]
CLONES = [
    dict(base=0, name=None, revision="step1000", q=0.15),
    dict(base=0, name=None, revision="checkpoint-2000", q=0.35),
    dict(base=0, name=None, revision="step_3000", q=0.55),
    dict(base=1, name="tiny-d", d_model=96, n_layers=6, q=0.65),
    dict(base=2, name="tiny-e", d_model=128, n_layers=2, q=0.8),
    dict(base=2, name="tiny-f", d_model=80, n_layers=8, q=0.9),
]
WORDS = ["star", "planet", "moon", "rock", "water", "light", "salt", "roof", "cloud", "sea"]


def write_task(folder: Path) -> Path:
    """A local ARC-style multiple-choice task (YAML + JSONL) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(folder / "data.jsonl", "w") as fh:
        for i in range(N_DOCS):
            choices = [str(w) for w in rng.choice(WORDS, size=4, replace=False)]
            fh.write(
                json.dumps(
                    dict(
                        question=f"Item {i}: which is a {choices[0]}?",
                        choices=choices,
                        answer=int(rng.integers(4)),
                    )
                )
                + "\n"
            )
    (folder / "task.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'data.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: answer\n'
        "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
        "metadata:\n  version: 1.0\n"
    )
    return folder


def _offline_env() -> dict[str, str]:
    """The environment of the lm_eval runs: offline, one thread each (they run in parallel)."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )


def run_lm_eval(root: Path) -> list[Path]:
    """Run the real lm_eval CLI once per tiny model (in parallel); return the run folders."""
    tasks = write_task(root / "task")
    env = _offline_env()
    procs = []
    for spec in REAL_MODELS:
        model = save_tiny_model(
            root / "models" / spec["name"],
            "gpt2",
            seed=spec["seed"],
            d_model=spec["d_model"],
            n_layers=spec["n_layers"],
        )
        cmd = [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={model},dtype=float32",
            "--tasks",
            TASK,
            "--include_path",
            str(tasks),
            "--output_path",
            str(root / "runs"),
            "--log_samples",
            "--device",
            "cpu",
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode:
            raise RuntimeError(f"lm_eval failed:\n{out[-3000:]}")
    return sorted(p.parent for p in (root / "runs").rglob("results_*.json"))


def _n_params(d_model: int, n_layers: int, vocab: int = 512) -> int:
    return 12 * n_layers * d_model**2 + vocab * d_model + 512 * d_model


def _profiles(rng, n_layers: int, q: float) -> dict:
    layers = np.arange(n_layers + 1) / n_layers
    entropy = (
        0.9 - 0.6 * q / (1 + np.exp(-10 * (layers - 0.5))) + rng.normal(0, 0.005, n_layers + 1)
    )
    tv = np.clip(entropy + 0.05, 0, 1)
    norm = np.exp(1.0 + layers) + rng.normal(0, 0.01, n_layers + 1)
    wlss = 1.5 - 0.3 * q + rng.normal(0, 0.01, n_layers)
    out = {}
    for name, mean in (
        ("norm", norm),
        ("windowed_lss", wlss),
        ("logit_lens_entropy", entropy),
        ("tv_to_target", tv),
    ):
        out[name] = dict(mean=mean.tolist(), stderr=[0.01] * len(mean), n=[N_DOCS] * len(mean))
    return out


def _values(rng, q: float) -> dict[str, float]:
    return dict(
        coupling=0.3 + 0.4 * q + rng.normal(0, 0.03),
        lss=2.0 - q + rng.normal(0, 0.1),
        expodistance=0.1 + 0.05 * rng.random(),
        equidistance=0.5 - 0.2 * q,
        logit_lens_entropy=0.8 - 0.3 * q + rng.normal(0, 0.02),
        tv_to_target=0.95 - 0.2 * q,
        fixation_depth=0.9 - 0.4 * q,
    )


GEOMETRY = list(_values(np.random.default_rng(0), 0.5))
"""The metrics whose values this module makes up (those of `_values`)."""


def _k_used(k: float, d_model: int) -> int:
    """The K the harness records: a fraction of d_model, an integer capped at d_model - 1."""
    k = max(1, math.floor(k * d_model)) if isinstance(k, float) else k
    return min(k, d_model - 1)


def add_geometry(
    folder: Path,
    results: dict,
    samples: list[dict],
    stamp: str,
    row: dict,
    metrics: list[str] = GEOMETRY,
    catalogue: bool = True,
) -> None:
    """Add geometry to a results dict and samples (in place) and write the geometry file.

    ``catalogue``: record the catalogue of ``metrics`` (of the installed
    plugins) in ``config.lm_coupling``, as runs do; False writes the
    previous release's results file, which has none.
    """
    rng = np.random.default_rng(zlib.crc32(f"{row['name']}@{row['revision']}".encode()))
    values = {m: v for m, v in _values(rng, row["q"]).items() if m in metrics}
    shape = dict(
        n_layers=row["n_layers"],
        d_model=row["d_model"],
        n_params=row["n_params"],
        vocab_size=512,
        model_type="gpt2",
    )
    asked = dict(row.get("options") or {"k": 4})
    options = dict(asked, k=_k_used(asked.get("k", 4), row["d_model"]))
    requested = {k: v for k, v in asked.items() if options[k] != v}
    results["config"]["lm_coupling"] = dict(
        version="0.1.0",
        metrics=metrics,
        options=options,
        options_requested=requested,
        model_shape=shape,
    )
    if catalogue:
        specs = get_registry().metrics
        recorded = Catalogue.from_specs(specs[m] for m in metrics).to_json()
        results["config"]["lm_coupling"][CONFIG_KEY] = recorded
    for task, entry in results["results"].items():
        for metric, value in values.items():
            entry[f"{metric},none"] = value
            entry[f"{metric}_stderr,none"] = 0.01
        results["higher_is_better"].setdefault(task, {}).update({m: True for m in values})
    for record in samples:
        for metric, value in values.items():
            record[metric] = value + 0.3 * record.get("acc_norm", 0) + rng.normal(0, 0.3)
    L = row["n_layers"]
    coupling = 0.3 + 0.4 * row["q"] + rng.normal(0, 0.05, (L, L))
    model = dict(
        name=row["model"],
        revision=row["revision"],
        dtype="float32",
        model_type="gpt2",
        **{k: shape[k] for k in ("n_layers", "d_model", "n_params", "vocab_size")},
    )
    for task in results["results"]:
        geo = dict(
            schema="lm_coupling.geometry/1",
            lm_coupling_version="0.1.0",
            task=task,
            model=model,
            options=options,
            metrics=metrics,
            n_documents=N_DOCS,
            n_measured={m: (4 if m == "coupling" else N_DOCS) for m in metrics},
            profiles=_profiles(rng, L, row["q"]),
            matrices=dict(coupling=dict(mean=coupling.tolist(), n=4)),
            coupling=dict(
                k=options["k"],
                norm="l1",
                elementwise_abs=False,
                pairs="offdiag",
                n_sampled=4,
                singular_values=[[1.0] * 5] * L,
                spectral_gap=[2.0] * L,
                method=["dense"] * L,
            ),
            failures=[],
        )
        if row.get("timings") is not None:
            geo["timings"] = row["timings"]
        (folder / f"geometry_{task}_{stamp}.json").write_text(json.dumps(geo))


def _read_run(run: Path) -> tuple[dict, list[dict]]:
    results = json.loads(next(run.glob("results_*.json")).read_text())
    lines = next(run.glob("samples_*.jsonl")).read_text().splitlines()
    return results, [json.loads(line) for line in lines if line.strip()]


def write_row(
    dest: Path,
    run: Path,
    row: dict,
    stamp: str,
    geometry: list[str] | None = GEOMETRY,
    samples: bool = True,
    catalogue: bool = True,
) -> Path:
    """Write one model row (a real run or a clone of one) into ``dest``; return its folder."""
    results, records = _read_run(run)
    results, records = copy.deepcopy(results), copy.deepcopy(records)
    cfg = results["config"]
    cfg["model_args"]["pretrained"] = row["model"]
    cfg["model_revision"] = row["revision"]
    cfg["model_num_parameters"] = row["n_params"]
    entry = results["results"][TASK]
    if row.get("acc_norm") is not None:
        entry["acc_norm,none"] = row["acc_norm"]
        results["results"][EXTRA_TASK] = dict(
            entry,
            alias=EXTRA_TASK,
            name=EXTRA_TASK,
            **{"acc_norm,none": row["acc_norm"] * 0.8 + 0.1},
        )
        results["higher_is_better"][EXTRA_TASK] = dict(results["higher_is_better"][TASK])
    for task, shots in (row.get("shots") or OPEN_LLM_SHOTS).items():
        if task in results["results"]:
            results["n-shot"][task] = shots
            results["configs"].setdefault(task, dict(results["configs"][TASK], task=task))
            results["configs"][task]["num_fewshot"] = shots
    folder = dest / f"{Path(row['model']).name}__{row['revision']}"
    folder.mkdir(parents=True, exist_ok=True)
    if geometry:
        add_geometry(folder, results, records, stamp, row, geometry, catalogue)
    results["date"] = 0.0
    (folder / f"results_{stamp}.json").write_text(json.dumps(results))
    if samples:
        text = "".join(json.dumps(r) + "\n" for r in records)
        (folder / f"samples_{TASK}_{stamp}.jsonl").write_text(text)
    return folder


def model_rows(runs: list[Path], n_models: int = 9) -> list[dict]:
    """The row specifications: the three real runs, then clones, ``n_models`` in all."""
    rows = []
    for run, spec in zip(runs, REAL_MODELS, strict=True):
        results, _ = _read_run(run)
        acc = results["results"][TASK]["acc_norm,none"]
        rows.append(
            dict(
                run=run,
                model=results["config"]["model_args"]["pretrained"],
                name=spec["name"],
                revision="main",
                d_model=spec["d_model"],
                n_layers=spec["n_layers"],
                n_params=results["config"]["model_num_parameters"],
                q=acc,
                acc_norm=None,
            )
        )
    for clone in CLONES:
        base = rows[REAL_MODELS.index(REAL_MODELS[clone["base"]])]
        row = dict(
            base,
            revision=clone.get("revision", "main"),
            q=clone["q"],
            acc_norm=min(1.0, 0.2 + 0.6 * clone["q"] + 0.05 * math.sin(7 * clone["q"])),
        )
        if clone["name"]:
            row.update(
                name=clone["name"],
                model=str(Path(base["model"]).parent / clone["name"]),
                d_model=clone["d_model"],
                n_layers=clone["n_layers"],
                n_params=_n_params(clone["d_model"], clone["n_layers"]),
            )
        rows.append(row)
    return rows[:n_models]


def make_results_dir(dest: Path, runs: list[Path], n_models: int = 9, **kwargs) -> Path:
    """A results folder with ``n_models`` rows, each with geometry and samples by default."""
    for i, row in enumerate(model_rows(runs, n_models)):
        write_row(dest, row["run"], row, f"2025-01-{i + 1:02d}T10-00-00.000000", **kwargs)
    return dest


def _lm_coupling_run(root: Path, model: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "lm_coupling", "run",
        "--model", "hf",
        "--model_args", f"pretrained={model},dtype=float32",
        "--tasks", TASK,
        "--include_path", str(root / "task"),
        "--output_path", str(out),
        "--device", "cpu",
        *extra,
    ]  # fmt: skip
    env = _offline_env()
    return subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_settings_runs(root: Path, real_root: Path) -> Path:
    """Real runs in different settings into ``root/runs`` (the models of `run_lm_eval`).

    - tiny-a, 0-shot, all documents, ``--metrics lss,coupling`` with ``k=100``;
    - tiny-a again, started after it: 2-shot, ``--limit 4``, no ``--metrics``
      (the rerun of the issue: newer score, other setting);
    - tiny-b (``d_model`` 48), 0-shot, ``--metrics lss,coupling`` with
      ``k=100``: the model runs at K = 47.
    """
    write_task(root / "task")
    models = real_root / "models"
    out = root / "runs"
    metrics = ("--metrics", "lss,coupling", "--metric_args", "k=100,coupling_docs=2")
    first = [
        _lm_coupling_run(root, models / "tiny-a", out, "--num_fewshot", "0", *metrics),
        _lm_coupling_run(root, models / "tiny-b", out, "--num_fewshot", "0", *metrics),
    ]
    outputs = [proc.communicate(timeout=900)[0] for proc in first]
    later = _lm_coupling_run(root, models / "tiny-a", out, "--num_fewshot", "2", "--limit", "4")
    outputs.append(later.communicate(timeout=900)[0])
    for proc, text in zip([*first, later], outputs, strict=True):
        if proc.returncode:
            raise RuntimeError(f"lm-coupling run failed:\n{text[-3000:]}")
    return out
