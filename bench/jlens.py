"""Cost of fitting the Jacobian lens: lm-coupling's route against the public fits' route.

The lens needs, per fitted document, ``d x^L_n / d x^l_n`` for every state l
(``lm_coupling.metrics.jacobian_lens``). Two routes, on a random model of
GPT-2-small shape (12 layers, d 768, 128-token prompt, float32, CPU):

* ``naive`` (what the public fits do): per layer l, one forward pass of the
  whole prompt with ``x^l_n`` as a leaf, then one backward pass through the
  whole sequence per output coordinate of ``x^L_n`` (d passes per layer). On a
  CPU the d passes are too slow to run whole, so ``--naive-rows`` rows of every
  layer are timed and the per-row cost is extrapolated to d rows (labelled).
* ``engine``: the Jacobian engine's exact block Jacobians on one query token
  against the frozen prefix (``JacobianEngine.dense_jacobians``, the route the
  ``dense`` coupling route uses), then the L products
  ``(I + J^L) ... (I + J^{l+1})`` (``jacobian_products``), timed apart.

``max|dJ|`` is the largest difference between the two routes on the rows the
naive route computed (every layer), and ``max|J|`` the scale it compares with.

    python bench/jlens.py --quick      # tiny shape, seconds
    python bench/jlens.py              # GPT-2-small shape (minutes)
"""

from __future__ import annotations

import argparse

import torch
from engine_runs import GPT2_SMALL, build_random_model, random_prompt
from timing import machine_line, median, print_table, timed

from lm_coupling.jacobian.engine import JacobianEngine
from lm_coupling.metrics.jacobian_lens import jacobian_products
from lm_coupling.model.architecture import block_output_hidden


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d 64, 3 layers, 16 tokens")
    parser.add_argument("--tokens", type=int, default=128, help="prompt length T")
    parser.add_argument("--naive-rows", type=int, default=8, help="timed rows per layer")
    parser.add_argument("--repeats", type=int, default=2, help="engine runs (median)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = min(args.tokens, 16)
    return args


def naive_rows(
    model, parts, ids: torch.Tensor, layer: int, rows: int, device: str = "cpu"
) -> tuple[torch.Tensor, float, float]:
    """The first ``rows`` rows of ``d x^L_n / d x^layer_n``: one whole-sequence backward each.

    Returns:
        ``(rows [rows, d], seconds of the forward pass, seconds per backward pass)``.
    """
    n = ids.shape[0] - 1
    kept = {}

    def make_leaf(_module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        leaf = h[:, n].detach().clone().requires_grad_(True)
        kept["leaf"] = leaf
        h = torch.cat([h[:, :n], leaf[:, None], h[:, n + 1 :]], dim=1)
        if args:
            return (h, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h}

    def keep_last(_module, _args, output):
        kept["out"] = block_output_hidden(output)[0, n]

    handles = [
        parts.blocks[layer].register_forward_pre_hook(make_leaf, with_kwargs=True),
        parts.blocks[-1].register_forward_hook(keep_last),
    ]
    try:
        with torch.enable_grad():
            _, t_forward = timed(lambda: model(ids[None]), device)
            out, leaf = kept["out"], kept["leaf"]
            grads, t_rows = timed(
                lambda: [
                    torch.autograd.grad(out[i], leaf, retain_graph=True)[0][0] for i in range(rows)
                ],
                device,
            )
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(grads), t_forward, t_rows / rows


def engine_fit(model, parts, ids, device: str = "cpu") -> tuple[torch.Tensor, float, float]:
    """``(J [L+1, d, d], seconds of the block Jacobians, seconds of the products)``."""
    engine = JacobianEngine(model, parts, k_max=1)
    blocks, t_blocks = timed(lambda: engine.dense_jacobians(ids), device)
    products, t_products = timed(lambda: jacobian_products(blocks), device)
    return products, t_blocks, t_products


def main(argv=None) -> None:
    """Time both routes and print one table."""
    args = parse_args(argv)
    sizes = dict(GPT2_SMALL)
    if args.quick:
        sizes = {"d_model": 64, "d_ff": 256, "n_heads": 4, "n_layers": 3}
    vocab = 8192
    model, parts = build_random_model(
        "gpt2", vocab=vocab, max_len=args.tokens, device="cpu", dtype=torch.float32, **sizes
    )
    ids = random_prompt(vocab, args.tokens, "cpu")
    L, d = parts.n_layers, parts.d_model
    print(machine_line("cpu"))
    print(f"shape: gpt2 L={L} d={d} T={args.tokens}; naive rows timed per layer: {args.naive_rows}")

    engine_fit(model, parts, ids)  # warm-up, not timed
    runs = [engine_fit(model, parts, ids) for _ in range(args.repeats)]
    J = runs[0][0]
    t_blocks = median([r[1] for r in runs])
    t_products = median([r[2] for r in runs])
    t_engine = t_blocks + t_products

    rows = min(args.naive_rows, d)
    t_naive, diff = 0.0, 0.0
    for layer in range(L):
        got, t_forward, t_row = naive_rows(model, parts, ids, layer, rows)
        t_naive += t_forward + t_row * d  # one forward, d backward passes (extrapolated)
        diff = max(diff, float((got - J[layer, :rows]).abs().max()))
    scale = float(J[:L].abs().max())
    label = "naive (extrapolated)" if rows < d else "naive"
    print_table(
        "Jacobian-lens fit, one document (all L layers)",
        ("route", "s/doc", "s/layer", "speed-up", "max|dJ|", "max|J|"),
        [
            (label, t_naive, t_naive / L, 1.0, None, None),
            ("engine (blocks + products)", t_engine, t_engine / L, t_naive / t_engine, diff, scale),
            ("  of which products", t_products, t_products / L, None, None, None),
        ],
    )


if __name__ == "__main__":
    main()
