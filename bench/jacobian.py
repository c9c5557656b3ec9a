"""Benchmark: the naive block-Jacobian route vs lm-coupling's engine, same coupling matrix.

Naive (the papers' released code): per block, d backward passes through the
whole sequence, a full SVD, and the coupling matrix from dense matrices. Ours:
the dense single-token route (frozen prefix keys/values, vectorized JVPs) and
the matrix-free route (randomized SVD + one batched JVP of L*K tangents per
block), each producing the full L x L coupling matrix at K.

The naive route is timed on the first --naive-layers blocks only and
extrapolated per layer to all L blocks (printed as such); the coupling matrices
are compared on those blocks.

    python bench/jacobian.py                       # GPT-2-small shape, CPU
    python bench/jacobian.py --quick               # small smoke run
    python bench/jacobian.py --device cuda --arch llama --layers 2   # Llama-7B-shaped stack
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import transformers

from lm_coupling.capture.architecture import locate_model_parts
from lm_coupling.capture.jacobian import JacobianEngine, naive_block_jacobians
from lm_coupling.metrics.coupling import (
    coupling_matrices,
    coupling_matrices_dense,
    miscoupling,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--layers", type=int, default=None, help="blocks L (12; llama: 2)")
    parser.add_argument("--d-model", type=int, default=None, help="d (768; llama: 4096)")
    parser.add_argument("--heads", type=int, default=None, help="heads (12; llama: 32)")
    parser.add_argument("--d-ff", type=int, default=None, help="MLP width (4d; llama: 11008)")
    parser.add_argument("--tokens", type=int, default=128, help="prompt length T")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--k", type=int, default=10, help="K singular vectors")
    parser.add_argument("--power-iters", type=int, default=2)
    parser.add_argument("--naive-layers", type=int, default=2, help="blocks timed naively")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes, seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    big = args.arch == "llama"
    defaults = {
        "layers": 2 if args.quick else (2 if big else 12),
        "d_model": 128 if args.quick else (4096 if big else 768),
        "heads": 4 if args.quick else (32 if big else 12),
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.d_ff is None:
        args.d_ff = 11008 if big and not args.quick else 4 * args.d_model
    if args.quick:
        args.tokens, args.vocab = min(args.tokens, 32), min(args.vocab, 1024)
    args.naive_layers = min(args.naive_layers, args.layers)
    return args


def build_model(args: argparse.Namespace) -> transformers.PreTrainedModel:
    if args.arch == "gpt2":
        config = transformers.GPT2Config(
            n_embd=args.d_model,
            n_layer=args.layers,
            n_head=args.heads,
            n_inner=args.d_ff,
            n_positions=max(1024, args.tokens),
            vocab_size=args.vocab,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        config = transformers.LlamaConfig(
            hidden_size=args.d_model,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
            intermediate_size=args.d_ff,
            vocab_size=args.vocab,
            max_position_embeddings=max(4096, args.tokens),
            bos_token_id=0,
            eos_token_id=0,
        )
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=args.device, dtype=torch.float32).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def naive_coupling(model, parts, ids, k: int) -> torch.Tensor:
    """The released-code pipeline: d backward passes per block, full SVD, dense A."""
    J = naive_block_jacobians(model, parts, ids)
    U_full, S_full, Vh = torch.linalg.svd(J)
    U, V = U_full[..., :k], Vh[..., :k, :].transpose(-2, -1)
    return miscoupling(coupling_matrices_dense(J, U, V), S_full)


def engine_coupling(model, parts, ids, args, method: str):
    engine = JacobianEngine(
        model, parts, k_max=args.k, method=method, power_iters=args.power_iters, seed=args.seed
    )
    factors = engine.factors(ids)
    return miscoupling(coupling_matrices(factors.U, factors.JV), factors.S), factors


def main() -> None:
    args = parse_args()
    model = build_model(args)
    parts = locate_model_parts(model)
    L, d, n_naive = parts.n_layers, parts.d_model, args.naive_layers
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.tokens,), generator=generator).to(args.device)
    print(
        f"model: {args.arch}, L={L}, d={d}, heads={args.heads}, d_ff={args.d_ff}, "
        f"T={args.tokens}, V={args.vocab}, K={args.k}, device={args.device}, "
        f"threads={torch.get_num_threads()}, float32, random weights"
    )
    # Warm-up (allocations, kernels) on a short prompt, not timed.
    JacobianEngine(model, parts, k_max=args.k, method="dense").factors(ids[:4])

    sub = dataclasses.replace(parts, blocks=parts.blocks[:n_naive])
    m_naive, t_naive = timed(lambda: naive_coupling(model, sub, ids, args.k), args.device)
    per_naive = t_naive / n_naive
    (m_dense, f_dense), t_dense = timed(
        lambda: engine_coupling(model, parts, ids, args, "dense"), args.device
    )
    (m_free, f_free), t_free = timed(
        lambda: engine_coupling(model, parts, ids, args, "randomized"), args.device
    )
    naive_total = per_naive * L
    print(
        f"naive route timed on {n_naive} of {L} blocks ({t_naive:.1f} s) and "
        f"EXTRAPOLATED per layer to {L} blocks; matrices compared on those {n_naive} blocks."
    )
    header = (
        f"{'route':<34}{'s/layer':>10}{'s total':>10}{'speedup':>9}"
        f"{'max|dC| vs naive':>18}{'max|dC| vs dense':>18}"
    )
    print(header)
    print("-" * len(header))
    sub_idx = slice(0, n_naive)
    rows = [
        ("naive (d backward + full SVD)", per_naive, naive_total, None, None),
        ("ours dense (single token, jvp)", t_dense / L, t_dense, m_dense, m_dense),
        (f"ours matrix-free (rsvd, q={args.power_iters})", t_free / L, t_free, m_free, m_dense),
    ]
    for name, per, total, m, ref in rows:
        vs_naive = "-" if m is None else f"{(m[sub_idx, sub_idx] - m_naive).abs().max():.2e}"
        vs_dense = "-" if m is None else f"{(m - ref).abs().max():.2e}"
        print(
            f"{name:<34}{per:>10.3f}{total:>10.2f}{naive_total / total:>8.1f}x"
            f"{vs_naive:>18}{vs_dense:>18}"
        )
    gap = f_dense.spectral_gap
    print(
        f"spectral gap s_K/s_(K+1) per layer (dense): min {gap.min():.4f}, "
        f"median {gap.median():.4f}, max {gap.max():.4f}"
    )
    S_err = (f_free.S[:, : args.k] - f_dense.S[:, : args.k]).abs().max()
    print(f"matrix-free top-K singular values: max |dS| vs dense = {S_err:.2e}")


if __name__ == "__main__":
    main()
