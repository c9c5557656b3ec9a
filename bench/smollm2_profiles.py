"""SmolLM2-135M's depth profiles against Table 1 of "Picking an LLM's Brain" (thought vs fixation).

Runs ``lm_coupling.evaluate`` on SmolLM2-135M-Instruct (GGUF Q4_1, fetched
with ``lm-coupling models fetch smollm2``) with every default metric and the
Layer by Layer profiles, writes the results, geometry files and the report's
figures to ``--out``, then reads the geometry files and prints, for each
Table 1 property, its value in the thought phase (layers before the
thought/fixation boundary the report places on the logit-lens entropy
profile, `lm_coupling.report.boundary`) and in the fixation phase (from it
on): linearity (windowed LSS, lower is straighter), alignment (the alignment
ratio of block pairs within the phase, lower is more aligned), confidence
(logit-lens entropy and TV to the target, lower is more confident), and the
Layer by Layer profiles beside them. Equidistance is a per-document value
(no per-layer profile is recorded), so it is printed for the whole depth.

Usage::

    python bench/smollm2_profiles.py --data-dir DIR --limit 20 --coupling-docs 3 --out OUT
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
from pathlib import Path

import numpy as np

METRICS = (
    "lss,expodistance,equidistance,logit_lens_entropy,tv_to_target,fixation_depth,coupling,"
    "alignment_ratio,prompt_entropy,effective_rank"
)


def run(out: Path, tasks: list[str], data_dir: str | None, limit: int, coupling_docs: int) -> None:
    """Evaluate SmolLM2 on ``tasks`` and build the report in ``out``."""
    import lm_coupling
    from lm_coupling.fetch import fetch
    from lm_coupling.report.build import build_report

    path = fetch("smollm2")
    lm_coupling.evaluate(
        model_args={"pretrained": str(path.parent), "gguf_file": path.name}, tasks=tasks,
        metrics=METRICS, metric_args={"coupling_docs": coupling_docs}, limit=limit,
        metadata={"lmc_data_dir": data_dir} if data_dir else None, output_path=str(out),
        batch_size=4,
    )  # fmt: skip
    build_report(out)


def _mean(profile: dict | None) -> np.ndarray:
    values = (profile or {}).get("mean") or []
    return np.array([math.nan if v is None else v for v in values], dtype=float)


def phase_table(geometry: dict) -> list[tuple[str, float, float]]:
    """(property, thought-phase mean, fixation-phase mean) of one task's geometry file."""
    from lm_coupling.report.boundary import boundary_layer

    profiles, matrices = geometry["profiles"], geometry.get("matrices", {})
    entropy = _mean(profiles.get("logit_lens_entropy"))
    b = boundary_layer(list(entropy))
    if not math.isfinite(b):
        return []
    cut = int(math.ceil(b))  # states 0..cut-1: thought; cut..L: fixation
    rows = []
    for name, label in (
        ("windowed_lss", "windowed LSS (linearity; lower = straighter)"),
        ("logit_lens_entropy", "logit-lens entropy / ln V (lower = more confident)"),
        ("tv_to_target", "TV to target (lower = closer to the answer)"),
        ("prompt_entropy", "prompt entropy (nats)"),
        ("effective_rank", "effective rank"),
        ("norm", "norm ||x^l||"),
    ):
        values = _mean(profiles.get(name))
        if not len(values):
            continue
        # profiles over blocks (1..L) have L values, over states (0..L) L+1
        offset = 1 if len(values) == len(entropy) - 1 else 0
        layers = np.arange(len(values)) + offset
        rows.append((label, np.nanmean(values[layers < cut]), np.nanmean(values[layers >= cut])))
    ratio = np.array((matrices.get("alignment_ratio") or {}).get("mean") or [], dtype=float)
    if ratio.size:
        blocks = np.arange(1, ratio.shape[0] + 1)
        early, late = blocks < cut, blocks >= cut
        off = ~np.eye(ratio.shape[0], dtype=bool)
        rows.append(
            (
                "alignment ratio of block pairs within the phase (lower = more aligned)",
                np.nanmean(ratio[np.ix_(early, early)][off[np.ix_(early, early)]]),
                np.nanmean(ratio[np.ix_(late, late)][off[np.ix_(late, late)]]),
            )
        )
    rows.insert(0, ("boundary (layer)", b, b))
    return rows


def main() -> None:
    """Run (unless --read-only) and print the thought/fixation table per task."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="lmc_arc_easy_offline,lmc_winogrande_offline")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--coupling-docs", type=int, default=3)
    parser.add_argument("--out", default="results-smollm2-profiles")
    parser.add_argument("--read-only", action="store_true", help="only read --out's files")
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    out = Path(options.out)
    if not options.read_only:
        run(out, options.tasks.split(","), options.data_dir, options.limit, options.coupling_docs)
    for file in sorted(glob.glob(str(out / "*" / "geometry_*.json"))):
        geometry = json.loads(Path(file).read_text())
        print(f"\n{geometry['task']} ({geometry['n_documents']} documents): {file}")
        print("| property | thought phase | fixation phase |")
        print("|---|---:|---:|")
        for label, thought, fixation in phase_table(geometry):
            print(f"| {label} | {thought:.4g} | {fixation:.4g} |")
        (results_file,) = sorted(Path(file).parent.glob("results_*.json"))[-1:]
        values = json.loads(results_file.read_text())["results"].get(geometry["task"], {})
        for name in ("acc", "equidistance", "lss", "coupling", "alignment_ratio"):
            if f"{name},none" in values:
                print(f"{name}: {values[f'{name},none']:.4g}")


if __name__ == "__main__":
    main()
