"""The block-Jacobian engine: top-K factors of every block Jacobian at the target position.

``J^l = d(block_l(X)_n - x^{l-1}_n) / d x^{l-1}_n`` (residual branch only), every
other position held fixed, n the last position, in float32 (float64 for a
float64 model) whatever the model's dtype. Routes:

- ``dense``: J^l exactly, from d Jacobian-vector products through block l on
  the single token n with the prefix's keys and values frozen (causal
  attention: positions < n do not depend on x_n), then a full SVD. ``JV`` and
  ``UtJ`` are matrix products.
- ``randomized``: never forms J^l. Top-K triplets by randomized SVD (Halko et
  al. 2011) with JVP/VJP products, power iterations, oversampling and a warm
  start from the previous layer's V; ``JV[l, m] = J^l V_m`` for all m is one
  batched JVP of L*K tangents per block.
- ``auto``: ``dense`` when ``d <= DENSE_MAX_D`` (1024; d JVPs of one token are
  cheap there and exact); otherwise ``randomized`` per layer, falling back to
  ``dense`` for a layer whose estimated gap ``s_K / s_{K+1}`` is below
  ``MIN_GAP`` (1.05), where the randomized triplets are unreliable.

The route of each layer is recorded in ``JacobianFactors.method``. Attention
runs eagerly inside the engine only (SDPA kernels refuse forward-mode AD); the
model is restored on exit and its parameters are never modified.

Reference: Aubry et al., "Transformer Block Coupling and its Correlation with
Generalization in LLMs", ICLR 2025 (block Jacobians at the last token); DESIGN
section 5. Departure from the authors' code: the last block's Jacobian does not
include the final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from lm_coupling.capture.architecture import ModelParts
from lm_coupling.capture.jacobian_calls import (
    BlockCall,
    compute_dtype,
    engine_mode,
    record_full_sequence,
    record_last_token,
)
from lm_coupling.capture.jacobian_linalg import (
    chunk_size_for,
    dense_jacobian,
    jvp_columns,
    randomized_svd,
    vjp_rows,
)
from lm_coupling.states import JacobianFactors

__all__ = ["DENSE_MAX_D", "MIN_GAP", "JacobianEngine", "naive_block_jacobians"]

DENSE_MAX_D = 1024
"""``method="auto"`` uses the dense route for every layer when d is at most this."""

MIN_GAP = 1.05
"""``method="auto"`` recomputes a layer densely when its estimated ``s_K / s_{K+1}`` is below."""

_METHODS = ("auto", "dense", "randomized")


def _check_ids(input_ids) -> torch.Tensor:
    """Validate ``[T]`` (or ``[1, T]``) integer token ids, T >= 1; return ``[T]``."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor [T], found {type(input_ids).__name__}")
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.shape[0] < 1 or input_ids.is_floating_point():
        raise ValueError(
            "input_ids must be one prompt of integer token ids with shape [T], T >= 1 (no "
            f"padding); found dtype {input_ids.dtype} and shape {tuple(input_ids.shape)}"
        )
    return input_ids


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, found {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, found {value}")
    return value


class JacobianEngine:
    """Block Jacobians at the target position n of one prompt, block by block.

    Args:
        model: a Hugging Face causal LM (not modified; eager attention and eval
            mode are set temporarily and restored).
        parts: ``locate_model_parts(model)``.
        k_max: K, the number of singular triplets kept (``S`` has K + 1 values
            for the gap ``s_K / s_{K+1}``); 1 <= K < d.
        method: ``"auto"``, ``"dense"`` or ``"randomized"`` (module docstring).
        power_iters: power iterations of the randomized SVD.
        oversample: extra sketch columns of the randomized SVD.
        swapped: also compute ``UtJ[l, m] = U_m^T J^l``.
        keep_dense: keep the dense Jacobians in ``JacobianFactors.dense``;
            forces the dense route for every layer.
        seed: seed of the randomized sketches (results are reproducible).
        chunk_size: tangents per vectorized JVP/VJP batch (None: from a
            memory budget, see ``chunk_size_for``).
        dense_max_d: ``auto`` uses the dense route for every layer when
            d <= this (default ``DENSE_MAX_D``).
        min_gap: ``auto`` recomputes a layer densely when its randomized
            estimate of ``s_K / s_{K+1}`` is below this (default ``MIN_GAP``).
    """

    def __init__(
        self,
        model: nn.Module,
        parts: ModelParts,
        *,
        k_max: int,
        method: str = "auto",
        power_iters: int = 2,
        oversample: int = 10,
        swapped: bool = False,
        keep_dense: bool = False,
        seed: int = 0,
        chunk_size: int | None = None,
        dense_max_d: int = DENSE_MAX_D,
        min_gap: float = MIN_GAP,
    ):
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, found {method!r}")
        self.model = model
        self.parts = parts
        self.d = parts.d_model
        self.k_max = _check_int("k_max", k_max, 1, self.d - 1)
        self.method = method
        self.power_iters = _check_int("power_iters", power_iters, 0)
        self.oversample = _check_int("oversample", oversample, 0)
        self.swapped = bool(swapped)
        self.keep_dense = bool(keep_dense)
        self.seed = int(seed)
        self.chunk_size = None if chunk_size is None else _check_int("chunk_size", chunk_size, 1)
        self.dense_max_d = _check_int("dense_max_d", dense_max_d, 0)
        self.min_gap = float(min_gap)
        self.dtype = compute_dtype(parts)

    def _chunk(self, x: torch.Tensor, context: int) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return chunk_size_for(self.d, context, x.device, x.dtype)

    def _all_dense(self) -> bool:
        return (
            self.keep_dense
            or self.method == "dense"
            or (self.method == "auto" and self.d <= self.dense_max_d)
        )

    def _record_last(self, input_ids: torch.Tensor) -> list[BlockCall]:
        """The last-token block calls of checked ids ``[T]`` (see :func:`_check_ids`)."""
        ids = input_ids.to(self.parts.input_device)
        return record_last_token(self.model, self.parts, ids, self.dtype)

    def dense_jacobians(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The exact block Jacobians at n = T - 1 by the single-token route.

        Args:
            input_ids: ``[T]`` token ids of one prompt.

        Returns:
            ``[L, d, d]`` J^l (rows: output coordinates), float32 (float64 for
            a float64 model), on the last block's device.
        """
        ids = _check_ids(input_ids)
        with engine_mode(self.model):
            calls = self._record_last(ids)
            context = ids.shape[0]
            jacobians = []
            for call in calls:
                f, x = call.last_token_map()
                jacobians.append(dense_jacobian(f, x, self._chunk(x, context)))
            return torch.stack(jacobians)

    def factors(self, input_ids: torch.Tensor) -> JacobianFactors:
        """Top-K factors of every block Jacobian at n = T - 1, and ``J^l V_m`` for all pairs.

        Args:
            input_ids: ``[T]`` token ids of one prompt (T >= 1; no padding).

        Returns:
            ``JacobianFactors`` with ``U, V [L, d, K]``, ``S [L, K+1]``,
            ``JV [L, L, d, K]``, ``UtJ [L, L, K, d]`` (if ``swapped``),
            ``method`` per layer, ``spectral_gap [L]`` = ``s_K / s_{K+1}`` and
            ``dense [L, d, d]`` (if ``keep_dense``); float32 (float64 for a
            float64 model). ``spectral_gap`` is inf where ``s_{K+1} = 0``.
        """
        ids = _check_ids(input_ids)
        k = self.k_max
        with engine_mode(self.model):
            calls = self._record_last(ids)
            context = ids.shape[0]
            triplets, dense, methods = self._triplets(calls, context)
            U = torch.stack([t[0][:, :k] for t in triplets])
            S = torch.stack([t[1][: k + 1] for t in triplets])
            V = torch.stack([t[2][:, :k] for t in triplets])
            JV = torch.stack(
                [self._jv(call, J, V, context) for call, J in zip(calls, dense, strict=True)]
            )
            UtJ = None
            if self.swapped:
                UtJ = torch.stack(
                    [self._utj(call, J, U, context) for call, J in zip(calls, dense, strict=True)]
                )
        gap = S[:, k - 1] / S[:, k]
        keep = torch.stack(dense) if self.keep_dense else None
        return JacobianFactors(U, S, V, JV, UtJ, methods, gap, keep)

    def _triplets(self, calls: list[BlockCall], context: int):
        """Per layer: (U, S, V) with K+1 triplets, the dense J (or None), and the route."""
        k, all_dense = self.k_max, self._all_dense()
        generator, previous_v = None, None
        triplets, dense, methods = [], [], []
        for call in calls:
            f, x = call.last_token_map()
            chunk = self._chunk(x, context)
            route, J = "dense", None
            if not all_dense:
                if generator is None:
                    generator = torch.Generator(device=x.device).manual_seed(self.seed)
                found = randomized_svd(
                    f,
                    x,
                    k + 1,
                    oversample=self.oversample,
                    power_iters=self.power_iters,
                    chunk=chunk,
                    generator=generator,
                    warm_start=previous_v,
                )
                route = "randomized"
                if self.method == "auto" and not bool(
                    found[1][k - 1] >= self.min_gap * found[1][k]
                ):
                    route = "dense"
            if route == "dense":
                J = dense_jacobian(f, x, chunk)
                U_full, S_full, Vh = torch.linalg.svd(J)
                found = (U_full[:, : k + 1], S_full[: k + 1], Vh[: k + 1].T)
            triplets.append(found)
            dense.append(J)
            methods.append(route)
            previous_v = found[2]
        return triplets, dense, methods

    def _jv(
        self, call: BlockCall, J: torch.Tensor | None, V: torch.Tensor, context: int
    ) -> torch.Tensor:
        """``[L, d, K]`` with ``[m] = J^l V_m``: a matrix product, or one batched JVP."""
        L, d, k = V.shape
        tangents = V.permute(1, 0, 2).reshape(d, L * k)
        if J is not None:
            out = J @ tangents.to(J.device)
        else:
            f, x = call.last_token_map()
            out = jvp_columns(f, x, tangents.to(x.device), self._chunk(x, context))
        return out.reshape(d, L, k).permute(1, 0, 2)

    def _utj(
        self, call: BlockCall, J: torch.Tensor | None, U: torch.Tensor, context: int
    ) -> torch.Tensor:
        """``[L, K, d]`` with ``[m] = U_m^T J^l``: a matrix product, or one batched VJP."""
        L, d, k = U.shape
        cotangents = U.permute(1, 0, 2).reshape(d, L * k)
        if J is not None:
            out = cotangents.to(J.device).T @ J
        else:
            f, x = call.last_token_map()
            out = vjp_rows(f, x, cotangents.to(x.device), self._chunk(x, context))
        return out.reshape(L, k, d)

    def position_jacobian(
        self, input_ids: torch.Tensor, layer: int, t_in: int, t_out: int
    ) -> torch.Tensor:
        """The Jacobian between positions, ``J^l_{t_in t_out} = d block_l(X)_{t_out} / d x_{t_in}``.

        Minus the identity when ``t_in == t_out`` (residual branch only), so
        that ``position_jacobian(ids, l, n, n)`` equals J^l at n. Needs the whole
        sequence: block l's inputs are recorded from a forward pass without cache.

        Args:
            input_ids: ``[T]`` token ids of one prompt.
            layer: block index l in [0, L).
            t_in: input position, ``0 <= t_in <= t_out`` (the map is 0 for
                t_in > t_out by causality).
            t_out: output position, ``t_out < T``.

        Returns:
            ``[d, d]`` (rows: output coordinates), float32 (float64 for a
            float64 model).
        """
        ids = _check_ids(input_ids)
        n_layers, T = self.parts.n_layers, ids.shape[0]
        _check_int("layer", layer, 0, n_layers - 1)
        _check_int("t_out", t_out, 0, T - 1)
        _check_int("t_in", t_in, 0, T - 1)
        if t_in > t_out:
            raise ValueError(
                f"t_in must be <= t_out (causal attention makes later inputs irrelevant), "
                f"found t_in={t_in}, t_out={t_out}; the Jacobian is zero there"
            )
        with engine_mode(self.model):
            device = self.parts.input_device
            call = record_full_sequence(self.model, self.parts, ids.to(device), self.dtype)[layer]
            f, x = call.position_map(t_in, t_out)
            return dense_jacobian(f, x, self._chunk(x, T * T))


def naive_block_jacobians(
    model: nn.Module, parts: ModelParts, input_ids: torch.Tensor
) -> torch.Tensor:
    """Block Jacobians at n = T - 1 the way the papers' released code builds them.

    For each block: run it on the whole recorded sequence with autograd, then
    take d separate backward passes, one per output coordinate of
    ``block_l(X)_n - x^{l-1}_n``, each giving one row of J^l. Plain and slow
    on purpose: the reference route of the benchmark and the tests (eager
    attention, float32 or float64 like the engine).

    Reference: Aubry et al., ICLR 2025, released code (d backward passes per block).

    Args:
        model: the causal LM.
        parts: ``locate_model_parts(model)``.
        input_ids: ``[T]`` token ids of one prompt.

    Returns:
        ``[L, d, d]`` J^l (rows: output coordinates).
    """
    ids = _check_ids(input_ids)
    dtype = compute_dtype(parts)
    with engine_mode(model):
        calls = record_full_sequence(model, parts, ids.to(parts.input_device), dtype)
        return torch.stack([_naive_rows(call) for call in calls])


def _naive_rows(call: BlockCall) -> torch.Tensor:
    """J^l row by row: one backward pass through the whole sequence per output coordinate."""
    params = call.params()
    with torch.enable_grad():
        X = call.hidden.detach().clone().requires_grad_(True)
        out = call.run(X, params)[0, -1] - X[0, -1]
        rows = [
            torch.autograd.grad(out[i], X, retain_graph=True)[0][0, -1] for i in range(out.shape[0])
        ]
    return torch.stack(rows)
