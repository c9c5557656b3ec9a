"""What each Layer by Layer convention does to SmolLM2-135M's prompt-entropy profile.

Skean et al. (2025) report a prompt-entropy valley at intermediate layers. On
SmolLM2-135M their released code's conventions (``preset=skean2025``) show
one, and this script shows where it comes from: the profile (mean over
ARC-Easy contexts) under

* this package's defaults (context tokens 1..n, states as they are, no clamp,
  ``x^L`` before the final norm);
* ``preset=skean2025`` (every token 0..n, centred unit-norm tokens, the Gram
  clamped at 0, the last state after the final norm);
* ``preset=skean2025,lbl_tokens=context`` (position 0 dropped, all else theirs);
* ``preset=skean2025,lbl_last_state=pre_norm`` (the final norm left out);

beside token 0's norm ratio ``||x^l_0|| / median_{t >= 1} ||x^l_t||`` per state
(the last state after the final norm, as transformers' ``hidden_states``).
Printed: each profile, each document's ``prompt_entropy_min_layer`` counts,
the dataset entropy at the last state with and without the final norm, and
the load average. The figure goes to ``--figure`` (docs/figures/).

    python bench/lbl_conventions.py --docs 20 --figure docs/figures/lbl_conventions.png
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

import torch
from jlens_reference import load

from lm_coupling.geometry import GeometryRunner
from lm_coupling.plugins.builtin import layer_by_layer as plugin
from lm_coupling.selection import make_selection

REPO = Path(__file__).resolve().parents[1]
SHARED = [Path(os.environ.get("LM_COUPLING_SHARED_BENCHMARKS", "/nonexistent"))] + [
    up / "shared" / "benchmarks" for up in (REPO.parent, REPO.parent.parent)
]  # beside the checkout, or two levels up (a worktree)
SETTINGS = {
    "ours (defaults)": None,
    "skean2025": "preset=skean2025",
    "skean2025, position 0 dropped": "preset=skean2025,lbl_tokens=context",
    "skean2025, final norm left out": "preset=skean2025,lbl_last_state=pre_norm",
}
NAMES = "prompt_entropy,prompt_entropy_min_layer,dataset_entropy"


def contexts(count: int) -> list[str]:
    """ARC-Easy contexts as lm-eval's arc_easy writes them (``Question: ...\\nAnswer:``)."""
    files = [f for folder in SHARED for f in sorted(folder.glob("arc/ARC-Easy-Dev.jsonl"))]
    if files:
        rows = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
        stems = [row["question"]["stem"] for row in rows]
    else:  # the bundled sample items
        bundled = REPO / "lm_coupling" / "demo" / "sample_tasks" / "arc_easy" / "validation.jsonl"
        rows = [json.loads(line) for line in bundled.read_text().splitlines() if line.strip()]
        stems = [row["question"] for row in rows]
    return [f"Question: {stem}\nAnswer:" for stem in stems[:count]]


def main(argv=None) -> None:
    """Measure, print and draw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--figure", default=None, help="PNG path (none: no figure)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model, folder = load("smollm2")
    model = model.to(torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = contexts(args.docs)
    ids = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    print(f"load average: {open('/proc/loadavg').read().strip()}")
    print(f"{len(ids)} ARC-Easy contexts of {min(map(len, ids))}-{max(map(len, ids))} tokens")
    profiles, last_dataset = {}, {}
    for label, args_text in SETTINGS.items():
        selection = make_selection(NAMES, args_text)
        runner = GeometryRunner(model, selection)
        docs = [runner.measure_prompt(i) for i in ids]
        rows = torch.stack([torch.as_tensor(d.profiles["prompt_entropy"]) for d in docs])
        profiles[label] = rows.double().mean(0)
        minima = Counter(round(float(d.values["prompt_entropy_min_layer"]), 2) for d in docs)
        mean_min = sum(float(d.values["prompt_entropy_min_layer"]) for d in docs) / len(docs)
        section = plugin.lmc_aggregate_task(
            selected=["dataset_entropy"], options=selection.options, documents=docs,
            doc_ids=list(range(len(docs))),
        )["dataset_entropy"]  # fmt: skip
        last_dataset[label] = section["profile"][-1]
        print(f"{label}: prompt entropy per state", " ".join(f"{v:.2f}" for v in profiles[label]))
        print(f"  prompt_entropy_min_layer: mean {mean_min:.2f}, per document {dict(minima)}")
        print(f"  dataset entropy at the last state: {last_dataset[label]:.3f}")
    ratios = []
    with torch.no_grad():
        for i in ids:
            hs = model(i[None], output_hidden_states=True, use_cache=False).hidden_states
            norms = torch.stack([h[0].norm(dim=-1) for h in hs])  # [L+1, T]
            ratios.append(norms[:, 0] / norms[:, 1:].median(dim=1).values)
    ratio = torch.stack(ratios).mean(0)
    print("token 0 norm / median other token norm per state:", " ".join(f"{r:.0f}" for r in ratio))
    if args.figure:
        draw(profiles, ratio, Path(args.figure), len(ids))


def draw(profiles: dict[str, torch.Tensor], ratio: torch.Tensor, path: Path, n: int) -> None:
    """Two panels: the prompt-entropy profiles, token 0's norm ratio (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(6.4, 5.2), sharex=True, constrained_layout=True,
        gridspec_kw={"height_ratios": [3, 2]},
    )  # fmt: skip
    for label, values in profiles.items():
        # skean2025 and "final norm left out" differ at the last state only: the preset is
        # drawn dashed on top, so both stay visible.
        style = dict(ls="--", lw=2.0, zorder=3) if label == "skean2025" else {}
        top.plot(range(len(values)), values.tolist(), marker=".", ms=4, label=label, **style)
    top.set_ylabel("prompt entropy (nats)")
    top.set_title(f"SmolLM2-135M, {n} ARC-Easy contexts: prompt entropy per state", fontsize=9)
    top.legend(fontsize=7)
    bottom.semilogy(range(len(ratio)), ratio.tolist(), color="black", marker=".", ms=4)
    bottom.set_ylabel("||x_0|| / median ||x_t||")
    bottom.set_xlabel("state l (0: embeddings; L: after the final norm)")
    bottom.set_title("token 0's norm against the other tokens'", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
