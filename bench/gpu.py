"""One command, one table: coupling at Llama-7B shape and geometry's overhead inside lm-eval.

Rows of the table (issue 10, "One command measures it on a GPU"):

* ``engine <route> K=<k>``: one document's full L x L coupling matrix on a
  Llama-7B-shaped stack (d 4096, d_ff 11008, 32 heads, random weights in
  ``--dtype``, a 512-token prompt; all 32 blocks when they fit in GPU memory,
  else as many as fit, and the header says so): ``JacobianEngine.factors`` on
  every block plus the coupling matrix, for every ``method=`` the engine
  offers, at K = 10 and K = d/10 (410). Seconds per document (median of
  ``--repeats``), peak GPU memory during that document and the peak above the
  model's own weights ("extra"), the engine's own account of the memory it
  held ("engine MiB", ``JacobianFactors.peak_bytes``; also on a CPU), the
  routes the layers took, and the largest difference of the coupling matrix
  from the ``dense`` route's.
* ``engine <default> K=10 batched``: the default route on ``--batch-docs``
  documents at once (``JacobianEngine.factors_batch``, each with its own
  frozen prefix), seconds per document; ``max|dC|`` is against the same
  document computed alone.
* ``authors' route, 1 layer``: d backward passes through the whole sequence
  plus a full SVD (``naive_block_jacobians`` then ``torch.linalg.svd``) on
  the first block; the per-document figure is that layer times L
  (extrapolated, and labelled so).
* ``J-lens fit engine`` and ``J-lens fit naive``: fitting the Jacobian lens
  on one document of the Llama-7B-shaped stack (``bench/jlens.py``'s two
  routes): the engine's dense block Jacobians plus the L products against
  the public fits' route (one whole-sequence backward pass per output
  coordinate and layer; ``--jlens-rows`` rows of every layer timed, then
  extrapolated to d rows, and labelled so), with their largest difference
  on the rows timed. Unmeasured so far: no GPU was lent to the session that
  wrote it (``--quick`` runs it on a CPU at reduced shape).
* ``lm-eval <config> bs=<b>``: ``lm_eval.simple_evaluate`` on a
  Pythia-1B-shaped GPT-NeoX model (d 2048, 16 layers, 8 heads, d_ff 8192,
  embedding 50304 rows, random weights saved to a temporary folder), plain
  ``--model hf`` vs ``--metrics lss,expodistance,equidistance,logit_lens_entropy``
  vs ``--metrics all --metric_args coupling_docs=all``, at ``--batch-size`` and
  at ``auto``. Every run is a fresh subprocess (``lmeval_runs.run_fresh``;
  rounds interleaved); wall time excludes lm-eval's task indexing; memory is
  the process's peak (GPU: ``max_memory_allocated``; CPU: peak RSS). Ratios
  are to ``plain`` at the same batch setting.

``--quick`` uses reduced shapes (seconds on a CPU) so CI exercises the script;
its lm-eval runs skip the untimed warm-up and run two at a time, so its
timings only show that the code runs.
Ratios are printed, never asserted. Columns: ``seconds`` is per document for
the engine rows and per lm-eval run for the lm-eval rows; memory columns are
NaN for the engine rows on a CPU (a process's peak RSS cannot be reset per
route).

    python bench/gpu.py                         # on a GPU: the issue's table
    python bench/gpu.py --device cpu --quick    # reduced shapes (CI)
"""

from __future__ import annotations

import argparse
import math
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from engine_runs import (
    LLAMA_7B,
    authors_coupling,
    build_random_model,
    default_route,
    engine_coupling,
    engine_coupling_batch,
    engine_routes,
    max_diff,
    random_prompt,
    route_summary,
)
from lmeval_runs import DEFAULT_TASKS, TRAJ_LENS, RunSpec, run_fresh, save_random_model
from timing import is_cuda, machine_line, median, peak_mb, print_table, reset_peak, timed

PYTHIA_1B = {"d_model": 2048, "n_layers": 16, "n_heads": 8, "d_ff": 8192}
LM_CONFIGS = {
    "plain": (None, None),
    "traj_lens": (TRAJ_LENS, None),
    "all": ("all", "coupling_docs=all"),
}
HEADER = (
    "row",
    "seconds",
    "ratio",
    "peak MiB",
    "mem ratio",
    "extra MiB",
    "engine MiB",
    "layer routes / batch",
    "max|dC| vs dense",
)
ENGINE_RESERVE = 0.25
"""Share of free GPU memory kept for the engine's work when choosing how many blocks fit."""


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--quick", action="store_true", help="reduced shapes (CI, seconds)")
    parser.add_argument("--dtype", default=None, help="weights (bfloat16 on GPU, else float32)")
    parser.add_argument("--layers", type=int, default=None, help="engine blocks (default: fit)")
    parser.add_argument("--tokens", type=int, default=None, help="engine prompt (512)")
    parser.add_argument("--ks", default=None, help="K values (10,d/10)")
    parser.add_argument("--routes", default=None, help="engine routes (default: all)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds")
    parser.add_argument("--batch-docs", type=int, default=None, help="batched row (8)")
    parser.add_argument("--jobs", type=int, default=None, help="lm-eval processes at a time")
    parser.add_argument("--tasks", default=None, help="lm-eval tasks")
    parser.add_argument("--limit", type=int, default=None, help="documents per task")
    parser.add_argument("--batch-size", default="8", help="the fixed lm-eval batch size")
    parser.add_argument("--jlens-rows", type=int, default=None, help="naive J-lens rows (4)")
    parser.add_argument("--skip", default="", help="engine, jlens and/or lmeval: parts to skip")
    args = parser.parse_args(argv)
    cuda = is_cuda(args.device)
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available; use --device cpu")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.engine_shape = dict(LLAMA_7B)
    args.lm_shape = dict(PYTHIA_1B)
    if args.quick:
        args.engine_shape = {"d_model": 32, "d_ff": 86, "n_heads": 4, "n_layers": 2}
        args.lm_shape = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256}
    args.tokens = args.tokens or (16 if args.quick else 512)
    d = args.engine_shape["d_model"]
    # --quick: two large K (fast convergence of the iterative routes at d = 32)
    default_ks = [10, 12] if args.quick else [10, round(d / 10)]
    ks = [int(k) for k in args.ks.split(",")] if args.ks else default_ks
    args.ks = list(dict.fromkeys(ks))
    args.routes = args.routes.split(",") if args.routes else list(engine_routes())
    args.tasks = args.tasks or ("lmc_arc_easy_offline" if args.quick else DEFAULT_TASKS)
    if args.limit is None:
        args.limit = 2 if args.quick else 50
    args.jobs = args.jobs or (2 if args.quick else 1)
    args.batch_docs = args.batch_docs or (2 if args.quick else 8)
    args.jlens_rows = args.jlens_rows or (2 if args.quick else 4)
    return args


def layers_that_fit(args: argparse.Namespace) -> tuple[int, str]:
    """Blocks of the engine stack: ``--layers``, else all 32 if they fit, else as many as fit."""
    wanted = args.engine_shape["n_layers"]
    if args.layers is not None:
        return args.layers, f"{args.layers} blocks (--layers)"
    if not is_cuda(args.device):
        return wanted, f"all {wanted} blocks"
    d, d_ff = args.engine_shape["d_model"], args.engine_shape["d_ff"]
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    per_block = (4 * d * d + 3 * d * d_ff) * itemsize
    embeddings = 2 * 32000 * d * itemsize
    free, _ = torch.cuda.mem_get_info()
    fit = int((free * (1 - ENGINE_RESERVE) - embeddings) // per_block)
    if fit >= wanted:
        return wanted, f"all {wanted} blocks"
    if fit < 1:
        raise SystemExit(f"not even one block fits in {free / 2**30:.1f} GiB of free GPU memory")
    return fit, f"{fit} of {wanted} blocks (all that fit in {free / 2**30:.1f} GiB free)"


def _engine_stack(args: argparse.Namespace):
    """The Llama-7B-shaped random model, its parts, a prompt and a note on the blocks."""
    n_layers, note = layers_that_fit(args)
    shape = {**args.engine_shape, "n_layers": n_layers}
    vocab = 512 if args.quick else 32000
    model, parts = build_random_model(
        "llama",
        vocab=vocab,
        max_len=args.tokens,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        **shape,
    )
    return model, parts, random_prompt(vocab, args.tokens, args.device), note


def _time_routes(model, parts, ids, args: argparse.Namespace) -> dict[tuple, list[dict]]:
    """Every (route, K) timed on one document, ``--repeats`` interleaved rounds."""
    results = {(route, k): [] for k in args.ks for route in args.routes}
    for _ in range(args.repeats):
        for (route, k), runs in results.items():
            reset_peak(args.device)
            (matrix, factors), seconds = timed(
                lambda r=route, k=k: engine_coupling(model, parts, ids, k, r), args.device
            )
            peak = peak_mb(args.device) if is_cuda(args.device) else math.nan
            engine_mb = getattr(factors, "peak_bytes", math.nan) / 2**20
            runs.append(
                dict(
                    s=seconds,
                    peak=peak,
                    engine_mb=engine_mb,
                    m=matrix.cpu(),
                    routes=route_summary(factors),
                )
            )
            print(f"  {route} K={k}: {seconds:.2f} s", flush=True)
    return results


def _batched_row(model, parts, ids, args: argparse.Namespace, results: dict) -> tuple:
    """The default route on ``--batch-docs`` documents in the engine's batched passes, per document.

    The documents are ``ids`` and rotations of it (same length, different
    tokens); ``max|dC|`` compares the first one with its one-at-a-time value.
    """
    route, k, n = default_route(), args.ks[0], args.batch_docs
    prompts = [torch.roll(ids, shift) for shift in range(n)]
    engine_coupling_batch(model, parts, [p[:8] for p in prompts[:2]], 2, route)  # warm-up
    reset_peak(args.device)
    matrices, seconds = timed(
        lambda: engine_coupling_batch(model, parts, prompts, k, route), args.device
    )
    peak = peak_mb(args.device) if is_cuda(args.device) else math.nan
    alone = results.get((route, k))
    diff = max_diff(matrices[0].cpu(), alone[-1]["m"]) if alone else math.nan
    row = (seconds / n, None, peak, None, None, None, f"{n} documents batched", diff)
    return (f"engine {route} K={k} batched (max|dC| vs alone)", *row)


def engine_rows(args: argparse.Namespace) -> list[tuple]:
    """Rows of the engine routes and the authors' route (module docstring)."""
    model, parts, ids, note = _engine_stack(args)
    L = parts.n_layers
    print(
        f"engine: Llama-7B shape {args.engine_shape}, {note}, T={args.tokens}, {args.dtype} "
        f"random weights, K={args.ks}, routes={args.routes}, median of {args.repeats}",
        flush=True,
    )
    for route in args.routes:  # warm-up, untimed: first calls, kernels, allocator
        engine_coupling(model, parts, ids[:8], 2, route)
    authors_coupling(model, parts, ids[:4], 2, 1)
    weights_mb = peak_mb(args.device) if is_cuda(args.device) else math.nan
    rows = []
    results = _time_routes(model, parts, ids, args)
    for (route, k), runs in results.items():
        ref = results.get(("dense", k))
        diff = max_diff(runs[-1]["m"], ref[-1]["m"]) if ref else math.nan
        peak = max(r["peak"] for r in runs)
        seconds = median([r["s"] for r in runs])
        engine_mb = max(r["engine_mb"] for r in runs)
        row = (seconds, None, peak, None, peak - weights_mb, engine_mb, runs[-1]["routes"], diff)
        rows.append((f"engine {route} K={k}", *row))
    rows.append(_batched_row(model, parts, ids, args, results))
    reset_peak(args.device)
    _, seconds = timed(lambda: authors_coupling(model, parts, ids, args.ks[0], 1), args.device)
    peak = peak_mb(args.device) if is_cuda(args.device) else math.nan
    label = f"authors' route K={args.ks[0]}: 1 layer x {L} (extrapolated)"
    row = (seconds * L, None, peak, None, peak - weights_mb, None, "d backward + SVD", None)
    return [*rows, (label, *row)]


def jlens_rows(args: argparse.Namespace) -> list[tuple]:
    """Fitting the Jacobian lens on one document: the engine's route against the naive one."""
    from jlens import engine_fit, naive_rows

    model, parts, ids, note = _engine_stack(args)
    L, d = parts.n_layers, parts.d_model
    print(f"J-lens fit: Llama-7B shape, {note}, T={args.tokens}, {args.dtype}", flush=True)
    engine_fit(model, parts, ids[:8], args.device)  # warm-up, untimed
    reset_peak(args.device)
    J, t_blocks, t_products = engine_fit(model, parts, ids, args.device)
    peak = peak_mb(args.device) if is_cuda(args.device) else math.nan
    rows = min(args.jlens_rows, d)
    t_naive, diff = 0.0, 0.0
    for layer in range(L):
        got, t_forward, t_row = naive_rows(model, parts, ids, layer, rows, args.device)
        t_naive += t_forward + t_row * d  # one forward, d backward passes (extrapolated)
        diff = max(diff, float((got.float() - J[layer, :rows].to(got.device).float()).abs().max()))
    del J
    t_engine = t_blocks + t_products
    routes = f"blocks {t_blocks:.1f} s + products {t_products:.1f} s"
    naive = "naive (extrapolated)" if rows < d else "naive"
    return [
        ("J-lens fit engine, 1 doc (max|dJ| vs naive)", t_engine, None, peak, None, None, None,
         routes, diff),
        (f"J-lens fit {naive}, 1 doc", t_naive, t_naive / t_engine, None, None, None, None,
         f"{rows} of {d} rows per layer timed", None),
    ]  # fmt: skip


def _lmeval_runs(model_dir: str, batches: list[str], args) -> dict[tuple, list[dict]]:
    """Every (configuration, batch size) in a fresh process, ``--repeats`` interleaved rounds.

    ``--jobs`` processes run at a time (1 unless ``--quick``, whose timings only
    exercise the code).
    """
    keys = [(name, batch) for batch in batches for name in LM_CONFIGS]
    todo = [(key, _lmeval_spec(model_dir, *key, args)) for _ in range(args.repeats) for key in keys]
    runs: dict[tuple, list[dict]] = {key: [] for key in keys}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for (key, _), out in zip(todo, pool.map(run_fresh, [s for _, s in todo]), strict=True):
            runs[key].append(out)
            print(f"  {key[0]} bs={key[1]}: {out['wall_s']:.2f} s", flush=True)
    return runs


def _lmeval_spec(model_dir: str, name: str, batch: str, args) -> RunSpec:
    metrics, metric_args = LM_CONFIGS[name]
    return RunSpec(
        model_dir, args.tasks, args.limit, batch, args.device, args.dtype, metrics, metric_args,
        warm_up=not args.quick,
    )  # fmt: skip


def lmeval_rows(args: argparse.Namespace) -> list[tuple]:
    """Rows of the lm-eval overhead runs (module docstring), ratios to ``plain``."""
    batches = [args.batch_size, "auto"]
    with tempfile.TemporaryDirectory(prefix="lmc-gpu-bench-") as tmp:
        model_dir = save_random_model(
            Path(tmp) / "model",
            "gpt_neox",
            tokenizer_vocab=512 if args.quick else 8192,
            model_vocab=None if args.quick else 50304,
            dtype=args.dtype,
            max_len=256 if args.quick else 2048,
            **args.lm_shape,
        )
        print(
            f"lm-eval: Pythia-1B shape {args.lm_shape}, {args.dtype} random weights, "
            f"tasks={args.tasks}, limit={args.limit}, batch sizes {batches}",
            flush=True,
        )
        runs = _lmeval_runs(str(model_dir), batches, args)
    rows = []
    for (name, batch), results in runs.items():
        wall = median([r["wall_s"] for r in results])
        base = median([r["wall_s"] for r in runs[("plain", batch)]])
        peak = max(r["peak_mb"] for r in results)
        base_peak = max(r["peak_mb"] for r in runs[("plain", batch)])
        chosen = ",".join(str(b) for b in results[-1]["batch_sizes"]) or batch
        coupled = f"bs {chosen}; coupled {results[-1]['n_coupling']}"
        row = (wall, wall / base, peak, peak / base_peak, None, None, coupled, None)
        rows.append((f"lm-eval {name} bs={batch}", *row))
    return rows


def main(argv=None) -> None:
    """Measure the parts not skipped and print one table."""
    args = parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    print(machine_line(args.device), flush=True)
    rows = []
    if "engine" not in skip:
        rows += engine_rows(args)  # frees the Llama-shaped model on return
        if is_cuda(args.device):
            torch.cuda.empty_cache()  # leave the GPU to the lm-eval subprocesses
    if "jlens" not in skip:
        rows += jlens_rows(args)
        if is_cuda(args.device):
            torch.cuda.empty_cache()
    if "lmeval" not in skip:
        rows += lmeval_rows(args)
    shape = "reduced shapes (--quick)" if args.quick else "Llama-7B / Pythia-1B shapes"
    print_table(f"bench/gpu.py on {args.device}, {shape}", HEADER, rows)
    print(machine_line(args.device))


if __name__ == "__main__":
    main()
