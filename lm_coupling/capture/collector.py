"""Streaming forward hooks that turn one batched forward pass into geometry summaries.

A forward pre-hook on block 1 takes x^0 (the block's input hidden states) and
a forward hook on every block l takes x^l (its output, before the final norm).
Each state is reduced at once and dropped: the trajectory summaries go through
a streaming :class:`~lm_coupling.metrics.trajectory.TrajectoryAccumulator`, and
the logit lens keeps only the rows at the target position n (``[B, d]`` per
layer). The whole ``L x B x T x d`` stack is never held.

Padding conventions (lm-eval): loglikelihood batches are padded on the right
(``first_index = 0``); generation batches are padded on the left with an
attention mask (``first_index`` = number of pads). In both cases the values of
a document equal those of its prompt alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lm_coupling.capture.architecture import ModelParts, block_output_hidden, work_dtype
from lm_coupling.errors import LmCouplingError
from lm_coupling.metrics.lens import lens_summary
from lm_coupling.metrics.trajectory import TrajectoryAccumulator
from lm_coupling.states import GeometryStates, LensStates, TrajectoryStates

__all__ = ["CaptureHandle", "StateCollector", "capture_prompt_states"]

_LENS_CHUNK_ELEMENTS = 1 << 27
"""Upper bound on ``rows * (L+1) * V`` logits materialised at once by the lens."""


@dataclass
class CaptureHandle:
    """What :meth:`StateCollector.capture` yields.

    Attributes:
        states: the captured :class:`GeometryStates`, set when the context exits
            after a complete forward; None before, or if no forward ran inside it.
    """

    states: GeometryStates | None = None


def _as_index(values, name: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a sequence or tensor of indices."""
    tensor = torch.as_tensor(values).detach().cpu()
    if tensor.dim() != 1 or tensor.is_floating_point():
        raise ValueError(
            f"{name} must be a 1-D integer sequence with one entry per document, got "
            f"shape {tuple(tensor.shape)} dtype {tensor.dtype}"
        )
    return tensor.to(torch.int64)


class _Run:
    """The hook state of one capture: waits for the first forward, reduces it, then idles."""

    def __init__(self, collector: StateCollector, last, first, target) -> None:
        self.collector = collector
        self.last, self.first, self.target = last, first, target
        self.phase = "waiting"  # -> "running" -> "done"
        self.n_tokens = 0
        self.accumulator = None
        self.lens_rows: list[torch.Tensor] = []
        self.row_index: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook on block 1: x^0 is its input hidden states."""
        if self.phase != "waiting":
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise LmCouplingError(
                "expected block 1 to receive hidden states [B, T, d] as its first argument or "
                f"as hidden_states=, got {type(hidden).__name__}; register an override"
            )
        batch, n_tokens = hidden.shape[0], hidden.shape[1]
        if batch != len(self.last):
            raise ValueError(
                f"capture() was given {len(self.last)} last_index entries but the forward "
                f"has batch size {batch}; pass one index per row of the batch"
            )
        if int(self.last.max()) >= n_tokens:
            raise ValueError(
                f"last_index {int(self.last.max())} is outside the {n_tokens} positions of "
                "the forward; pass the position of each row's last context token"
            )
        self.n_tokens = n_tokens
        self.phase = "running"
        if self.collector.trajectory:
            self.accumulator = TrajectoryAccumulator(
                windowed=self.collector.windowed, n_layers=self.collector.parts.n_layers
            )
        self._take(hidden)
        return None

    def post_hook(self, layer: int, module: nn.Module, args: tuple, output) -> None:
        """Forward hook on block ``layer`` (1-based): x^layer is its output."""
        if self.phase != "running":
            return None
        self._take(block_output_hidden(output))
        if layer == self.collector.parts.n_layers:
            self.phase = "done"
        return None

    def _take(self, hidden: torch.Tensor) -> None:
        """Reduce one state ``[B, T, d]`` and keep only the reductions."""
        hidden = hidden.detach()
        dtype, device = work_dtype(hidden), self.collector.device
        rows = None
        if self.collector.lens or self.collector.tokens == "last":
            rows = hidden[self._index_at_n(hidden.device)].to(device=device, dtype=dtype)  # [B, d]
        if self.collector.lens:
            self.lens_rows.append(rows)
        if self.accumulator is not None:
            if self.collector.tokens == "last":
                self.accumulator.update(rows[:, None])
            else:
                self.accumulator.update(hidden.to(device=device, dtype=dtype))

    def _index_at_n(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(arange(B), last)`` on ``device``, made once per device (blocks may be spread)."""
        index = self.row_index.get(device)
        if index is None:
            batch = torch.arange(len(self.last), device=device)
            index = self.row_index[device] = (batch, self.last.to(device))
        return index

    def finish(self) -> GeometryStates:
        """Finalize the summaries of a complete forward."""
        parts = self.collector.parts
        states = GeometryStates(parts.n_layers, parts.d_model, parts.vocab_size)
        if self.accumulator is not None:
            states.trajectory = self._trajectory()
        if self.collector.lens:
            states.lens = self._lens()
        return states

    def _trajectory(self) -> TrajectoryStates:
        """TrajectoryStates at all positions (NaN outside n with ``tokens="last"``)."""
        out = self.accumulator.finalize()
        device = self.collector.device
        positions = torch.arange(self.n_tokens, device=device)[None]
        last, first = self.last.to(device)[:, None], self.first.to(device)[:, None]
        if self.collector.tokens == "last":
            mask = positions == last
            out = {key: _scatter_last(value, last, self.n_tokens) for key, value in out.items()}
        else:
            mask = (positions > first) & (positions <= last)
        return TrajectoryStates(
            norms=out["norms"],
            step_lengths=out["step_lengths"],
            lss=out["lss"],
            windowed_lss=out["windowed_lss"],
            token_mask=mask,
        )

    def _lens(self) -> LensStates:
        """Logit-lens summaries at n from the kept rows ``[B, L+1, d]``."""
        parts, device = self.collector.parts, self.collector.device
        stack = torch.stack(self.lens_rows, dim=1)  # [B, L+1, d]
        per_row = max(1, stack.shape[1] * parts.vocab_size)
        chunk = max(1, _LENS_CHUNK_ELEMENTS // per_row)
        results = []
        for rows, target in zip(stack.split(chunk), self.target.split(chunk), strict=True):
            logits = parts.unembed_fp32(parts.final_norm_fp32(rows))  # [b, L+1, V]
            summary = lens_summary(logits, target.to(logits.device))
            results.append([value.to(device) for value in summary])
        entropy, target_prob, top1 = (torch.cat(column) for column in zip(*results, strict=True))
        return LensStates(entropy=entropy, target_prob=target_prob, top1=top1)


def _scatter_last(value: torch.Tensor | None, last: torch.Tensor, n_tokens: int):
    """Place values computed at n alone (last dim 1) at position n of a NaN tensor."""
    if value is None:
        return None
    full = torch.full(
        (*value.shape[:-1], n_tokens), float("nan"), dtype=value.dtype, device=value.device
    )
    index = last.view(-1, *([1] * (value.dim() - 1))).expand(*value.shape[:-1], 1)
    return full.scatter(-1, index, value)


class StateCollector:
    """Capture trajectory summaries and logit-lens quantities from one forward pass.

    Args:
        model: the causal LM the hooks attach to.
        parts: its located parts (:func:`~lm_coupling.capture.architecture.locate_model_parts`).
        trajectory: compute per-token trajectory summaries (norms, step lengths,
            line-shape scores).
        lens: compute logit-lens summaries at each row's target position n.
        windowed: also compute the windowed line-shape score (window 11).
        tokens: ``"all"`` (context tokens first_index+1..n) or ``"last"`` (n alone;
            the trajectory is then computed at n only, NaN elsewhere).

    Results live on the device of the first block's parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        parts: ModelParts,
        *,
        trajectory: bool,
        lens: bool,
        windowed: bool = True,
        tokens: Literal["all", "last"] = "all",
    ) -> None:
        if tokens not in ("all", "last"):
            raise ValueError(f"tokens must be 'all' or 'last', got {tokens!r}")
        if not isinstance(parts, ModelParts):
            raise TypeError(f"parts must be ModelParts (from locate_model_parts), got {parts!r}")
        self.model, self.parts = model, parts
        self.trajectory, self.lens = bool(trajectory), bool(lens)
        self.windowed, self.tokens = bool(windowed), tokens
        first_param = next(parts.blocks[0].parameters(), None)
        self.device = first_param.device if first_param is not None else torch.device("cpu")

    @contextmanager
    def capture(
        self,
        last_index: Sequence[int] | torch.Tensor,
        first_index: Sequence[int] | torch.Tensor,
        target_tokens: Sequence[int] | torch.Tensor | None,
    ) -> Iterator[CaptureHandle]:
        """Capture the first model forward run inside the context.

        Later forwards (the decoding steps of ``model.generate``) pass through
        untouched. Every hook handle is removed on exit, also when the forward
        raises.

        Args:
            last_index: ``[B]`` position n of each row's last context token.
            first_index: ``[B]`` position of each row's first real token (the
                number of left pads; 0 for right padding). It is an attention
                sink and excluded from the token mask.
            target_tokens: ``[B]`` gold next token at n, -1 for none (or None).

        Yields:
            A :class:`CaptureHandle` whose ``states`` are set on exit.

        Raises:
            ValueError: index shapes disagree, ``first_index > last_index``, or (in
                the forward) the batch size or length does not fit the indices.
        """
        last = _as_index(last_index, "last_index")
        first = _as_index(first_index, "first_index")
        target = (
            torch.full_like(last, -1)
            if target_tokens is None
            else _as_index(target_tokens, "target_tokens")
        )
        if not (len(last) == len(first) == len(target)):
            raise ValueError(
                f"last_index, first_index and target_tokens need one entry per document, got "
                f"lengths {len(last)}, {len(first)}, {len(target)}"
            )
        if bool((first > last).any()) or bool((first < 0).any()):
            raise ValueError(
                f"need 0 <= first_index <= last_index per row, got first_index={first.tolist()} "
                f"last_index={last.tolist()}"
            )
        run, handle, hooks = _Run(self, last, first, target), CaptureHandle(), []
        try:
            hooks.append(
                self.parts.blocks[0].register_forward_pre_hook(run.pre_hook, with_kwargs=True)
            )
            for layer, block in enumerate(self.parts.blocks, start=1):
                hooks.append(block.register_forward_hook(_bind(run.post_hook, layer)))
            yield handle
            if run.phase == "done":
                handle.states = run.finish()
        finally:
            for hook in hooks:
                hook.remove()

    def capture_prompt(
        self, input_ids: Sequence[int] | torch.Tensor, target_token: int = -1
    ) -> GeometryStates:
        """Capture the geometry of one prompt alone, without padding (the reference route).

        The target position n is the last token ``T - 1``; the token mask covers
        positions 1..T-1 (or T-1 alone with ``tokens="last"``).

        Args:
            input_ids: ``[T]`` token ids of the prompt.
            target_token: gold next token at n, -1 for none.

        Returns:
            :class:`GeometryStates` with B = 1.

        Raises:
            ValueError: ``input_ids`` is not a non-empty 1-D sequence.
            LmCouplingError: the forward did not run every block through the hooks.
        """
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
            raise ValueError(
                f"input_ids must be a non-empty 1-D integer sequence, got shape {tuple(ids.shape)}"
            )
        n = ids.numel() - 1
        with torch.no_grad(), self.capture([n], [0], [target_token]) as handle:
            ids = ids[None].to(device=self.parts.input_device, dtype=torch.int64)
            self.model(ids, use_cache=False)
        if handle.states is None:
            raise LmCouplingError(
                "the forward pass did not run every decoder block through its hooks; "
                "check the model's override (register_override)"
            )
        return handle.states


def _bind(post_hook, layer: int):
    """A forward hook that calls ``post_hook(layer, module, args, output)``."""

    def hook(module: nn.Module, args: tuple, output) -> None:
        return post_hook(layer, module, args, output)

    return hook


def capture_prompt_states(
    model: nn.Module,
    parts: ModelParts,
    input_ids: Sequence[int] | torch.Tensor,
    target_token: int = -1,
    **collector_kwargs,
) -> GeometryStates:
    """Capture the geometry of one prompt alone with a new :class:`StateCollector`.

    See :meth:`StateCollector.capture_prompt`.

    Args:
        model: the causal LM.
        parts: its located parts.
        input_ids: ``[T]`` token ids of the prompt.
        target_token: gold next token at n, -1 for none.
        **collector_kwargs: :class:`StateCollector` options; ``trajectory`` and
            ``lens`` default to True.

    Returns:
        :class:`GeometryStates` with B = 1.

    Raises:
        ValueError: ``input_ids`` is not a non-empty 1-D sequence.
    """
    collector_kwargs.setdefault("trajectory", True)
    collector_kwargs.setdefault("lens", True)
    collector = StateCollector(model, parts, **collector_kwargs)
    return collector.capture_prompt(input_ids, target_token)
