"""The spectral gap s_K / s_{K+1} of every block Jacobian, and the engine's ill-defined flag.

Coupling at K reads each block's top-K singular subspace, which the spectrum
determines only as well as the gap ``s_K / s_{K+1}`` allows (docs/metrics.md,
"The ill-defined subspace"). This prints, per block, the gap at K and the
engine's ``ill_defined`` flag (two of the top K+1 singular values closer than
``jacobian_ill_gap * s_1``) on a few prompts of the chosen model, and the K
that ``k_select=largest_gap`` would take.

    python bench/spectral_gap.py --model smollm2 --k 10     # SmolLM2-135M (GGUF)
    python bench/spectral_gap.py --model tiny --k 4
"""

from __future__ import annotations

import argparse

import torch
from jlens_reference import load, prompts

from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.jacobian.linalg import ill_defined
from lm_coupling.metrics.coupling import largest_gap_k
from lm_coupling.model.architecture import locate_model_parts


def main(argv=None) -> None:
    """Print the per-block gaps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--k-max", type=int, default=20, help="range of k_select=largest_gap")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    args = parser.parse_args(argv)
    model, folder = load(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    parts = locate_model_parts(model)
    engine = JacobianEngine(model, parts, k_max=min(args.k_max, parts.d_model - 1))
    print(f"load average: {open('/proc/loadavg').read().strip()}")
    for index, text in enumerate(prompts(args.prompts)):
        ids = torch.tensor(tokenizer(text)["input_ids"][: args.tokens])
        factors = engine.factors(ids)
        S = factors.S.double().cpu()
        gap = (S[:, args.k - 1] / S[:, args.k]).tolist()
        flags = ill_defined(S, args.k, engine.config.ill_gap).tolist()  # the engine's rule at K
        print(f"prompt {index} ({ids.shape[0]} tokens), K = {args.k}")
        print("  s_K/s_K+1 per block:", " ".join(f"{g:.3f}" for g in gap))
        print(f"  range {min(gap):.3f}-{max(gap):.3f}; ill-defined at K: {sum(flags)} of "
              f"{len(flags)} blocks; routes {sorted(set(factors.method))}")  # fmt: skip
        print(f"  k_select=largest_gap over [2, {engine.k_max}]: K = "
              f"{largest_gap_k(S, 2, engine.k_max)}")  # fmt: skip


if __name__ == "__main__":
    main()
