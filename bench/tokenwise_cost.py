"""What one document costs for the token-wise coupling metrics at GPT-2-small shape on CPU.

python bench/tokenwise_cost.py [--tokens 64] [--positions 4] [--layers 0:-1]

A randomly initialised GPT-2 small (d = 768, 12 blocks, 12 heads; the
weights do not change the cost), one prompt of --tokens tokens, the three
token-wise metrics through GeometryRunner.compute_sampled (the route of a
sampled document in an lm_eval run). Prints seconds per document, the number
of position Jacobians, and the load average it ran under.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from lm_coupling.demo.tiny import build_tiny_model
from lm_coupling.geometry import GeometryRunner
from lm_coupling.plugins.builtin.tokenwise import lmc_position_jacobian_keys
from lm_coupling.selection import make_selection

NAMES = "tokenwise_self_coupling,tokenwise_context_fixed_input,tokenwise_context_fixed_output"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--positions", type=int, default=4)
    parser.add_argument("--layers", default="0:-1")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--single", action="store_true", help="time one position Jacobian J^0_{n-1, n} only"
    )
    args = parser.parse_args()
    model = build_tiny_model(
        "gpt2", 50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_len=1024
    )
    options = f"tokenwise_positions={args.positions},tokenwise_layers={args.layers}"
    selection = make_selection(NAMES, options)
    runner = GeometryRunner(model, selection)
    ids = torch.randint(0, 50257, (args.tokens,), generator=torch.Generator().manual_seed(0))
    keys = lmc_position_jacobian_keys(NAMES.split(","), selection.options, 12, args.tokens)
    if args.single:
        start, cpu = time.perf_counter(), time.process_time()
        runner.engine.position_jacobian(ids, 0, args.tokens - 2, args.tokens - 1)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(
            f"GPT-2-small shape, T={args.tokens}: one position Jacobian {wall:.1f} s wall, "
            f"{cpu:.1f} s CPU (torch threads {torch.get_num_threads()}, load average "
            f"{os.getloadavg()[0]:.1f}); a document with these options needs {len(keys)}"
        )
        return
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        doc = runner.compute_sampled(ids)
        times.append(time.perf_counter() - start)
    print(
        f"GPT-2-small shape, T={args.tokens}, P={args.positions}, blocks {args.layers}: "
        f"{len(keys)} position Jacobians, {min(times):.1f} s per document "
        f"(best of {args.repeats}; torch threads {torch.get_num_threads()}; "
        f"load average {os.getloadavg()[0]:.1f}); values "
        + ", ".join(f"{k}={v:.3f}" for k, v in doc.values.items())
    )


if __name__ == "__main__":
    main()
