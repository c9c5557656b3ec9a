"""Record the measured rows of a forward pass now; reduce several forward passes later.

Reducing one benchmark batch costs a fixed number of small tensor operations
and plugin calls (a few hundred), whatever its size. Where the forward pass
is cheap (a small model, a GPU) and a batch measures two or three documents,
that fixed cost is most of the geometry's overhead. A `Recording` keeps a
forward pass's measured rows (a copy of each state ``x^l``, l = 0..L, of those
rows only: the forward's own tensors are not held) and `stack_recordings`
joins the recordings of several forward passes into one batch, right-padded
to the longest (`merge_recordings` when only the rows at n are kept), which
the collector then serves to the reducers as if it had been one forward pass
(`StateCollector.replay`).

The values do not change: every reduction is per row over the row's measured
tokens (``BatchInfo.token_mask``: positions ``first_index + 1 .. n``), and
the extra right pads are outside it, as lm-eval's own pads are. Attention
probabilities (``[B, H, T, T]`` per block) are never recorded: a run that
reads them reduces each forward pass at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lm_coupling.capture.architecture import block_output_hidden
from lm_coupling.errors import LmCouplingError
from lm_coupling.states import DocumentRef

__all__ = ["Recording", "Recorder", "forward_shape", "merge_recordings", "stack_recordings"]


def forward_shape(hidden, last_index: torch.Tensor, rows: torch.Tensor | None) -> tuple[int, int]:
    """``(rows measured, positions measured)`` of a forward pass, checked against its indices.

    The positions measured are ``0 .. max(last_index)``: no row measures a
    later one (an answer's tokens after every row's n), so the capture serves
    and a recording keeps only those.

    Args:
        hidden: what block 1 received as its hidden states.
        last_index: the capture's ``[b]`` target positions (CPU: read without a sync).
        rows: the forward's rows measured (CPU), or None for every row.

    Raises:
        LmCouplingError: block 1 received no ``[B, T, d]`` tensor.
        ValueError: the batch size or length does not fit the indices.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise LmCouplingError(
            "expected block 1 to receive hidden states [B, T, d] as its first argument or "
            f"as hidden_states=, got {type(hidden).__name__}; register an override"
        )
    batch, n_tokens = hidden.shape[0], hidden.shape[1]
    n_rows, max_last = len(last_index), max(last_index.tolist(), default=-1)
    if rows is not None:
        max_row = max(rows.tolist(), default=-1)
        if max_row >= batch:
            raise ValueError(
                f"capture() was given row {max_row} to measure but the "
                f"forward has batch size {batch}; pass rows of the batch"
            )
        batch = n_rows
    elif batch != n_rows:
        raise ValueError(
            f"capture() was given {n_rows} last_index entries but the forward "
            f"has batch size {batch}; pass one index per row of the batch"
        )
    if max_last >= n_tokens:
        raise ValueError(
            f"last_index {max_last} is outside the {n_tokens} positions of "
            "the forward; pass the position of each row's last context token"
        )
    return batch, max_last + 1


@dataclass
class Recording:
    """The measured rows of one forward pass, for a later reduction.

    Attributes:
        last_index, first_index, target_tokens: ``[b]`` int64 (CPU), as given
            to `StateCollector.record`.
        documents: per measured row, the documents it measures.
        states: ``x^l`` of the measured rows for l = 0..L as recorded so far:
            ``[b, T, d]`` when the reducers read ``hidden_states``, else the
            rows at the target positions ``[b, d]``; the model's dtype and
            the device of the block that made it.
        n_tokens: T, the forward's positions (None before the forward).
        complete: every block's output was recorded.
    """

    last_index: torch.Tensor
    first_index: torch.Tensor
    target_tokens: torch.Tensor
    documents: tuple[tuple[DocumentRef, ...], ...]
    states: list[torch.Tensor] = field(default_factory=list)
    n_tokens: int | None = None
    complete: bool = False

    @property
    def size(self) -> int:
        """b, the measured rows."""
        return len(self.last_index)

    @property
    def nbytes(self) -> int:
        """Bytes the recorded states hold."""
        return sum(state.nbytes for state in self.states)


class Recorder:
    """The hooks of one recording: copy the measured rows of each state, nothing else.

    Args:
        recording: where the copies go.
        n_layers: L (the recording is complete after block L).
        rows: the forward's rows measured (None: every row).
        whole_rows: keep ``[b, T, d]`` (else the rows at the target positions).
    """

    def __init__(
        self, recording: Recording, n_layers: int, rows: torch.Tensor | None, whole_rows: bool
    ) -> None:
        self.recording, self.n_layers, self.rows = recording, n_layers, rows
        self.whole_rows = whole_rows
        self.phase = "waiting"  # -> "running" -> "done"
        self.width = 0  # the positions kept (set by the pre-hook)
        self.index_on: dict[torch.device, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook on block 1: x^0 is its input hidden states."""
        if self.phase != "waiting":
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        _, self.width = forward_shape(hidden, self.recording.last_index, self.rows)
        self.phase = "running"
        self.recording.n_tokens = self.width
        self._keep(hidden)
        return None

    def post_hook(self, layer: int, module: nn.Module, args: tuple, output) -> None:
        """Forward hook on block ``layer`` (1-based): x^layer is its output."""
        if self.phase != "running":
            return None
        self._keep(block_output_hidden(output))
        if layer == self.n_layers:
            self.phase = "done"
            self.recording.complete = True
        return None

    def _keep(self, hidden: torch.Tensor) -> None:
        """A copy of the measured rows (never a view: the model may write the state in place).

        Whole rows are kept up to the last position measured (``forward_shape``).
        """
        if hidden.requires_grad:  # never under lm-eval's no_grad: no detach per state
            hidden = hidden.detach()
        rows, last = self._index(hidden.device)
        if not self.whole_rows:
            batch = torch.arange(len(last), device=hidden.device) if rows is None else rows
            self.recording.states.append(hidden[batch, last])
            return
        hidden = hidden[:, : self.width]
        self.recording.states.append(
            hidden.clone(memory_format=torch.contiguous_format)
            if rows is None
            else hidden.index_select(0, rows)
        )

    def _index(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The measured rows and the target positions on ``device`` (blocks may be spread)."""
        index = self.index_on.get(device)
        if index is None:
            rows = None if self.rows is None else self.rows.to(device)
            index = self.index_on[device] = (rows, self.recording.last_index.to(device))
        return index


def merge_recordings(
    recordings: list[Recording], device: torch.device, dtype: torch.dtype
) -> tuple[list[torch.Tensor], int]:
    """The rows at n of several recordings as one batch (whole rows: `stack_recordings`).

    Args:
        recordings: complete recordings of one model that kept the rows at
            the target positions (``[b, d]`` states).
        device: where the merged states are made.
        dtype: what they are made in.

    Returns:
        ``(states, n_tokens)``: per l = 0..L the rows of every recording in
        order, ``[sum b, d]``; and ``T_max``, the longest recording's positions.
    """
    n_tokens = max(recording.n_tokens for recording in recordings)
    merged = []
    for layer in range(len(recordings[0].states)):
        parts = [recording.states[layer].to(device) for recording in recordings]
        state = parts[0] if len(parts) == 1 else torch.cat(parts)
        merged.append(state.to(dtype))
    return merged, n_tokens


def stack_recordings(
    recordings: list[Recording], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    """The whole-row states of several recordings as one ``[sum b, L+1, T_max, d]`` stack.

    Each recording's rows, in order, hold its states ``x^0..x^L`` at its
    positions and zeros after them (the right pads). One tensor, filled
    once: a reducer of every state at once reads it as it is
    (``LayerView.stack``), and each layer's ``[sum b, T_max, d]`` is a view.

    Args:
        recordings: complete recordings of whole rows (``[b, T, d]`` states).
        device: where the stack is made.
        dtype: what it is made in.

    Returns:
        ``(stack, T_max)``.
    """
    n_tokens = max(recording.n_tokens for recording in recordings)
    depth, width = len(recordings[0].states), recordings[0].states[0].shape[-1]
    rows = sum(recording.size for recording in recordings)
    stack = torch.empty((rows, depth, n_tokens, width), device=device, dtype=dtype)
    start = 0
    for recording in recordings:
        block = stack[start : start + recording.size]
        for layer, state in enumerate(recording.states):
            block[:, layer, : state.shape[1]] = state
        if recording.n_tokens < n_tokens:
            block[:, :, recording.n_tokens :] = 0
        start += recording.size
    return stack, n_tokens
