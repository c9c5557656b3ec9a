"""The two passes of the Jacobian engine over the blocks, for a batch of B documents.

Pass one (:func:`top_factors`) finds the top K+1 singular triplets of every
block Jacobian, layer by layer, by one of the routes:

- ``dense``: J^l exactly from d products (VJPs), then a full SVD (the reference).
- ``gram``: J^l from d products, then the top K+1 eigenpairs of ``J^T J`` in
  float64 (``jacobian.linalg.gram_top``): as accurate as the full SVD, cheaper.
- ``krylov``: never forms J^l: restarted block Krylov iteration on ``J^T J``
  warm-started from the previous layer's V (``jacobian.krylov``).
- ``auto``: ``gram`` when ``d <= dense_max_d``; otherwise ``krylov`` within
  the cost of the exact route, and ``gram`` for a document whose layer did
  not converge and is not ill-defined.

Pass two
(:func:`reduce_products`) forms, per layer l, ``J^l V_m`` (and ``J^l U_m``)
for all m, a layer-group at a time, and hands each group at once to the
requesting plugin's pair reduction (``JacobianRequest.pair_reduction``; the
coupling plugin's is ``A[l, m] = U_m^T J^l V_m``, and ``B[l, m] = V_m^T J^l
U_m`` swapped): the engine never holds the ``[L, L, d, K]`` products, and its
extra memory grows linearly in L (the reductions aside). The engine knows no
metric: what a pair reduces to is the plugin's.

Each block's triplets and Jacobian stay on that block's device (model split
over GPUs); only the K x K results move to the output device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm_coupling.jacobian.calls import BlockCall
from lm_coupling.jacobian.krylov import block_krylov_svd
from lm_coupling.jacobian.linalg import (
    PRODUCTS,
    Clock,
    TopK,
    dense_jacobian,
    gram_top,
    jvp_columns,
    svd_top,
)

__all__ = [
    "FACTORISATION",
    "REDUCTION",
    "LayerTop",
    "MemoryLedger",
    "RouteSettings",
    "reduce_products",
    "top_factors",
]

FACTORISATION = "factorisation"
"""``Clock`` span of pass one's linear algebra (everything but the products)."""

REDUCTION = "reduction"
"""``Clock`` span of pass two (``A`` and ``B`` of one layer, JVPs included)."""


class MemoryLedger:
    """The bytes the engine holds, and their peak (plus the CUDA allocator's peak on GPUs).

    ``hold(key, *tensors)`` counts tensors under a key (replacing what the key
    held), ``release(key)`` forgets them. Counted: every layer's triplets,
    kept dense Jacobians, pass two's gathered U, V and one group of products;
    not counted: the ``[L, L, K, K]`` results, autograd temporaries and the
    iterative routes' per-layer bases (transient, independent of L). On
    CUDA devices the allocator's peak since construction is also read, and
    ``peak`` is the larger of the two.
    """

    def __init__(self, devices: list[torch.device]):
        self._held: dict[str, int] = {}
        self._peak = 0
        self._cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self._cuda_start = {}
        for index in self._cuda:
            torch.cuda.reset_peak_memory_stats(index)
            self._cuda_start[index] = torch.cuda.memory_allocated(index)

    def hold(self, key: str, *tensors: torch.Tensor | None) -> None:
        """Count ``tensors`` under ``key``."""
        self._held[key] = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        self._peak = max(self._peak, sum(self._held.values()))

    def release(self, key: str) -> None:
        """Forget what ``key`` held."""
        self._held.pop(key, None)

    @property
    def peak(self) -> int:
        """Peak bytes held (or allocated on CUDA devices above the start level)."""
        cuda = sum(torch.cuda.max_memory_allocated(i) - self._cuda_start[i] for i in self._cuda)
        return int(max(self._peak, cuda))


@dataclass
class RouteSettings:
    """How pass one chooses and runs a route (see ``JacobianEngine``)."""

    method: str
    k: int
    dense_max_d: int
    block: int
    max_iters: int
    tol: float
    ill_gap: float
    keep_bytes: int
    seed: int


@dataclass
class LayerTop:
    """One layer's triplets, route per document, kept Jacobian, and the seconds of both passes.

    ``clock.seconds`` holds ``PRODUCTS`` and ``FACTORISATION`` (pass one) and
    ``REDUCTION`` (pass two), for the whole batch.
    """

    top: TopK
    routes: list[str]
    clock: Clock
    J: torch.Tensor | None = None


def _merge(base: TopK, other: TopK, rows: torch.Tensor) -> TopK:
    """``base`` with the documents in ``rows`` replaced by ``other``'s."""
    for name in ("U", "S", "V", "iterations", "residual", "converged", "ill_defined"):
        getattr(base, name)[rows] = getattr(other, name)[rows].to(getattr(base, name).dtype)
    return base


def _exact(f, x, chunk: int, rs: RouteSettings, method: str, clock: Clock):
    """``(TopK, J)`` of the exact ``dense`` or ``gram`` route, each half timed."""
    with clock.span(PRODUCTS):
        J = dense_jacobian(f, x, chunk)
    with clock.span(FACTORISATION):
        top = (svd_top if method == "dense" else gram_top)(J, rs.k, rs.ill_gap)
    return top, J


def _layer_top(call: BlockCall, chunk: int, rs: RouteSettings, generator, warm) -> LayerTop:
    """Top K+1 triplets of one layer's Jacobians by the configured route."""
    f, x = call.last_token_map()
    B, d = x.shape
    clock = Clock(x.device)
    method = rs.method
    if method == "auto":
        method = "gram" if d <= rs.dense_max_d else "auto"
    if method in ("dense", "gram"):
        top, J = _exact(f, x, chunk, rs, method, clock)
        return LayerTop(top, [method] * B, clock, J)
    with clock.span("route"):
        top = block_krylov_svd(
            f,
            x,
            rs.k,
            block=rs.block,
            max_iters=rs.max_iters,
            tol=rs.tol,
            ill_gap=rs.ill_gap,
            chunk=chunk,
            generator=generator,
            warm_start=warm,
            clock=clock,
        )
    clock.seconds[FACTORISATION] = clock.seconds.pop("route") - clock.get(PRODUCTS)
    routes = ["krylov"] * B
    redo = ~top.converged & ~top.ill_defined
    if not bool(redo.any()):
        return LayerTop(top, routes, clock)
    # Not converged (within an exact route's cost, for auto) and well-defined: the
    # exact route, recorded as such, never unconverged triplets.
    exact, J = _exact(f, x, chunk, rs, "gram", clock)
    top = _merge(top, exact, redo)
    routes = ["gram" if bool(r) else route for r, route in zip(redo, routes, strict=True)]
    return LayerTop(top, routes, clock, J)


def top_factors(
    calls: list[BlockCall], chunks: list[int], rs: RouteSettings, ledger: MemoryLedger
) -> list[LayerTop]:
    """Pass one: every layer's top K+1 triplets (each on its block's device).

    A dense Jacobian computed on the way is kept for pass two while the kept
    ones fit in ``rs.keep_bytes``; otherwise pass two recomputes products by JVP.
    """
    tops: list[LayerTop] = []
    generator, warm, kept = None, None, 0
    for index, (call, chunk) in enumerate(zip(calls, chunks, strict=True)):
        device = call.hidden.device
        if generator is None or generator.device != device:
            generator = torch.Generator(device=device).manual_seed(rs.seed + index)
        layer = _layer_top(call, chunk, rs, generator, None if warm is None else warm.to(device))
        if layer.J is not None:
            size = layer.J.numel() * layer.J.element_size()
            if kept + size <= rs.keep_bytes:
                kept += size
                ledger.hold(f"J{index}", layer.J)
            else:
                ledger.hold("J_current", layer.J)
                layer.J = None
                ledger.release("J_current")
        ledger.hold(f"top{index}", layer.top.U, layer.top.V, layer.top.S)
        tops.append(layer)
        warm = layer.top.V
    return tops


def _gather(tops: list[LayerTop], name: str, k: int, device) -> torch.Tensor:
    """``[B, L, d, K]`` of every layer's U or V, on ``device``."""
    return torch.stack([getattr(t.top, name)[:, :, :k].to(device) for t in tops], dim=1)


def _pair_block(call, J, left, right, chunk: int, group: int, reduce) -> torch.Tensor:
    """``[B, L, ...]``: ``reduce(left, J^l right)`` for every block m (J kept, or by JVPs).

    ``reduce`` is the request's pair reduction (``[B, M, d, K]`` twice ->
    ``[B, M, ...]``), called once with all blocks when J is kept, else per group.
    """
    if J is not None:
        return reduce(left, J[:, None] @ right)
    f, x = call.last_token_map()
    B, L, d, k = right.shape
    out = []
    for start in range(0, L, group):
        part = right[:, start : start + group]
        g = part.shape[1]
        tangents = part.permute(0, 2, 1, 3).reshape(B, d, g * k)
        W = jvp_columns(f, x, tangents, chunk).reshape(B, d, g, k).permute(0, 2, 1, 3)
        out.append(reduce(left[:, start : start + g], W))
    return torch.cat(out, dim=1)


def reduce_products(
    calls: list[BlockCall],
    tops: list[LayerTop],
    chunks: list[int],
    k: int,
    swapped: bool,
    out_device: torch.device,
    ledger: MemoryLedger,
    reduce,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pass two: ``A [B, L, L, ...]`` (and B) on ``out_device``, one layer at a time.

    ``A[:, l] = reduce(U, J^l V)`` and, with ``swapped``, ``B[:, l] = reduce(V,
    J^l U)`` (``reduce``: the request's pair reduction). Per layer l only ``U,
    V [B, L, d, K]`` (copied to block l's device) and one group of ``J^l V_m``
    products ``[B, d, g K]`` exist at a time.
    """
    L = len(calls)
    rows_A, rows_B = [], []
    for index, (call, layer, chunk) in enumerate(zip(calls, tops, chunks, strict=True)):
        device = call.hidden.device
        U, V = _gather(tops, "U", k, device), _gather(tops, "V", k, device)
        group = max(1, min(L, chunk // max(k, 1)))
        ledger.hold("pass2", U, V, U.new_empty(U.shape[0], U.shape[2], group * k))
        with layer.clock.span(REDUCTION):
            rows_A.append(_pair_block(call, layer.J, U, V, chunk, group, reduce).to(out_device))
            if swapped:
                rows_B.append(_pair_block(call, layer.J, V, U, chunk, group, reduce).to(out_device))
        if layer.J is not None:
            layer.J = None
            ledger.release(f"J{index}")
    ledger.release("pass2")
    A = torch.stack(rows_A, dim=1)
    return A, torch.stack(rows_B, dim=1) if swapped else None
