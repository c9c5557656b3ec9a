"""Train the demo's family of small GPT-2 models on the generated corpus, offline.

No pretrained weights can be downloaded on our machines, so the demo trains
its own: a byte-level BPE tokenizer and GPT-2 models of a few sizes on the
corpus of ``lm_coupling.demo.corpus``, with plain torch (AdamW, linear warm-up
then cosine decay), seeded. Checkpoints are saved at log-spaced steps from
initialisation (``step0``) to the last step as ``<out>/<size>/step<N>``
(``save_pretrained`` plus tokenizer), so every revision loads with
``AutoModelForCausalLM.from_pretrained`` and ``lm_eval --model hf``. The
held-out evaluation tasks go to ``<out>/tasks_data/<benchmark>/<split>.jsonl``.

Command line: ``python -m lm_coupling.demo.train --out results/family``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lm_coupling.demo.assets import ASSETS_DIR, MODEL_DIRNAME, TASKS_DIRNAME, family_checkpoints
from lm_coupling.demo.corpus import TRUTHFULQA_PREFIX, build_corpus, make_demo_data
from lm_coupling.demo.corpus import write_eval_tasks as _write_eval_tasks
from lm_coupling.demo.tiny import build_tiny_model, train_tokenizer

logger = logging.getLogger(__name__)

# Model sizes of the family and their default number of steps.
SIZES = {
    "tiny": {"d_model": 64, "n_layers": 4, "n_heads": 4, "steps": 1200, "lr": 3e-3},
    "small": {"d_model": 96, "n_layers": 6, "n_heads": 4, "steps": 1200, "lr": 2e-3},
}
REDUCED = {"d_model": 16, "n_layers": 2, "n_heads": 2, "steps": 8, "lr": 3e-3}
VOCAB_SIZE = 1024
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def checkpoint_steps(total: int, count: int = 8) -> list[int]:
    """Return ``0`` and about ``count - 1`` log-spaced steps up to ``total`` (included).

    Raises:
        ValueError: ``total`` below 1 or ``count`` below 2.
    """
    if total < 1 or count < 2:
        raise ValueError(f"need total >= 1 and count >= 2, got {total} and {count}")
    spaced = (
        {round(math.exp(math.log(total) * k / (count - 2))) for k in range(count - 1)}
        if count > 2
        else set()
    )
    return sorted({0, total} | spaced)


def _sample_batch(
    docs: list[list[int]], rng: random.Random, batch_size: int, seq_len: int, eos: int
) -> torch.Tensor:
    """Rows of ``seq_len`` tokens: random documents, each followed by EOS."""
    rows = []
    for _ in range(batch_size):
        row: list[int] = []
        while len(row) < seq_len:
            row += docs[rng.randrange(len(docs))] + [eos]
        rows.append(row[:seq_len])
    return torch.tensor(rows, dtype=torch.long)


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _save(model, tokenizer, path: Path) -> Path:
    # The model declares no pad token (as GPT-2 does): its one special token is
    # BOS = EOS, and with pad = BOS transformers warns on every unmasked batch that
    # begins or ends with it. Padding stays lm-eval's (the tokenizer's pad token).
    model.config.pad_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train_model(
    name: str,
    size: dict,
    tokenizer,
    docs: list[list[int]],
    out_dir: Path,
    *,
    seed: int = 0,
    device: str = "cpu",
    batch_size: int = 16,
    seq_len: int = 256,
    n_checkpoints: int = 12,
) -> list[Path]:
    """Train one GPT-2 of ``size`` and save its checkpoints under ``out_dir/name``.

    Args:
        name: folder name of the size (``tiny``).
        size: ``d_model``, ``n_layers``, ``n_heads``, ``steps``, ``lr``.
        tokenizer: the family's tokenizer.
        docs: token ids of the training documents.
        out_dir: the family folder.
        seed: seed of initialisation and batch sampling.
        device: torch device of training (checkpoints are saved on CPU).
        batch_size: rows per step.
        seq_len: tokens per row.
        n_checkpoints: about how many checkpoints, ``step0`` and the last included.

    Returns:
        The checkpoint folders ``out_dir/name/step<N>``, in step order.
    """
    steps, lr = int(size["steps"]), float(size["lr"])
    model = build_tiny_model(
        "gpt2",
        len(tokenizer),
        seed=seed,
        d_model=size["d_model"],
        n_layers=size["n_layers"],
        n_heads=size["n_heads"],
        max_len=2 * seq_len,
        **NO_DROPOUT,
    )
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: _lr_factor(s, steps, max(1, steps // 20))
    )
    rng, folder = random.Random(f"batches-{seed}-{name}"), out_dir / name
    saves, paths, log = set(checkpoint_steps(steps, n_checkpoints)), [], []
    start = time.perf_counter()
    for step in range(steps + 1):
        if step in saves:
            paths.append(_save(model.eval().to("cpu"), tokenizer, folder / f"step{step}"))
            model.to(device).train()
        if step == steps:
            break
        batch = _sample_batch(docs, rng, batch_size, seq_len, tokenizer.eos_token_id).to(device)
        loss = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        value = loss.detach().item()
        log.append(
            {
                "step": step + 1,
                "loss": value,
                "lr": schedule.get_last_lr()[0],
                "seconds": round(time.perf_counter() - start, 3),
            }
        )
        if (step + 1) % max(1, steps // 20) == 0 or step + 1 == steps:
            logger.info("%s step %d/%d loss %.4f", name, step + 1, steps, value)
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return paths


def _size_table(sizes: Sequence[str], steps: int | None, reduced: bool) -> dict[str, dict]:
    unknown = [name for name in sizes if name not in SIZES]
    if unknown:
        raise ValueError(f"unknown model sizes {unknown}; choose from {sorted(SIZES)}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    table = {}
    for index, name in enumerate(sizes):
        size = dict(SIZES[name])
        if reduced:
            size = dict(REDUCED, d_model=REDUCED["d_model"] * (index + 1))
        if steps is not None:
            size["steps"] = steps
        table[name] = size
    return table


def train_family(
    out_dir: str | Path,
    sizes: Sequence[str] = ("tiny", "small"),
    steps: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    reduced: bool = False,
    batch_size: int = 16,
    seq_len: int = 256,
    n_checkpoints: int = 12,
) -> list[Path]:
    """Generate the corpus and tasks, train a tokenizer and a family of GPT-2 models.

    Writes ``<out_dir>/tasks_data/<benchmark>/<split>.jsonl`` (held-out tasks),
    ``<out_dir>/<size>/step<N>/`` (checkpoints, ``step0`` is the
    initialisation), ``<out_dir>/<size>/train_log.jsonl`` (loss per step) and
    ``<out_dir>/family.json`` (settings and timings).

    Args:
        out_dir: destination folder (created).
        sizes: names from ``SIZES``.
        steps: training steps of every size (default: each size's own).
        seed: seed of world, corpus, tokenizer data, initialisation and batches.
        device: torch device, e.g. ``"cuda"``.
        reduced: tiny models and 8 steps (``REDUCED``): a seconds-long smoke run.
        batch_size: rows per step.
        seq_len: tokens per row.
        n_checkpoints: about how many checkpoints per size.

    Returns:
        Every checkpoint folder, size by size, in step order.

    Raises:
        ValueError: unknown size or ``steps`` below 1.
    """
    table = _size_table(sizes, steps, reduced)
    out_dir = Path(out_dir)
    data = make_demo_data(seed)
    _write_eval_tasks(out_dir / "tasks_data", data=data)
    texts = build_corpus(data, seed)
    tokenizer = train_tokenizer([*texts, TRUTHFULQA_PREFIX], vocab_size=VOCAB_SIZE)
    docs = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    logger.info("corpus: %d documents, %d tokens", len(docs), sum(map(len, docs)))
    paths, timings = [], {}
    for name, size in table.items():
        start = time.perf_counter()
        paths += train_model(
            name,
            size,
            tokenizer,
            docs,
            out_dir,
            seed=seed,
            device=device,
            batch_size=batch_size,
            seq_len=seq_len,
            n_checkpoints=n_checkpoints,
        )
        timings[name] = round(time.perf_counter() - start, 1)
    summary = {
        "seed": seed,
        "device": device,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "vocab_size": len(tokenizer),
        "sizes": table,
        "train_seconds": timings,
        "corpus_tokens": sum(map(len, docs)),
    }
    (out_dir / "family.json").write_text(json.dumps(summary, indent=2) + "\n")
    return paths


def bundle(family_dir: str | Path, size: str = "tiny", assets_dir: str | Path = ASSETS_DIR) -> Path:
    """Copy the last checkpoint of ``size`` and the tasks into the package's assets.

    Returns:
        The bundled model folder ``<assets_dir>/tiny-gpt2``.

    Raises:
        FileNotFoundError: ``family_dir`` holds no checkpoint of ``size``.
    """
    family_dir, assets_dir = Path(family_dir), Path(assets_dir)
    checkpoints = [p for p in family_checkpoints(family_dir) if p.parent.name == size]
    if not checkpoints:
        raise FileNotFoundError(f"no {family_dir / size}/step<N> folders; run train_family first")
    for source, name in (
        (checkpoints[-1], MODEL_DIRNAME),
        (family_dir / "tasks_data", TASKS_DIRNAME),
    ):
        shutil.rmtree(assets_dir / name, ignore_errors=True)
        shutil.copytree(source, assets_dir / name)
    return assets_dir / MODEL_DIRNAME


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of ``train_family``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/family", help="output folder")
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=None, help="steps of every size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    parser.add_argument("--reduced", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--checkpoints", type=int, default=12, help="checkpoints per size")
    parser.add_argument(
        "--bundle",
        action="store_true",
        help="copy the smallest model and the tasks into the package assets",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    paths = train_family(
        args.out,
        args.sizes,
        args.steps,
        args.seed,
        args.device,
        args.reduced,
        args.batch_size,
        args.seq_len,
        args.checkpoints,
    )
    if args.bundle:
        paths.append(bundle(args.out, args.sizes[0]))
    print("\n".join(str(path) for path in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
