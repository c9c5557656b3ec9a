"""The spectral gap s_K / s_{K+1} of every block Jacobian, and the ill-defined flag.

Coupling at K reads each block's top-K singular subspace, which the spectrum
determines only as well as the gap ``s_K / s_{K+1}`` allows (docs/metrics.md,
"The ill-defined subspace"). This prints, per block and for each K given,
the gap and the flag coupling records (``metrics.coupling.subspace_ill_defined``:
the gap below ``--min-gap``, or the engine's numerical flag, two of the top
K+1 singular values closer than ``jacobian_ill_gap * s_1``; that flag alone is
counted too) on a few prompts of the chosen model, and the K that
``k_select=largest_gap`` would take.

    python bench/spectral_gap.py --model smollm2 --k 10,30,50   # SmolLM2-135M (GGUF)
    python bench/spectral_gap.py --model tiny --k 4
"""

from __future__ import annotations

import argparse

import torch
from jlens_reference import load, prompts

from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.jacobian.linalg import ill_defined
from lm_coupling.metrics.coupling import SUBSPACE_MIN_GAP, largest_gap_k, subspace_ill_defined
from lm_coupling.model.architecture import locate_model_parts


def main(argv=None) -> None:
    """Print the per-block gaps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--k", default="10", help="comma list of K")
    parser.add_argument("--k-max", type=int, default=20, help="range of k_select=largest_gap")
    parser.add_argument("--min-gap", type=float, default=SUBSPACE_MIN_GAP)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    args = parser.parse_args(argv)
    model, folder = load(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    parts = locate_model_parts(model)
    ks = [int(k) for k in args.k.split(",")]
    k_max = min(max(args.k_max, max(ks) + 1), parts.d_model - 1)
    engine = JacobianEngine(model, parts, k_max=k_max)
    print(f"load average: {open('/proc/loadavg').read().strip()}")
    for index, text in enumerate(prompts(args.prompts)):
        ids = torch.tensor(tokenizer(text)["input_ids"][: args.tokens])
        factors = engine.factors(ids)
        S = factors.S.double().cpu()
        for k in ks:
            gap = S[:, k - 1] / S[:, k]
            numerical = ill_defined(S, k, engine.config.ill_gap)  # the engine's rule at K
            flags = subspace_ill_defined(gap, numerical, args.min_gap)
            print(f"prompt {index} ({ids.shape[0]} tokens), K = {k}")
            print("  s_K/s_K+1 per block:", " ".join(f"{g:.3f}" for g in gap.tolist()))
            print(f"  range {float(gap.min()):.3f}-{float(gap.max()):.3f}; ill-defined "
                  f"(gap < {args.min_gap} or numerical): {int(flags.sum())} of {len(flags)} "
                  f"blocks; numerical flag alone: {int(numerical.sum())}; routes "
                  f"{sorted(set(factors.method))}")  # fmt: skip
        print(f"  k_select=largest_gap over [2, {engine.k_max}]: K = "
              f"{largest_gap_k(S, 2, engine.k_max)}")  # fmt: skip


if __name__ == "__main__":
    main()
