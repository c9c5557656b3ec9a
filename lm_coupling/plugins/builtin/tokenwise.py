"""Built-in token-wise coupling metrics (opt-in): couplings between positions.

The ICLR 2025 paper (section 3.1) measures coupling not only between blocks at
the last token but between Jacobians of different positions,
``J^l_{t1 t2} = d block_l(X)_{t2} / d x^{l-1}_{t1}`` (residual branch on the
diagonal t1 = t2). On the last P positions ``t = n-P+1 .. n`` of a sampled
prompt and the chosen blocks:

- ``tokenwise_self_coupling``: ``J^l_{tt}`` against ``J^{l'}_{t't'}`` over
  every (block, position) pair; matrix ``[n_blocks * P, n_blocks * P]``,
  block-major (rows ``(l, t)`` in the order of ``tokenwise_layers``, then t);
- ``tokenwise_context_fixed_input``: per block, ``J^l_{t1 t2}`` across output
  tokens t2, input token fixed at ``t1 = n-P+1``; matrices ``[n_blocks, P, P]``;
- ``tokenwise_context_fixed_output``: per block, ``J^l_{t1 n}`` across input
  tokens t1, output token fixed at n; matrices ``[n_blocks, P, P]``.

The per-document value is the mean coupling over ordered pairs i != j (and
blocks). A prompt shorter than P has fewer positions: its missing rows and
columns are NaN (aligned so that the last index is always n) and its value
averages the pairs it has. Cost: ``3P - 3`` dense d x d position Jacobians per
block (d products each, through the rows between the two positions only) and
as many SVDs, per sampled document; see ``DEFAULT_TOKENWISE_DOCS``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lm_coupling.plugins.builtin.coupling import ABS, NORM
from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.options import parse_at_least, parse_doc_count, parse_k
from lm_coupling.plugins.specs import UNIT_INTERVAL, MetricSpec, OptionSpec, ProfileSpec, used_k

if TYPE_CHECKING:  # the math (and torch) load when a batch is computed, not on declaring
    from lm_coupling.states import GeometryStates

SELF = "tokenwise_self_coupling"
FIXED_INPUT = "tokenwise_context_fixed_input"
FIXED_OUTPUT = "tokenwise_context_fixed_output"
_OWN = (SELF, FIXED_INPUT, FIXED_OUTPUT)


def parse_layers(text: str) -> tuple[int, ...] | None:
    """``all`` -> None; ``0:-1`` -> (0, -1): block indices separated by ``:``."""
    if text.strip().lower() == "all":
        return None
    try:
        layers = tuple(int(word) for word in text.split(":"))
    except ValueError:
        raise ValueError(
            f"expected 'all' or block indices separated by ':' (e.g. 0:5:-1), found {text!r}"
        ) from None
    if len(set(layers)) != len(layers):
        raise ValueError(f"block listed twice in {text!r}")
    return layers


DEFAULT_TOKENWISE_DOCS = 8
"""Documents per task that get the token-wise metrics, by default: about a minute
per task at GPT-2-small shape on a 2-core CPU (``bench/tokenwise_cost.py``)."""

DOCS = OptionSpec(
    "tokenwise_docs",
    DEFAULT_TOKENWISE_DOCS,
    "documents per task that get the token-wise coupling metrics: a number, or all",
    parse_doc_count,
)
LAYERS = OptionSpec(
    "tokenwise_layers",
    (0, -1),
    "blocks of the token-wise coupling: all, or indices separated by ':' (negative from the "
    "end), e.g. 0:-1 (default: first and last)",
    parse_layers,
)
POSITIONS = OptionSpec(
    "tokenwise_positions",
    4,
    "token-wise coupling on the last P positions n-P+1..n",
    parse_at_least(1),
)
K = OptionSpec(
    "tokenwise_k",
    10,
    "singular vectors of the token-wise coupling: an integer or a fraction",
    parse_k,
)
_OPTIONS = (DOCS, LAYERS, POSITIONS, K, NORM, ABS)
_NEEDS = frozenset({"tokenwise_jacobian"})


@hookimpl
def lmc_declare_metrics():
    """Declare the three token-wise coupling metrics (opt-in, sampled)."""
    described = {
        SELF: "token-wise self-coupling: J^l_tt against J^l'_t't' over blocks and last positions",
        FIXED_INPUT: "context coupling, input token fixed: J^l_{t1 t2} across output tokens t2",
        FIXED_OUTPUT: "context coupling, output token fixed: J^l_{t1 n} across input tokens t1",
    }
    return [
        MetricSpec(
            name,
            description,
            _NEEDS,
            _OPTIONS,
            profiles=(
                ProfileSpec(
                    name,
                    "matrix",
                    name.replace("_", " "),
                    UNIT_INTERVAL,
                    axes=(None,) * (2 if name == SELF else 3),  # [n_blocks P]^2, [n_blocks, P, P]
                ),
            ),
            k_option="tokenwise_k",
            sample_option="tokenwise_docs",
            sampled=True,
            higher_is_better=True,
            opt_in=True,
            label=name.replace("_", " "),
            bounds=UNIT_INTERVAL,
        )
        for name, description in described.items()
    ]


def resolve_layers(layers: tuple[int, ...] | None, n_layers: int) -> list[int]:
    """Block indices in [0, L) in the order given (``None``: every block).

    Raises:
        ValueError: an index outside [-L, L).
    """
    if layers is None:
        return list(range(n_layers))
    bad = [layer for layer in layers if not -n_layers <= layer < n_layers]
    if bad:
        raise ValueError(
            f"tokenwise_layers {bad} outside the model's {n_layers} blocks "
            f"(use 0..{n_layers - 1}, or -1 for the last)"
        )
    return [layer % n_layers for layer in layers]


@hookimpl
def lmc_position_jacobian_keys(selected, options, n_layers: int, n_tokens: int):
    """The ``(layer, t_in, t_out)`` keys the selected token-wise metrics need."""
    wanted = set(_OWN) & set(selected)
    if not wanted:
        return None
    positions = list(range(max(0, n_tokens - options["tokenwise_positions"]), n_tokens))  # P last
    first, last = positions[0], positions[-1]
    keys = set()
    for layer in resolve_layers(options["tokenwise_layers"], n_layers):
        if SELF in wanted:
            keys |= {(layer, t, t) for t in positions}
        if FIXED_INPUT in wanted:
            keys |= {(layer, first, t) for t in positions}
        if FIXED_OUTPUT in wanted:
            keys |= {(layer, t, last) for t in positions}
    return sorted(keys)


def _one_document(jacobians, options, n_layers: int, d_model: int, wanted) -> dict:
    """Matrices of one document, NaN-padded to P positions (last index = n)."""
    import torch

    from lm_coupling.metrics.tokenwise import (
        context_coupling_fixed_input,
        context_coupling_fixed_output,
        self_coupling,
    )

    P = options["tokenwise_positions"]
    layers = resolve_layers(options["tokenwise_layers"], n_layers)
    nl = len(layers)
    out = {
        SELF: torch.full((nl * P, nl * P), math.nan),
        FIXED_INPUT: torch.full((nl, P, P), math.nan),
        FIXED_OUTPUT: torch.full((nl, P, P), math.nan),
    }
    if not jacobians:
        return out
    n = max(key[2] for key in jacobians)
    slot = {t: P - 1 - (n - t) for t in range(n - P + 1, n + 1)}
    kw = dict(norm=options["norm"], elementwise_abs=options["elementwise_abs"])
    k = used_k(options["tokenwise_k"], d_model)
    if SELF in wanted:
        diag = {key: j for key, j in jacobians.items() if key[1] == key[2] and key[0] in layers}
        labels, c = self_coupling(diag, k, **kw)
        index = [layers.index(layer) * P + slot[t] for layer, t in labels]
        out[SELF][torch.tensor(index)[:, None], torch.tensor(index)[None, :]] = c.float().cpu()
    for i, layer in enumerate(layers):
        if FIXED_INPUT in wanted:
            first = min(key[1] for key in jacobians)
            ts, c = context_coupling_fixed_input(jacobians, layer, first, k, **kw)
            idx = torch.tensor([slot[t] for t in ts])
            out[FIXED_INPUT][i][idx[:, None], idx[None, :]] = c.float().cpu()
        if FIXED_OUTPUT in wanted:
            ts, c = context_coupling_fixed_output(jacobians, layer, n, k, **kw)
            idx = torch.tensor([slot[t] for t in ts])
            out[FIXED_OUTPUT][i][idx[:, None], idx[None, :]] = c.float().cpu()
    return out


@hookimpl
def lmc_compute_batch(selected, states: GeometryStates, options):
    """Token-wise couplings of each sampled document (NaN elsewhere)."""
    import torch

    from lm_coupling.metrics.tokenwise import mean_offdiagonal

    wanted = set(_OWN) & set(selected)
    if not wanted or not states.tokenwise:
        return None
    docs = [
        _one_document(jac, options, states.n_layers, states.d_model, wanted)
        for jac in states.tokenwise
    ]
    values, profiles = {}, {}
    for name in sorted(wanted):
        values[name] = torch.stack([mean_offdiagonal(doc[name]) for doc in docs]).float()
        profiles[name] = torch.stack([doc[name] for doc in docs])
    return {"values": values, "profiles": profiles}


@hookimpl
def lmc_aggregate_task(selected, profiles, options):
    """Record the blocks and positions the token-wise matrices are indexed by."""
    wanted = [name for name in _OWN if name in selected]
    if not wanted:
        return None
    P = options["tokenwise_positions"]
    layers = options["tokenwise_layers"]
    shapes = [len((profiles.get(name) or {}).get("mean") or []) for name in wanted]
    n_blocks = shapes[0] // P if wanted[0] == SELF else shapes[0]
    return {
        "tokenwise": {
            "blocks": list(range(n_blocks)) if layers is None else list(layers),
            "positions": [f"n-{P - 1 - i}" if i < P - 1 else "n" for i in range(P)],
            "fixed_input": f"n-{P - 1}" if P > 1 else "n",
            "fixed_output": "n",
            "k": options["tokenwise_k"],
            "norm": options["norm"],
        }
    }
