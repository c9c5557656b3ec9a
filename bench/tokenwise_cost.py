"""What one document costs for the token-wise coupling metrics at GPT-2-small shape on CPU.

python bench/tokenwise_cost.py [--tokens 64] [--positions 4] [--layers 0:-1]

A randomly initialised GPT-2 small (d = 768, 12 blocks, 12 heads; the
weights do not change the cost), one prompt of --tokens tokens, the three
token-wise metrics through GeometryRunner.compute_sampled_batch (the route of a
sampled document in an lm_eval run). Prints seconds per document, the number
of position Jacobians, and the load average it ran under.

``--compare`` times one position Jacobian ``J^0_{n-1, n}`` both ways, median
of ``--repeats`` interleaved rounds: the engine's route (block 0 on rows
n-1..n with the prefix frozen) and the earlier whole-sequence route (block 0
rerun on all T rows per tangent; timed on ``--rows`` of the d VJPs and
extrapolated to d, every row being the same work).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from tiny_models import build_tiny_model

from lm_coupling.geometry import GeometryRunner
from lm_coupling.jacobian.calls import engine_mode
from lm_coupling.jacobian.linalg import vjp_rows
from lm_coupling.jacobian.sequence import record_sequences
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
    parser.add_argument("--compare", action="store_true", help="engine vs whole-sequence route")
    parser.add_argument("--attn", default="sdpa", help="attention (lm-eval's HF default: sdpa)")
    parser.add_argument("--rows", type=int, default=32, help="--compare: VJPs timed, old route")
    args = parser.parse_args()
    model = build_tiny_model(
        "gpt2", 50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_len=1024
    )
    model.set_attn_implementation(args.attn)
    options = f"tokenwise_positions={args.positions},tokenwise_layers={args.layers}"
    selection = make_selection(NAMES, options)
    runner = GeometryRunner(model, selection)
    ids = torch.randint(0, 50257, (args.tokens,), generator=torch.Generator().manual_seed(0))
    keys = lmc_position_jacobian_keys(NAMES.split(","), selection.options, 12, args.tokens)
    if args.compare:
        compare(runner.engine, ids, args)
        return
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
        (doc,) = runner.compute_sampled_batch([ids], errors="raise")
        times.append(time.perf_counter() - start)
    print(
        f"GPT-2-small shape, T={args.tokens}, P={args.positions}, blocks {args.layers}: "
        f"{len(keys)} position Jacobians, {min(times):.1f} s per document "
        f"(best of {args.repeats}; torch threads {torch.get_num_threads()}; "
        f"load average {os.getloadavg()[0]:.1f}); values "
        + ", ".join(f"{k}={v:.3f}" for k, v in doc.values.items())
    )


def whole_sequence_seconds(engine, ids: torch.Tensor, rows: int) -> float:
    """Seconds of ``J^0_{n-1, n}`` by the whole-sequence route, extrapolated from ``rows`` VJPs."""
    T, d = ids.shape[0], engine.d
    with engine_mode(engine.model):
        call = record_sequences(engine.model, engine.parts, [ids], engine.dtype)[0].docs[0]
        f, x = call.position_map(T - 2, T - 1)
        cotangents = torch.eye(d, dtype=x.dtype)[None, :, :rows]
        start = time.perf_counter()
        vjp_rows(f, x, cotangents, rows)
        return (time.perf_counter() - start) * d / rows


def compare(engine, ids: torch.Tensor, args) -> None:
    """Print the median seconds of one position Jacobian by each route."""
    T = ids.shape[0]
    new, old = [], []
    engine.position_jacobian(ids[:8], 0, 6, 7)  # warm-up
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.position_jacobian(ids, 0, T - 2, T - 1)
        new.append(time.perf_counter() - start)
        old.append(whole_sequence_seconds(engine, ids, args.rows))
    new_s, old_s = statistics.median(new), statistics.median(old)
    print(
        f"GPT-2-small shape, {args.attn} attention, T={T}, one position Jacobian "
        f"J^0_(n-1,n): engine {new_s:.2f} s, "
        f"whole-sequence route {old_s:.1f} s ({args.rows} of {engine.d} VJPs, extrapolated): "
        f"{old_s / new_s:.0f}x (median of {args.repeats}; torch threads "
        f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
