"""The block-Jacobian engine: top-K factors of every block Jacobian at the target position n.

``J^l = d(block_l(X)_n - x^{l-1}_n) / d x^{l-1}_n`` (residual branch only), every
other position held fixed, n the last position, in float32 (float64 for a
float64 model) whatever the model's dtype. Products run through block l on
the single token n with the prefix's keys and values frozen (causal
attention: positions < n do not depend on x_n), or on the whole prompt with
rows < n fixed (``jacobian.sequence``). The routes (``dense``, ``gram``,
``krylov``, ``auto``; ``JacobianFactors.method`` per layer) are
``jacobian.routes``'s; the settings one
:class:`~lm_coupling.jacobian.config.JacobianConfig`; a layer whose top K+1
singular values are closer than ``ill_gap * s_1`` is flagged ill-defined.
The per-layer-pair products go to the requesting plugin's pair reduction and
are never held. Before any Jacobian work every block's replayed call is
checked against the block's output at n in a plain forward pass of the
model; a document whose call does not reproduce it raises
:class:`JacobianMismatchError`.

Reference: Aubry et al., "Transformer Block Coupling and its Correlation with
Generalization in LLMs", ICLR 2025 (block Jacobians at the last token);
docs/engine.md. Departure from the authors' code: the last block's Jacobian does not
include the final norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lm_coupling.errors import ConfigurationError, LmCouplingError
from lm_coupling.jacobian.calls import (
    BlockCall,
    compute_dtype,
    engine_mode,
    record_last_token,
    replay_errors,
    run_prompts,
)
from lm_coupling.jacobian.config import JacobianConfig
from lm_coupling.jacobian.linalg import PRODUCTS, Clock, chunk_size_for, dense_jacobian
from lm_coupling.jacobian.routes import (
    FACTORISATION,
    REDUCTION,
    MemoryLedger,
    RouteSettings,
    reduce_products,
    top_factors,
)
from lm_coupling.jacobian.sequence import (
    SEQUENCE,
    choose_replay,
    record_sequences,
)
from lm_coupling.model.architecture import ModelParts
from lm_coupling.states import JacobianFactors

__all__ = [
    "JacobianEngine",
    "JacobianMismatchError",
    "naive_block_jacobians",
]

FORWARD = "forward"
"""Key of ``JacobianFactors.seconds``: the prompt's forward pass, recording and check."""

CHECK_RTOL = {torch.float64: 1e-5, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}
"""Relative tolerance of the run-time check, by the model's parameter dtype."""


class JacobianMismatchError(LmCouplingError):
    """The engine's replayed block call does not reproduce the model's own block output.

    Then the engine would differentiate a different function from the one
    the benchmark ran; the document's Jacobian metrics must be NaN.
    """


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


def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, found {type(value).__name__} {value!r}")
    if value < low or value > high:
        raise ValueError(f"{name} must be in [{low}, {high}], found {value}")
    return value


class JacobianEngine:
    """Block Jacobians at the target position n of one or several prompts, block by block.

    Args:
        model: a Hugging Face causal LM (not modified; eval mode and, for
            attention implementations without forward-mode AD, SDPA are set
            temporarily and restored).
        parts: ``locate_model_parts(model)``.
        config: the settings (``jacobian.config.JacobianConfig``).
        **settings: fields of ``JacobianConfig`` instead of (or replacing
            those of) ``config``, e.g. ``JacobianEngine(model, parts, k_max=10)``.

    Raises:
        ConfigurationError: a setting is out of range (K >= d included).
    """

    def __init__(
        self,
        model: nn.Module,
        parts: ModelParts,
        config: JacobianConfig | None = None,
        **settings,
    ):
        if config is None:
            config = JacobianConfig(**settings)
        elif settings:
            config = config.replace(**settings)
        if config.k_max >= parts.d_model:
            raise ConfigurationError(
                f"k_max must be in [1, {parts.d_model - 1}] (below the model width d = "
                f"{parts.d_model}), found {config.k_max}; ask for fewer singular vectors"
            )
        self.model = model
        self.parts = parts
        self.config = config
        self.d = parts.d_model
        self.k_max = config.k_max
        self.dtype = compute_dtype(parts)
        self.replay: str | None = None
        """``"cache"`` or ``"sequence"`` (``jacobian.sequence``); None: chosen per model."""

    def _chunk(self, x: torch.Tensor, context: int) -> int:
        if self.config.chunk_size is not None:
            return self.config.chunk_size
        return chunk_size_for(self.d, context, x.device, x.dtype)

    def _settings(self) -> RouteSettings:
        c = self.config
        if c.max_iters is not None:
            iters = c.max_iters
        elif c.route == "auto":
            iters = max(3, self.d // (2 * c.block))
        else:
            iters = 100
        tol = c.tol if c.tol is not None else (1e-9 if self.dtype == torch.float64 else 1e-5)
        return RouteSettings(
            method=c.route,
            k=c.k_max,
            dense_max_d=c.dense_max_d,
            block=c.block,
            max_iters=iters,
            tol=tol,
            ill_gap=c.ill_gap,
            keep_bytes=math.inf if c.keep_dense else self._keep_budget(),
            seed=c.seed,
        )

    def _keep_budget(self) -> int:
        """Bytes of dense Jacobians pass one may keep for pass two."""
        if self.config.keep_bytes is not None:
            return self.config.keep_bytes
        device = self.parts.input_device
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0] // 4
        return 1 << 30

    def _batch_docs(self, lengths: list[int]) -> int:
        """Documents per batched pass: on a GPU what fits in a quarter of free memory, <= 64.

        On a CPU one: batches of 4 were 14% slower than one document at a time
        at SmolLM2-135M shape (docs/engine.md).
        """
        if self.config.docs_per_batch is not None:
            return self.config.docs_per_batch
        device = self.parts.input_device
        if device.type != "cuda":
            return 1
        L, d, k = self.parts.n_layers, self.d, self.k_max
        item = torch.finfo(self.dtype).bits // 8
        per_doc = item * (4 * d * d + 4 * L * d * (k + 1) + 2 * L * L * k * k)
        per_doc += item * 16 * max(lengths) * d * L  # frozen keys/values and their casts
        free = torch.cuda.mem_get_info(device)[0] // 4
        return int(max(1, min(64, free // per_doc)))

    def _replay(self) -> str:
        """``self.replay``, else the model's ``choose_replay`` (call outside ``engine_mode``)."""
        if self.replay is None:
            self.replay = choose_replay(self.model)[0]
        return self.replay

    def _run(self, prompts: list[torch.Tensor]):
        """The plain forward pass per prompt the replay needs (outside ``engine_mode``)."""
        return run_prompts(self.model, self.parts, prompts, prefixes=self._replay() != SEQUENCE)

    def _record_last(self, prompts: list[torch.Tensor], prefixes: list) -> list[BlockCall]:
        device = self.parts.input_device
        if self._replay() == SEQUENCE:
            return record_sequences(
                self.model, self.parts, [p.to(device) for p in prompts], self.dtype
            )
        return record_last_token(
            self.model, self.parts, [p.to(device) for p in prompts], self.dtype, prefixes
        )

    def dense_jacobians(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The exact block Jacobians at n = T - 1 by the single-token route.

        Args:
            input_ids: ``[T]`` token ids of one prompt.

        Returns:
            ``[L, d, d]`` J^l (rows: output coordinates), float32 (float64 for
            a float64 model), on the last block's device.
        """
        ids = _check_ids(input_ids).to(self.parts.input_device)
        run = self._run([ids])
        with engine_mode(self.model, self.config.attn_implementation):
            calls = self._record_last([ids], run.prefixes)
            device = calls[-1].hidden.device
            jacobians = []
            for call in calls:
                f, x = call.last_token_map()
                context = 0 if call.split_prefix else ids.shape[0]
                J = dense_jacobian(f, x, self._chunk(x, context))[0]
                jacobians.append(J.to(device))
            return torch.stack(jacobians)

    def factors(self, input_ids: torch.Tensor) -> JacobianFactors:
        """Top-K factors of every block Jacobian at n = T - 1 and the coupling products.

        Args:
            input_ids: ``[T]`` token ids of one prompt (T >= 1; no padding).

        Returns:
            ``JacobianFactors``: ``U, V [L, d, K]``, ``S [L, K+1]``,
            ``A [L, L, K, K]``, ``B`` (if ``swapped``), route, iterations,
            residual and ill-definedness per layer, ``spectral_gap [L]`` =
            ``s_K / s_{K+1}`` (inf where ``s_{K+1} = 0``) and ``dense
            [L, d, d]`` (if ``keep_dense``); float32 (float64 for a float64
            model), on the model's input device.

        Raises:
            JacobianMismatchError: the replayed block calls do not reproduce
                the model's own block outputs (see ``check``).
        """
        (result,) = self.factors_batch([input_ids], errors="raise")
        return result

    def factors_batch(
        self, prompts: list[torch.Tensor], errors: str = "raise"
    ) -> list[JacobianFactors | JacobianMismatchError]:
        """``factors`` of several prompts, batched (each keeps its own frozen prefix).

        Prompts run in left-padded groups of ``docs_per_batch`` (default: from
        free memory); every per-document value equals ``factors`` of that
        prompt alone up to round-off.

        Args:
            prompts: ``[T_b]`` token ids of each prompt.
            errors: ``"raise"`` raises the first :class:`JacobianMismatchError`;
                ``"return"`` puts it in the failing document's place.

        Returns:
            One ``JacobianFactors`` (or error) per prompt, in order.
        """
        if errors not in ("raise", "return"):
            raise ValueError(f"errors must be 'raise' or 'return', found {errors!r}")
        ids = [_check_ids(p) for p in prompts]
        out: list = [None] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: ids[i].shape[0])
        size = self._batch_docs([p.shape[0] for p in ids]) if ids else 1
        for start in range(0, len(order), size):
            group = order[start : start + size]
            for index, result in zip(group, self._group([ids[i] for i in group]), strict=True):
                if errors == "raise" and isinstance(result, Exception):
                    raise result
                out[index] = result
        return out

    def _group(self, prompts: list[torch.Tensor]) -> list:
        """One batched pass over prompts of similar lengths; mismatching ones are errors."""
        device = self.parts.input_device
        prompts = [p.to(device) for p in prompts]
        clock = Clock(device)
        with clock.span(FORWARD):
            run = self._run(prompts)
        results: list = [None] * len(prompts)
        with engine_mode(self.model, self.config.attn_implementation):
            with clock.span(FORWARD):
                calls = self._record_last(prompts, run.prefixes)
                failures = self._mismatches(calls, run.outputs) if self.config.check else {}
                good = [i for i in range(len(prompts)) if i not in failures]
                if failures and good:  # record again without the failing documents
                    calls = self._record_last(
                        [prompts[i] for i in good], [run.prefixes[i] for i in good]
                    )
            if good:
                context = sum(prompts[i].shape[0] for i in good)
                for i, factors in zip(good, self._compute(calls, context, clock), strict=True):
                    results[i] = factors
        for i, error in failures.items():
            results[i] = error
        return results

    def _mismatches(
        self, calls: list[BlockCall], expected: list[torch.Tensor]
    ) -> dict[int, JacobianMismatchError]:
        """Documents whose replayed block call at n differs from the model's own output."""
        param = next(self.parts.blocks[0].parameters())
        rtol = CHECK_RTOL.get(param.dtype, 1e-4)
        worst, layer_of = replay_errors(calls, expected)
        return {
            b: JacobianMismatchError(
                f"the Jacobian engine's replay of block {int(layer_of[b])} differs from the "
                f"model's own forward pass at the target position by {float(worst[b]):.3g} "
                f"(relative; tolerance {rtol:g} for {param.dtype}): the attention "
                f"implementation used for differentiation "
                f"({self.config.attn_implementation or 'eager/SDPA math'}) computes a different "
                "function from the one the benchmark ran, so this document's Jacobian "
                "metrics are NaN"
            )
            for b in range(len(worst))
            if not bool(worst[b] <= rtol)
        }

    def _compute(self, calls: list[BlockCall], context: int, clock: Clock) -> list[JacobianFactors]:
        """Both passes on recorded calls (inside ``engine_mode``); one result per prompt.

        ``clock`` holds the batch's ``FORWARD`` seconds so far.
        """
        k = self.k_max
        ledger = MemoryLedger([c.hidden.device for c in calls])
        chunks = [self._chunk(c.hidden[:, -1], 0 if c.split_prefix else context) for c in calls]
        tops = top_factors(calls, chunks, self._settings(), ledger)
        out = self.parts.input_device
        dense = torch.stack([t.J.to(out) for t in tops], 1) if self.config.keep_dense else None
        reduce = self.config.pair_reduction
        if reduce is not None:
            A, B = reduce_products(calls, tops, chunks, k, self.config.swapped, out, ledger, reduce)
        else:  # no pair reduction requested: pass two has nothing to do
            A = B = None
            for index, t in enumerate(tops):
                t.J = None
                ledger.release(f"J{index}")
        peak = ledger.peak
        U = torch.stack([t.top.U[:, :, :k].to(out) for t in tops], 1)
        V = torch.stack([t.top.V[:, :, :k].to(out) for t in tops], 1)
        S = torch.stack([t.top.S.to(out) for t in tops], 1)
        iterations = torch.stack([t.top.iterations.cpu() for t in tops], 1)
        residual = torch.stack([t.top.residual.to(out) for t in tops], 1)
        ill = torch.stack([t.top.ill_defined.to(out) for t in tops], 1)
        gap = S[..., k - 1] / S[..., k]
        n_docs = S.shape[0]
        seconds = {FORWARD: clock.get(FORWARD) / n_docs}
        for key in (PRODUCTS, FACTORISATION, REDUCTION):
            seconds[key] = [t.clock.get(key) / n_docs for t in tops]
        return [
            JacobianFactors(
                U=U[b],
                S=S[b],
                V=V[b],
                A=None if A is None else A[b],
                B=None if B is None else B[b],
                method=[t.routes[b] for t in tops],
                spectral_gap=gap[b],
                iterations=[int(i) for i in iterations[b]],
                residual=residual[b],
                ill_defined=ill[b],
                peak_bytes=peak,
                dense=None if dense is None else dense[b],
                replay=self._replay(),
                seconds={key: list(v) if isinstance(v, list) else v for key, v in seconds.items()},
            )
            for b in range(n_docs)
        ]

    def position_jacobian(
        self, input_ids: torch.Tensor, layer: int, t_in: int, t_out: int
    ) -> torch.Tensor:
        """The Jacobian between positions, ``J^l_{t_in t_out} = d block_l(X)_{t_out} / d x_{t_in}``.

        Minus the identity when ``t_in == t_out`` (residual branch only), so
        that ``position_jacobian(ids, l, n, n)`` equals J^l at n. By causality
        each product runs block l on rows ``t_in..t_out`` alone, the keys and
        values of positions < t_in frozen as for the last token in ``factors``
        (the cache replay; the sequence replay runs the whole prompt).

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
        ids = ids[: t_out + 1].to(self.parts.input_device)
        if self._replay() == SEQUENCE:  # the whole sequence, rows other than t_in fixed
            with engine_mode(self.model, self.config.attn_implementation):
                call = record_sequences(self.model, self.parts, [ids], self.dtype)[layer].docs[0]
                f, x = call.position_map(t_in, t_out)
                return dense_jacobian(f, x, self._chunk(x, T))[0]
        prompt = ids[: t_in + 1]
        prefixes = run_prompts(self.model, self.parts, [prompt]).prefixes
        with engine_mode(self.model, self.config.attn_implementation):
            calls = record_last_token(
                self.model, self.parts, [prompt], self.dtype, prefixes, ids[t_in:]
            )
            call = calls[layer]
            params = call.params()
            X = call.hidden  # [1, t_out - t_in + 1, d]: rows t_in..t_out

            def f(x: torch.Tensor) -> torch.Tensor:
                out = call.run(torch.cat([x[:, None], X[:, 1:]], dim=1), params)[:, -1]
                return out - x if t_in == t_out else out

            x = X[:, 0]
            return dense_jacobian(f, x, self._chunk(x, X.shape[1] + t_in))[0]


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
        calls = record_sequences(model, parts, [ids.to(parts.input_device)], dtype)
        return torch.stack([_naive_rows(call.docs[0]) for call in calls])


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
