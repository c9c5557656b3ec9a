"""Fitting time of the reference Jacobian lens: lm-coupling's engine beside TransformerLens 4.3.

Both compute the same estimator (Gurnee et al. 2026; ``JacobianLens.fit``:
target positions summed, source positions ``s .. T-2`` averaged) on the same
prompts, the same Hugging Face model (TransformerLens wraps it with
``TransformerBridge.boot_transformers(hf_model=...)``), the same machine, one
after the other:

* ``transformer_lens``: ``JacobianLens.fit(bridge, prompts)``;
* ``engine``: ``jacobian.lens_fit.reference_lens_rows`` on the
  bridge's own tokens of each prompt (BOS first), averaged.

Both routes take ``ceil(d / dim_batch)`` backward passes per prompt through
the replicated prompt; the engine stops the forward pass before the head and
runs without the bridge's hooks. Printed: seconds of each (median of
``--repeats``), their ratio, the largest relative difference per layer
(``||J_ours - J_TL||_F / ||J_TL||_F``), and the load average.

    python bench/jlens_reference.py --model tiny        # seconds
    python bench/jlens_reference.py --model smollm2     # SmolLM2-135M (GGUF; minutes)
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
from timing import machine_line, median, print_table, timed
from tiny_models import SAMPLE_TEXT

from lm_coupling.jacobian.lens_fit import reference_lens_rows
from lm_coupling.model.architecture import locate_model_parts


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--prompts", type=int, default=2, help="prompts fitted on")
    parser.add_argument("--dim-batch", type=int, default=8, help="cotangents per backward")
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--skip-first", type=int, default=16, help="skip_first_positions")
    parser.add_argument(
        "--last-layers", type=int, default=0,
        help="fit only the last N source layers (TransformerLens source_layers, our "
        "first_state; 0: every layer)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs of each route (median)")
    return parser.parse_args(argv)


def prompts(count: int) -> list[str]:
    """``count`` distinct prompts, each longer than 128 tokens (rotations of a sample text)."""
    lines = [line for line in SAMPLE_TEXT.splitlines() if line]
    return [" ".join((lines[i:] + lines[:i]) * 2) for i in range(count)]


def load(name: str):
    """``(model, tokenizer folder)``: a float32 Hugging Face model in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "smollm2":
        from lm_coupling.fetch import fetch

        gguf = fetch("smollm2")  # the real model (docs/design.md), cached after the first call
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        from tiny_models import build_tiny_model, train_tokenizer

        tokenizer = train_tokenizer()
        model = build_tiny_model("llama", len(tokenizer), seed=0, init_std=0.2)
    folder = tempfile.mkdtemp()
    tokenizer.save_pretrained(folder)  # TransformerLens rebuilds the tokenizer from a path
    model.config.name_or_path = name
    return model.eval(), folder  # float32 (a GGUF is dequantised to float32)


def main(argv=None) -> None:
    """Fit both ways and print the table."""
    args = parse_args(argv)
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformer_lens.model_bridge import TransformerBridge
        from transformer_lens.tools.analysis import JacobianLens

        model, folder = load(args.model)
        bridge = TransformerBridge.boot_transformers(
            args.model, hf_model=model, tokenizer=AutoTokenizer.from_pretrained(folder),
            device="cpu",
        )  # fmt: skip
    texts = prompts(args.prompts)
    parts = locate_model_parts(model)
    ids = [bridge.to_tokens(text)[0] for text in texts]
    options = dict(
        max_seq_len=args.max_seq_len, dim_batch=args.dim_batch,
        skip_first_positions=args.skip_first,
    )  # fmt: skip
    L = parts.n_layers
    sources = list(range(L - 1 - args.last_layers, L - 1)) if args.last_layers else None
    first = sources[0] + 1 if sources else 0

    def theirs():
        return JacobianLens.fit(
            bridge, texts, corpus="bench", show_progress=False, source_layers=sources, **options
        )

    def ours():
        return torch.stack(
            [reference_lens_rows(model, parts, i, first_state=first, **options) for i in ids]
        ).mean(0)

    runs_theirs = [timed(theirs, "cpu") for _ in range(args.repeats)]
    runs_ours = [timed(ours, "cpu") for _ in range(args.repeats)]
    lens, J = runs_theirs[-1][0], runs_ours[-1][0]
    errors = [
        float((J[layer + 1] - lens.jacobians[layer]).norm() / lens.jacobians[layer].norm())
        for layer in lens.source_layers
    ]
    s_theirs = median([s for _, s in runs_theirs])
    s_ours = median([s for _, s in runs_ours])
    print(machine_line("cpu"))
    print(f"load average: {open('/proc/loadavg').read().strip()}")
    print(
        f"model {args.model}: L={parts.n_layers}, d={parts.d_model}; {len(texts)} prompts of "
        f"{[min(int(i.shape[0]), args.max_seq_len) for i in ids]} tokens, dim_batch "
        f"{args.dim_batch}, skip_first_positions {args.skip_first}, source layers "
        f"{lens.source_layers[0]}..{lens.source_layers[-1]}"
    )
    rows = [("transformer_lens JacobianLens.fit", s_theirs), ("lm-coupling engine", s_ours)]
    print_table(
        "reference J-lens fit, same prompts and model",
        ("route", "seconds", "per prompt"),
        [(name, f"{s:.2f}", f"{s / len(texts):.2f}") for name, s in rows],
    )
    print(f"ratio transformer_lens / engine: {s_theirs / s_ours:.2f}x")
    print(f"largest relative difference per layer: {max(errors):.2e} (layers {len(errors)})")


if __name__ == "__main__":
    main()
