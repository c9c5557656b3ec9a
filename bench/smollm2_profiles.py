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
(no per-layer profile is recorded), so ``--equispacing`` recomputes it per
phase from the model's states on the same ARC-Easy items (`equispacing`).

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


def _phases(entropy: np.ndarray) -> tuple[str, list[tuple[str, int, int]]]:
    """The depth phases as (name, first state, last state): thought/fixation, else thirds.

    The boundary is the report's (`lm_coupling.report.boundary`: where the logit-lens
    entropy has fallen half way from its peak to its last value); where it is undefined
    (the profile does not fall), the depth is cut into thirds instead, and the table says so.
    """
    from lm_coupling.report.boundary import boundary_layer

    n = len(entropy) - 1
    b = boundary_layer(list(entropy))
    if math.isfinite(b):
        cut = int(math.ceil(b))
        return f"boundary at state {b:g}", [("thought", 0, cut - 1), ("fixation", cut, n)]
    a, c = round(n / 3), round(2 * n / 3)
    note = "boundary undefined (the logit-lens entropy does not fall): depth thirds"
    return note, [("early", 0, a), ("middle", a + 1, c), ("late", c + 1, n)]


def phase_table(geometry: dict) -> tuple[str, list[str], list[tuple[str, list[float]]]]:
    """(how the phases were cut, phase names, [(property, value per phase)]) of one task."""
    profiles, matrices = geometry["profiles"], geometry.get("matrices", {})
    entropy = _mean(profiles.get("logit_lens_entropy"))
    note, phases = _phases(entropy)
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
        layers = np.arange(len(values)) + (1 if len(values) == len(entropy) - 1 else 0)
        rows.append(
            (label, [np.nanmean(values[(layers >= a) & (layers <= b)]) for _, a, b in phases])
        )
    for name, label in (
        ("alignment_ratio", "alignment ratio within the phase (lower = more aligned)"),
        ("coupling", "coupling within the phase"),
    ):
        matrix = np.array((matrices.get(name) or {}).get("mean") or [], dtype=float)
        if not matrix.size:
            continue
        blocks = np.arange(1, matrix.shape[0] + 1)
        off = ~np.eye(matrix.shape[0], dtype=bool)
        cells = []
        for _, a, b in phases:
            inside = (blocks >= max(a, 1)) & (blocks <= b)
            pair = np.ix_(inside, inside)
            cells.append(np.nanmean(matrix[pair][off[pair]]) if inside.sum() > 1 else math.nan)
        rows.append((label, cells))
    return note, [name for name, _, _ in phases], rows


def equispacing(data_dir: str | None, limit: int, phases: list[tuple[str, int, int]]) -> list:
    """Per phase: equidistance of the steps within it, and their mean length, over the items.

    Equidistance as the package defines it (``std_l ||d_l|| / mean_l ||d_l||``,
    population std; Picking paper, eq. 2), over the steps ``d_l = x^l - x^{l-1}``
    whose l lies in the phase (l >= 1), per context token 1..n of each ARC-Easy
    prompt (``Question: ...\nAnswer:``, the trajectory metrics' default
    ``tokens=all``), averaged over tokens, then over documents. States: the
    embedding and every block's output, by forward hooks (no final norm).
    Returns ``[(equidistance, mean step length) per phase]``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_coupling.fetch import fetch
    from lm_coupling.metrics.trajectory import equidistance

    path = fetch("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    folder = Path(data_dir) if data_dir else None
    source = (folder / "arc_easy" / "test.jsonl") if folder else None
    if source is None or not source.is_file():
        from lm_coupling.demo.assets import bundled_tasks_data_path

        source = bundled_tasks_data_path() / "arc_easy" / "test.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines() if line][:limit]
    states: list[torch.Tensor] = []

    def keep(_module, _inputs, output):
        states.append((output[0] if isinstance(output, tuple) else output).detach())

    inner = model.model
    hooks = [inner.embed_tokens.register_forward_hook(keep)]
    hooks += [layer.register_forward_hook(keep) for layer in inner.layers]
    per_doc = []
    with torch.no_grad():
        for row in rows:
            states.clear()
            ids = tokenizer(f"Question: {row['question']}\nAnswer:", return_tensors="pt")
            model(**ids)
            x = torch.stack([s[0, 1:].double() for s in states])  # [L+1, n, d], tokens 1..n
            lengths = torch.linalg.vector_norm(x[1:] - x[:-1], dim=-1)  # step l at index l-1
            cells = []
            for _, a, b in phases:
                steps = lengths[max(a, 1) - 1 : b]  # steps l = max(a, 1)..b
                cells.append((float(equidistance(steps.T).mean()), float(steps.mean())))
            per_doc.append(cells)
    for hook in hooks:
        hook.remove()
    return [
        tuple(float(np.mean(v)) for v in zip(*column, strict=True))
        for column in zip(*per_doc, strict=True)
    ]


def main() -> None:
    """Run (unless --read-only) and print the thought/fixation table per task."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="lmc_arc_easy_offline,lmc_winogrande_offline")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--coupling-docs", type=int, default=3)
    parser.add_argument("--out", default="results-smollm2-profiles")
    parser.add_argument("--read-only", action="store_true", help="only read --out's files")
    parser.add_argument(
        "--equispacing", action="store_true", help="equidistance per phase (loads the model)"
    )
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    out = Path(options.out)
    if not options.read_only:
        run(out, options.tasks.split(","), options.data_dir, options.limit, options.coupling_docs)
    for file in sorted(glob.glob(str(out / "*" / "geometry_*.json"))):
        geometry = json.loads(Path(file).read_text())
        note, names, rows = phase_table(geometry)
        print(f"\n{geometry['task']} ({geometry['n_documents']} documents): {file}\n{note}")
        print(f"| property | {' | '.join(names)} |")
        print("|---|" + "---:|" * len(names))
        for label, values in rows:
            print(f"| {label} | {' | '.join(f'{v:.4g}' for v in values)} |")
        if options.equispacing and geometry["task"] == "lmc_arc_easy_offline":
            _, phases = _phases(_mean(geometry["profiles"].get("logit_lens_entropy")))
            cells = equispacing(options.data_dir, options.limit, phases)
            line = " | ".join(f"{e:.4g}" for e, _ in cells)
            print(f"| equidistance of the phase's steps (lower = more equispaced) | {line} |")
            line = " | ".join(f"{m:.4g}" for _, m in cells)
            print(f"| mean step length ||x^l - x^(l-1)|| | {line} |")
        (results_file,) = sorted(Path(file).parent.glob("results_*.json"))[-1:]
        values = json.loads(results_file.read_text())["results"].get(geometry["task"], {})
        for name in ("acc", "equidistance", "lss", "fixation_depth", "coupling", "alignment_ratio"):
            if f"{name},none" in values:
                print(f"{name}: {values[f'{name},none']:.4g}")


if __name__ == "__main__":
    main()
