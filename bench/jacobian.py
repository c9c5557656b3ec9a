"""CPU targets of the Jacobian engine: our default route vs the authors' route, one table.

Rows (issue 10, "Targets"), each the median of ``--repeats`` interleaved runs:

* ``gpt2-small``: GPT-2-small shape (12 layers, d 768, 12 heads, 128 tokens,
  random float32 weights), the full 12 x 12 coupling matrix at K = 10. The
  authors' route (d backward passes through the whole sequence per block,
  full SVD, coupling from the dense Jacobians; on ``--naive-layers`` blocks,
  default all) against every engine route; ``max|dC|`` is the largest
  coupling-matrix difference from the authors' route on the blocks both ran,
  and a speed-up counts only where it is <= 1e-4 (printed per row).
* ``llama-7b``: two Llama-7B-shaped blocks (d 4096, d_ff 11008, 32 heads),
  the engine's default route and its exact ``dense`` route (``--routes`` for
  others). The authors' route is too slow to run whole on a CPU (d = 4096
  backward passes per block, each through the whole sequence), so it is timed
  on ``--naive-rows`` of the d rows of block 0 (every row is the same work)
  and extrapolated to d rows, plus a timed full SVD of that block's 4096 x
  4096 Jacobian (labelled so); ``max|dC|`` is against the ``dense`` route.

Each shape also prints its FLOOR, measured on this machine: the seconds per
layer of the d products' matrix multiplications alone (for every 2-D weight W
of a block, ``C @ W`` with d rows in C: the same GEMMs as the d VJPs, batched,
no autograd, no elementwise work) plus the cheapest exact top-(K+1)
factorisation of that layer's d x d Jacobian among a full float32 SVD, a full
float64 ``eigh`` of ``J^T J`` and the partial float64 eigensolver of the
``gram`` route (Gram matrix formation included); ``x floor`` is each route's
seconds per layer over that floor.

``--through-lm-eval`` adds the per-document cost of coupling inside
``lm_eval --metrics coupling`` at ARC prompt length (``lmc_arc_challenge_offline``,
a GPT-2-small-shaped random model with an 8k BPE vocabulary): two fresh-process
runs on the same documents, ``coupling_docs=N`` and ``coupling_docs=0``; their
wall-time difference divided by the documents that got coupling, next to the
engine's cost on the same tokenized prompts in this process. The gap between the
two is the capture around the engine (recording the prompt's block inputs and the
per-document bookkeeping).

    python bench/jacobian.py --quick                     # smoke run, seconds
    python bench/jacobian.py                             # both shapes (long: see README)
    python bench/jacobian.py --shapes none --through-lm-eval   # the CLI's cost only
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
from pathlib import Path

import torch
from engine_runs import (
    GPT2_SMALL,
    LLAMA_7B,
    authors_coupling,
    build_random_model,
    default_route,
    engine_coupling,
    engine_routes,
    max_diff,
    random_prompt,
    route_summary,
)
from timing import machine_line, median, print_table, timed

from lm_coupling.jacobian.calls import compute_dtype, engine_mode
from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.jacobian.linalg import top_eigh
from lm_coupling.jacobian.sequence import record_sequences

TOLERANCE = 1e-4
HEADER = (
    "row",
    "s/layer",
    "s/doc",
    "speed-up",
    "x floor",
    "max|dC|",
    "vs",
    "counts",
    "layer routes",
)
FLOOR_HEADER = ("shape", "GEMMs", "svd f32", "eigh f64", "partial f64", "floor")
SHAPES = {"gpt2-small": ("gpt2", GPT2_SMALL), "llama-7b": ("llama", {**LLAMA_7B, "n_layers": 2})}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="reduced shapes, seconds")
    parser.add_argument("--dtype", default="float32", help="weights (the engine uses float32)")
    parser.add_argument("--shapes", default="gpt2-small,llama-7b", help="or none")
    parser.add_argument("--layers", type=int, default=None, help="blocks (12; llama-7b: 2)")
    parser.add_argument("--tokens", type=int, default=128, help="prompt length T")
    parser.add_argument("--k", type=int, default=10, help="K singular vectors")
    parser.add_argument(
        "--routes", default=None, help="engine routes (gpt2-small: all; llama-7b: default, dense)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs")
    parser.add_argument("--naive-layers", type=int, default=None, help="gpt2: authors' blocks")
    parser.add_argument("--naive-rows", type=int, default=32, help="llama: authors' rows")
    parser.add_argument("--through-lm-eval", action="store_true")
    parser.add_argument("--docs", type=int, default=10, help="--through-lm-eval documents")
    args = parser.parse_args(argv)
    if args.routes:
        args.routes = args.llama_routes = args.routes.split(",")
    else:
        args.routes = list(engine_routes())
        args.llama_routes = list(dict.fromkeys([default_route(), "dense"]))
    args.shapes = [name for name in args.shapes.split(",") if name not in ("", "none")]
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        raise SystemExit(f"unknown --shapes {unknown}; choose from {list(SHAPES)}")
    if args.quick:
        args.tokens, args.repeats, args.docs = min(args.tokens, 16), min(args.repeats, 2), 2
        args.naive_rows = min(args.naive_rows, 16)
    return args


def shape_of(name: str, args: argparse.Namespace) -> tuple[str, dict]:
    """Architecture and sizes of shape ``name`` (``--quick``: d 64; ``--layers`` applied)."""
    arch, sizes = SHAPES[name]
    sizes = dict(sizes)
    if args.quick:
        sizes = {"d_model": 64, "d_ff": 172 if arch == "llama" else 256, "n_heads": 4}
        sizes["n_layers"] = 2 if arch == "llama" else 3
    if args.layers is not None:
        sizes["n_layers"] = args.layers
    return arch, sizes


def gemm_seconds(parts, device: str) -> float:
    """Seconds of the d products' GEMMs through block 0: ``C [d, in] @ W`` per 2-D weight."""
    d, dtype = parts.d_model, compute_dtype(parts)
    weights = [p.detach().to(dtype) for p in parts.blocks[0].parameters() if p.dim() == 2]
    cotangents = [torch.ones(d, w.shape[0], dtype=dtype, device=w.device) for w in weights]

    def run():
        for c, w in zip(cotangents, weights, strict=True):
            c @ w

    return timed(run, device)[1]


def factorisation_seconds(J: torch.Tensor, k: int, device: str) -> dict[str, float]:
    """Seconds of each exact top-(K+1) factorisation of one ``[d, d]`` Jacobian."""

    def gram(matrix):
        J64 = matrix.double()
        return J64.T @ J64

    return {
        "svd f32": timed(lambda: torch.linalg.svd(J), device)[1],
        "eigh f64": timed(lambda: torch.linalg.eigh(gram(J)), device)[1],
        "partial f64": timed(lambda: top_eigh(gram(J)[None], k + 1), device)[1],
    }


def floor_row(name: str, rounds: list[tuple[float, dict]]) -> tuple:
    """One row of the floor table from per-round ``(GEMM seconds, factorisations)``."""
    gemm = median([g for g, _ in rounds])
    fact = {key: median([f[key] for _, f in rounds]) for key in rounds[0][1]}
    return (name, gemm, *fact.values(), gemm + min(fact.values()))


def _floor_round(parts, J0: torch.Tensor, args) -> tuple[float, dict]:
    return gemm_seconds(parts, args.device), factorisation_seconds(J0, args.k, args.device)


def _engine_runs(model, parts, ids, args, runs: dict) -> None:
    """One timed document per engine route (the keys of ``runs``), appended to ``runs[route]``."""
    for route in runs:
        (m, factors), seconds = timed(
            lambda r=route: engine_coupling(model, parts, ids, args.k, r), args.device
        )
        runs[route].append((seconds, m.cpu(), route_summary(factors)))


def _engine_rows(
    name: str, runs: dict, L: int, ref: torch.Tensor, ref_name: str, base: float, floor: float
):
    rows = []
    default = default_route()
    for route, results in runs.items():
        seconds = median([r[0] for r in results])
        diff = max_diff(results[-1][1], ref)
        counts = "yes" if diff <= TOLERANCE else "NO"
        label = f"{name} engine {route}" + (" (default)" if route == default else "")
        speed = base / (seconds / L)
        rows.append(
            (label, seconds / L, seconds, speed, seconds / L / floor, diff, ref_name, counts)
            + (results[-1][2],)
        )
    return rows


def gpt2_rows(args: argparse.Namespace, floors: list) -> list[tuple]:
    """GPT-2-small shape: the full coupling matrix, authors' route vs every engine route.

    Appends the shape's floor row to ``floors``.
    """
    arch, sizes = shape_of("gpt2-small", args)
    model, parts = build_random_model(
        arch, vocab=8192, max_len=args.tokens, device=args.device, dtype=_dtype(args), **sizes
    )
    ids = random_prompt(8192, args.tokens, args.device)
    L = parts.n_layers
    n_naive = min(args.naive_layers or L, L)
    print(f"gpt2-small: {sizes}, T={args.tokens}, K={args.k}, authors' route on {n_naive} blocks")
    _warm_up(model, parts, ids, args.routes)
    J0 = JacobianEngine(model, parts, k_max=args.k).dense_jacobians(ids)[0]
    naive, runs, rounds = [], {route: [] for route in args.routes}, []
    for i in range(args.repeats):
        m, seconds = timed(
            lambda: authors_coupling(model, parts, ids, args.k, n_naive), args.device
        )
        naive.append((seconds, m.cpu()))
        _engine_runs(model, parts, ids, args, runs)
        rounds.append(_floor_round(parts, J0, args))
        print(f"  round {i + 1}: authors' {seconds:.1f} s", flush=True)
    per_layer = median([s for s, _ in naive]) / n_naive
    floors.append(floor_row("gpt2-small", rounds))
    floor = floors[-1][-1]
    label = f"gpt2-small authors' route ({n_naive} of {L} blocks)"
    row = (label, per_layer, per_layer * L, 1.0, per_layer / floor, None, None, None)
    rows = [row + ("d backward + SVD",)]
    return rows + _engine_rows("gpt2-small", runs, L, naive[-1][1], "authors", per_layer, floor)


def authors_rows_seconds(model, parts, ids, n_rows: int) -> float:
    """Seconds of ``n_rows`` of the authors' d backward passes through block 0 (whole sequence)."""
    with engine_mode(model):
        call = record_sequences(model, parts, [ids], compute_dtype(parts))[0].docs[0]
        params = call.params()
        with torch.enable_grad():
            X = call.hidden.detach().clone().requires_grad_(True)
            out = call.run(X, params)[0, -1] - X[0, -1]

            def rows():
                for i in range(n_rows):
                    torch.autograd.grad(out[i], X, retain_graph=True)

            return timed(rows, str(ids.device))[1]


def llama_rows(args: argparse.Namespace, floors: list) -> list[tuple]:
    """Two Llama-7B-shaped blocks: authors' route (rows extrapolated) vs the default route.

    Appends the shape's floor row to ``floors``.
    """
    arch, sizes = shape_of("llama-7b", args)
    model, parts = build_random_model(
        arch, vocab=32000, max_len=args.tokens, device=args.device, dtype=_dtype(args), **sizes
    )
    ids = random_prompt(32000, args.tokens, args.device)
    L, d = parts.n_layers, parts.d_model
    n_rows = min(args.naive_rows, d)
    print(f"llama-7b: {sizes}, T={args.tokens}, K={args.k}, authors' route: {n_rows} of {d} rows")
    _warm_up(model, parts, ids, args.llama_routes)
    block0 = dataclasses.replace(parts, blocks=parts.blocks[:1])
    J0 = JacobianEngine(model, block0, k_max=args.k, method="dense").dense_jacobians(ids)[0]
    naive, runs, rounds = [], {route: [] for route in args.llama_routes}, []
    for i in range(args.repeats):
        rows_s = authors_rows_seconds(model, parts, ids, n_rows)
        rounds.append(_floor_round(parts, J0, args))
        naive.append(rows_s * d / n_rows + rounds[-1][1]["svd f32"])
        _engine_runs(model, parts, ids, args, runs)
        print(f"  round {i + 1}: authors' {naive[-1]:.1f} s/layer (extrapolated)", flush=True)
    per_layer = median(naive)
    floors.append(floor_row("llama-7b", rounds))
    floor = floors[-1][-1]
    label = f"llama-7b authors' route ({n_rows} of {d} rows, extrapolated)"
    row = (label, per_layer, per_layer * L, 1.0, per_layer / floor, None, None, None)
    rows = [row + ("d backward + SVD",)]
    ref = runs["dense"][-1][1] if "dense" in runs else torch.full((L, L), math.nan)
    return rows + _engine_rows("llama-7b", runs, L, ref, "dense", per_layer, floor)


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return getattr(torch, args.dtype)


def _warm_up(model, parts, ids, routes: list[str]) -> None:
    """Untimed first calls of ``routes`` and of the authors' route on a short prompt."""
    for route in routes:
        engine_coupling(model, parts, ids[:4], 2, route)
    authors_rows_seconds(model, parts, ids[:4], 2)


def main(argv=None) -> None:
    """Measure the selected shapes (and optionally through lm-eval) and print one table."""
    args = parse_args(argv)
    print(machine_line(args.device), flush=True)
    rows, floors = [], []
    if "gpt2-small" in args.shapes:
        rows += gpt2_rows(args, floors)
    if "llama-7b" in args.shapes:
        rows += llama_rows(args, floors)
    if args.through_lm_eval:
        from through_lm_eval import lm_eval_rows

        with tempfile.TemporaryDirectory(prefix="lmc-jac-bench-") as tmp:
            rows += lm_eval_rows(args, Path(tmp), shape_of("gpt2-small", args)[1])
    title = (
        f"coupling matrix at K={args.k}, T={args.tokens}, {args.dtype} weights, device "
        f"{args.device}, median of {args.repeats} interleaved runs; a speed-up counts where "
        f"max|dC| <= {TOLERANCE:g}"
    )
    if floors:
        floor_title = (
            "floor of the exact route, s/layer: d products' GEMMs alone + the cheapest exact "
            "top-(K+1) factorisation (median of the rounds)"
        )
        print_table(floor_title, FLOOR_HEADER, floors)
    print_table(title, HEADER, rows)
    print(machine_line(args.device))


if __name__ == "__main__":
    main()
