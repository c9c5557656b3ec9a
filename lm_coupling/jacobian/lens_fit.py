"""The Jacobian lens's reference estimator: whole-sequence vector-Jacobian products, batched.

Gurnee et al. (2026) fit the Jacobian lens, and TransformerLens 4.3
(``JacobianLens.fit``) implements their reference estimator, as

    J_l = E_prompt[ (1 / |V|) sum_{t in V} sum_{t' in V, t' >= t} d x^L_{t'} / d x^l_t ],

``V = {s, ..., T - 2}`` the positions left after skipping the first
``s = skip_first_positions`` and the final one, the prompt truncated to
``max_seq_len`` tokens, ``x^L`` the last block's output before the final norm.
Target positions are summed, source positions and prompts averaged.

How this module computes one prompt's term (:func:`reference_lens_rows`): one
forward pass of the prompt replicated ``dim_batch`` times, stopped after the
last block (the head is never run), rooted at ``x^0`` (the parameters are
frozen for the pass and restored), then ``ceil(d / dim_batch)`` backward
passes, each with a block of ``dim_batch`` one-hot cotangents: copy i of the
batch carries output coordinate i at every position of V at once, so by
causality its gradient at source position t is row i of
``sum_{t' >= t} d x^L_{t'} / d x^l_t``, for every state l in the same pass.
That is the reference's own route (it is the same estimator, so the same
count of backward passes); this module differs from it in what it needs: no
hooked model wrapper (the model's own blocks, located by
``model.architecture``), the embedding output ``x^0`` fitted too (state 0;
TransformerLens starts at block 0's output), and the forward pass stopped
before the unembedding.

The last-position estimator (``J_l = E[d x^L_n / d x^l_n]`` at the target
position n only, from the engine's block Jacobians) is
``lm_coupling.metrics.jacobian_lens.jacobian_products``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lm_coupling.errors import LmCouplingError
from lm_coupling.jacobian.calls import _StopForward, compute_dtype
from lm_coupling.model.architecture import ModelParts, block_output_hidden
from lm_coupling.model.block_calls import map_hidden

__all__ = [
    "ESTIMATORS",
    "DEFAULT_DIM_BATCH",
    "DEFAULT_MAX_SEQ_LEN",
    "DEFAULT_SKIP_FIRST",
    "model_identity",
    "reference_lens_rows",
    "unembedding_fingerprint",
    "valid_positions",
]

REFERENCE, LAST_POSITION = "reference", "last_position"
ESTIMATORS = (REFERENCE, LAST_POSITION)
"""The Jacobian-lens estimators: the reference's (default) and the target position's alone."""

DEFAULT_SKIP_FIRST = 16
"""Leading positions left out of the average (TransformerLens 4.3 ``skip_first_positions``)."""

DEFAULT_MAX_SEQ_LEN = 128
"""Prompts are truncated to this many tokens (TransformerLens 4.3 ``max_seq_len``)."""

DEFAULT_DIM_BATCH = 8
"""Cotangent directions per backward pass (TransformerLens 4.3 ``dim_batch``)."""


def valid_positions(n_tokens: int, skip_first_positions: int) -> range:
    """The positions V the estimator averages over: ``s .. T-2`` (empty: the prompt is skipped)."""
    return range(skip_first_positions, n_tokens - 1)


@contextlib.contextmanager
def _frozen_parameters(model: nn.Module) -> Iterator[None]:
    """Parameters out of the graph for the fit (their ``requires_grad`` restored after)."""
    saved = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in saved:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def _states_with_graph(
    model: nn.Module,
    parts: ModelParts,
    ids: torch.Tensor,
    copies: int,
    dtype: torch.dtype,
    first_state: int = 0,
) -> list[torch.Tensor]:
    """``[x^s, ..., x^L]`` of ``copies`` replicas of one prompt, in one graph rooted at x^s.

    ``s = first_state``; x^s is block s+1's input. Block calls are counted in
    order (a looped model calls one module several times), so call i is block i+1.
    """
    blocks = parts.blocks
    states: list[torch.Tensor] = []
    calls = [0]

    def root(module, args, kwargs):
        call = calls[0]
        calls[0] += 1
        if call != first_state:
            return None

        def leaf(hidden: torch.Tensor) -> torch.Tensor:
            states.append(hidden.detach().to(dtype).requires_grad_(True))
            return states[-1].to(hidden.dtype)

        args, kwargs = map_hidden(args, kwargs, leaf)
        if not states:
            raise LmCouplingError(
                "the Jacobian lens fit expected the first decoder block to receive the hidden "
                "states as its first argument or as hidden_states=; it found neither"
            )
        return args, kwargs

    def out(module, args, kwargs, output):
        if calls[0] - 1 < first_state:
            return
        states.append(block_output_hidden(output))
        if len(states) == len(blocks) - first_state + 1:
            raise _StopForward  # the head is not needed

    unique = list(dict.fromkeys(blocks))
    handles = [b.register_forward_pre_hook(root, with_kwargs=True) for b in unique]
    handles += [b.register_forward_hook(out, with_kwargs=True) for b in unique]
    try:
        with torch.enable_grad():
            model(input_ids=ids[None].expand(copies, -1), use_cache=False)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if len(states) != len(blocks) - first_state + 1:
        raise LmCouplingError(
            f"the Jacobian lens fit expected {len(blocks)} block calls in the forward pass, "
            f"found {calls[0]}"
        )
    d = parts.d_model
    for offset, x in enumerate(states):
        if x.dim() != 3 or x.shape[-1] != d or x.shape[0] != copies:
            raise LmCouplingError(
                f"the Jacobian lens fit needs single-stream states [B, T, {d}]; state "
                f"{first_state + offset} has shape {tuple(x.shape)}"
            )
    return states


def reference_lens_rows(
    model: nn.Module,
    parts: ModelParts,
    input_ids: torch.Tensor,
    skip_first_positions: int = DEFAULT_SKIP_FIRST,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
    dim_batch: int = DEFAULT_DIM_BATCH,
    first_state: int = 0,
) -> torch.Tensor | None:
    """One prompt's term of the reference Jacobian-lens estimator, for every state l = 0..L.

    ``R_l = (1 / |V|) sum_{t in V} sum_{t' in V, t' >= t} d x^L_{t'} / d x^l_t`` (rows:
    output coordinates), V the positions ``s .. T-2`` of the prompt truncated to
    ``max_seq_len`` tokens; the lens is the mean of ``R_l`` over prompts.

    Reference: Gurnee et al. (2026); TransformerLens 4.3
    ``transformer_lens.tools.analysis.jacobian_lens.JacobianLens.fit`` (its
    ``J[l]`` is ``R_{l+1}`` here: its layer l is block l's output, state l + 1;
    state 0, the embedding output, is not fitted there, and ``R_L = I``).

    Args:
        model: a Hugging Face causal LM (parameters frozen for the call and
            restored; not otherwise modified).
        parts: ``locate_model_parts(model)``.
        input_ids: ``[T]`` token ids of one prompt (no padding).
        skip_first_positions: s, leading positions left out (>= 0).
        max_seq_len: tokens kept from the start of the prompt (>= 2).
        dim_batch: cotangent directions per backward pass (>= 1): the prompt
            runs as ``dim_batch`` copies, and there are ``ceil(d / dim_batch)``
            backward passes.
        first_state: the earliest state fitted (0 .. L); the graph is rooted
            there, so the backward passes run through blocks
            ``first_state + 1 .. L`` only (TransformerLens's ``source_layers``
            starting at block ``first_state - 1``'s output).

    Returns:
        ``[L+1, d, d]`` float32 (float64 for a float64 model), on the CPU, NaN
        in the states before ``first_state``; None when V is empty
        (``T <= s + 1``: the reference skips such a prompt).
    """
    for name, value, low in (
        ("skip_first_positions", skip_first_positions, 0),
        ("max_seq_len", max_seq_len, 2),
        ("dim_batch", dim_batch, 1),
        ("first_state", first_state, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, found {value!r}")
    ids = torch.as_tensor(input_ids).reshape(-1)[:max_seq_len].to(parts.input_device)
    positions = valid_positions(int(ids.shape[0]), skip_first_positions)
    if len(positions) == 0:
        return None
    dtype = compute_dtype(parts)
    d, n_layers = parts.d_model, parts.n_layers
    if first_state > n_layers:
        raise ValueError(f"first_state must be at most L = {n_layers}, found {first_state}")
    copies = min(dim_batch, d)
    rows = torch.full((n_layers + 1, d, d), math.nan, dtype=dtype)
    if first_state == n_layers:
        rows[n_layers] = torch.eye(d, dtype=dtype)
        return rows
    with _frozen_parameters(model):
        states = _states_with_graph(model, parts, ids, copies, dtype, first_state)
        target, sources = states[-1], states[:-1]
        rows[n_layers] = torch.eye(d, dtype=dtype)
        where = torch.as_tensor(list(positions), device=target.device)
        copy = torch.arange(copies, device=target.device)
        cotangent = torch.zeros_like(target)
        n_passes = math.ceil(d / copies)
        for step in range(n_passes):
            first = step * copies
            n = min(copies, d - first)
            cotangent.zero_()
            cotangent[copy[:n, None], where[None, :], first + copy[:n, None]] = 1
            grads = torch.autograd.grad(
                target, sources, grad_outputs=cotangent, retain_graph=step < n_passes - 1
            )
            for offset, grad in enumerate(grads):
                block = grad[:n, where.to(grad.device)].to(dtype).mean(dim=1)
                rows[first_state + offset, first : first + n] = block.cpu()
    return rows


def unembedding_fingerprint(parts: ModelParts) -> str:
    """A SHA-256 of the unembedding: its shape and every ``ceil(V / 4096)``-th row (float32).

    Recorded in a lens file so that a lens of another model (or another head)
    is refused; sampled rows keep it cheap on wide vocabularies.
    """
    weight = parts.unembed_weight.detach()
    stride = max(1, math.ceil(weight.shape[0] / 4096))
    digest = hashlib.sha256(str(tuple(weight.shape)).encode())
    digest.update(weight[::stride].to("cpu", torch.float32).contiguous().numpy().tobytes())
    if parts.unembed_bias is not None:
        digest.update(parts.unembed_bias.detach().to("cpu", torch.float32).numpy().tobytes())
    return digest.hexdigest()


def model_identity(model: nn.Module, parts: ModelParts) -> dict[str, Any]:
    """What a lens file records of the model it was fitted on.

    ``model_name`` and ``model_revision`` are what TransformerLens records and
    checks: ``config.name_or_path``, and None for the revision (transformers 5
    keeps no commit on a loaded config, so TransformerLens 4.3 records None too).
    """
    from lm_coupling.model.transformers_adapter import loaded_from

    return {
        "model_name": loaded_from(model) or None,
        "model_revision": None,
        "model_type": parts.model_type,
        "n_layers": parts.n_layers,
        "d_model": parts.d_model,
        "unembedding_sha256": unembedding_fingerprint(parts),
    }
