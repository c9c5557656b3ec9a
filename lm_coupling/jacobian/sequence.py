"""The sequence replay: block Jacobians with the prefix held fixed, for any architecture.

``J^l = d(block_l(X)_n - x^{l-1}_n) / d x^{l-1}_n`` with every other row of
``X = x^{l-1}`` held fixed (docs/design.md): each block's inputs are recorded
on the whole prompt (``use_cache=False``), and block l is called on the whole
sequence with rows ``0..n-1`` fixed and only row n variable. Exact for every
mixer that reads the prefix (attention, scans, convolutions, linear
attention, RG-LRU) and models that return no cache, but a product costs the
block on T rows instead of one: the engine uses it only where the cache
replay (``jacobian.calls``) cannot serve (:func:`choose_replay`, docs/engine.md,
"Replays"). Each document is its own call on its own prompt (no padding).

Reference: Aubry et al., "Transformer Block Coupling and its Correlation with
Generalization in LLMs", ICLR 2025 (block Jacobians at the last token);
docs/engine.md, "Replays".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lm_coupling.errors import LmCouplingError
from lm_coupling.jacobian.calls import (
    BlockCall,
    _block_call,
    _record,
)
from lm_coupling.model.architecture import ModelParts
from lm_coupling.model.block_calls import accepts_argument, eval_mode
from lm_coupling.model.transformers_adapter import layer_keeps_state

__all__ = [
    "CACHE",
    "SEQUENCE",
    "SequenceCall",
    "cache_replay_problem",
    "choose_replay",
    "record_sequences",
]

CACHE = "cache"
"""Replay of block l on token n against the frozen prefix keys/values (fast)."""

SEQUENCE = "sequence"
"""Replay of block l on the whole prompt with rows < n fixed (any architecture)."""

INDEXER_ATTRIBUTES = ("indexer_keys", "update_indexer", "indexer_cache")
"""Attributes of a cache layer that keeps a sparse-attention indexer (DeepSeek-V3.2, GLM-DSA)."""

PROBE_TOKENS = 8
"""Length of the probe prompt of :func:`cache_replay_problem`."""

_CHOSEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> (replay, why): the probe runs once per model."""


def _layer_kind(layer) -> str:
    """``"state"``, ``"indexer"`` or ``""`` for a cache layer of keys and values only."""
    if layer_keeps_state(layer):
        return "state"
    if any(hasattr(layer, a) for a in INDEXER_ATTRIBUTES):
        return "indexer"
    return ""


def cache_replay_problem(model: nn.Module) -> str:
    """Why the cache replay cannot serve this model ("" when it can).

    One forward pass of two tokens with ``use_cache=True`` (the model's own
    cache, built with its config): the cache replay needs a transformers
    ``Cache`` whose every layer holds keys and values only. A layer with a
    recurrent, convolution or scan state (Mamba, hybrids, linear attention),
    an indexer (sparse attention), or no cache at all rules it out; so does
    a cache replay of a probe prompt that differs from the model's own
    forward pass (:func:`_cache_replay_mismatch`), as do blocks that run more
    than once per forward pass (``model.block_calls``: every call is
    replayed on its own recorded whole-sequence input).
    """
    from lm_coupling.model.architecture import locate_model_parts
    from lm_coupling.model.block_calls import is_unrolled
    from lm_coupling.model.transformers_adapter import (
        cache_keeps_state,
        cache_layers,
        layer_keys_values,
        model_cache_layers,
        output_cache,
    )

    if is_unrolled(locate_model_parts(model).blocks):
        return (
            "its blocks run more than once per forward pass (looped depth): each call is "
            "replayed on the inputs recorded for that call"
        )
    if not accepts_argument(model, "use_cache"):
        return f"{type(model).__name__}.forward takes no use_cache argument (no cache)"
    try:
        layers = model_cache_layers(model)
    except Exception as error:  # noqa: BLE001 - any failure means: no cache of the model's own
        return f"no cache can be built from its config ({type(error).__name__}: {error})"
    kinds = {i: _layer_kind(layer) for i, layer in enumerate(layers)}
    state = [i for i, kind in kinds.items() if kind == "state"]
    if state:
        return f"its cache layers {state} keep a recurrent, scan or convolution state"
    indexer = [i for i, kind in kinds.items() if kind == "indexer"]
    if indexer:
        return f"its cache layers {indexer} keep a sparse-attention indexer"
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    ids = torch.ones(1, 2, dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    found = output_cache(out)
    if cache_keeps_state(found):  # transformers 4.56's MambaCache: states, no layers
        return (
            f"with use_cache=True it returns {type(found).__name__}, whose layers keep a "
            "recurrent, scan or convolution state"
        )
    layers = cache_layers(found)
    if not layers:
        return f"with use_cache=True it returns {type(found).__name__}, not a cache with layers"
    kinds = [_layer_kind(layer) for layer in layers]
    if any(kinds) or not all(layer_keys_values(layer) is not None for layer in layers):
        return f"its {type(found).__name__} holds more than keys and values"
    try:
        return _cache_replay_mismatch(model)
    except LmCouplingError as error:  # the cache replay cannot even run on the probe
        return f"the cache replay fails on a probe prompt ({error})"
    except (RuntimeError, AttributeError, TypeError, ValueError) as error:
        # e.g. a cache whose rows are not one per position, or cache layers of the
        # model's own kind that the engine's plain key/value cache lacks (DeepSeek-V4's
        # compressor layers: AttributeError)
        if _is_resource_failure(error):  # the machine, not the model: no route from it
            raise
        return f"the cache replay fails on a probe prompt ({type(error).__name__}: {error})"


RESOURCE_FAILURES = ("out of memory", "can't allocate memory", "resource temporarily unavailable")
"""Phrases of a ``RuntimeError`` that a busy machine raises (memory, threads), not a model."""


def _is_resource_failure(error: BaseException) -> bool:
    """Whether ``error`` says the machine ran out of memory or threads (raised, not a route)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(p in text for p in RESOURCE_FAILURES)


def _cache_replay_mismatch(model: nn.Module) -> str:
    """Replay every block at n of two probe prompts by the cache replay; "" when it matches.

    Catches models that compute something from the whole input that a cached
    call does not see (RoBERTa's position ids). Tolerance: ``sqrt(eps)``, relative.
    """
    from lm_coupling.jacobian.calls import (
        compute_dtype,
        engine_mode,
        record_last_token,
        replay_errors,
        run_prompts,
    )
    from lm_coupling.model.architecture import locate_model_parts

    parts = locate_model_parts(model)
    n = min(PROBE_TOKENS, parts.vocab_size - 1)
    ids = torch.arange(1, n + 1, device=parts.input_device)
    prompts = [ids, ids[: max(1, n // 2)].flip(0)]  # two lengths: the padded batch too
    dtype = compute_dtype(parts)
    run = run_prompts(model, parts, prompts)
    tol = torch.finfo(dtype).eps ** 0.5
    with engine_mode(model):
        calls = record_last_token(model, parts, prompts, dtype, run.prefixes)
        worst, block = replay_errors(calls, run.outputs)
    error, index = float(worst.max()), int(block[int(worst.argmax())])
    if not error <= tol:
        return (
            f"a call of block {index} on the last token with the prefix's keys and values "
            f"differs from the model's forward pass by {error:.2g} (relative): the model "
            "computes something from the whole input that a cached call does not see (e.g. "
            "position ids counted over the input)"
        )
    return ""


def choose_replay(model: nn.Module) -> tuple[str, str]:
    """``(CACHE, "")`` where the cache replay serves, else ``(SEQUENCE, why)``; once per model."""
    chosen = _CHOSEN.get(model)
    if chosen is None:
        with eval_mode(model):
            why = cache_replay_problem(model)
        chosen = (SEQUENCE, why) if why else (CACHE, "")
        _CHOSEN[model] = chosen
    return chosen


@dataclass
class SequenceCall:
    """Block l of B documents, each called on its whole prompt with rows < n fixed.

    Same interface as ``jacobian_calls.BlockCall`` for the engine's routes:
    :meth:`last_token_map` maps ``[B, d] -> [B, d]``, document b's output
    depending on row b only.

    Attributes:
        block: the model's own block.
        docs: one whole-sequence ``BlockCall`` per document (``hidden [1, T_b, d]``).
        hidden: ``[B, 1, d]`` x^{l-1}_n of each document.
    """

    block: nn.Module
    docs: list[BlockCall]
    hidden: torch.Tensor
    split_prefix: bool = False

    def last_token_map(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        """``f(x)_b = block(X_b with row n_b = x_b)_{n_b} - x_b``, and ``x^{l-1}_n [B, d]``."""
        params = self.docs[0].params()
        prefixes = [call.hidden[:, :-1] for call in self.docs]

        def f(x: torch.Tensor) -> torch.Tensor:
            rows = []
            for b, (call, prefix) in enumerate(zip(self.docs, prefixes, strict=True)):
                xb = x[b : b + 1]
                out = call.run(torch.cat([prefix, xb[:, None]], dim=1), params)[:, -1]
                rows.append(out - xb)
            return torch.cat(rows)

        return f, self.hidden[:, -1]


def record_sequences(
    model: nn.Module, parts: ModelParts, prompts: list[torch.Tensor], dtype: torch.dtype
) -> list[SequenceCall]:
    """Every block's whole-sequence call for each prompt, as L ``SequenceCall``s.

    Call inside ``engine_mode``. Each prompt runs alone (no padding).
    """
    kwargs = {"use_cache": False} if accepts_argument(model, "use_cache") else {}
    per_doc = []
    for ids in prompts:
        records = _record(model, parts.blocks, ids[None], **kwargs)
        per_doc.append(
            [
                _block_call(block, record, dtype, lambda _cache: None)
                for block, record in zip(parts.blocks, records, strict=True)
            ]
        )
    calls = []
    for index, block in enumerate(parts.blocks):
        docs = [doc[index] for doc in per_doc]
        hidden = torch.cat([call.hidden[:, -1:] for call in docs])
        calls.append(SequenceCall(block=block, docs=docs, hidden=hidden))
    return calls
