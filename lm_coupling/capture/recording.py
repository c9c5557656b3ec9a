"""Record the measured rows of a forward pass now; reduce several forward passes later.

Reducing one benchmark batch costs a fixed number of small tensor operations
and plugin calls (a few hundred), whatever its size. Where the forward pass
is cheap (a small model, a GPU) and a batch measures two or three documents,
that fixed cost is most of the geometry's overhead. A `Recording` keeps a
forward pass's measured rows (a copy of each state ``x^l``, l = 0..L, of those
rows only, as one ``[L+1, b, T, d]`` tensor) and `stack_recordings` joins the
recordings of several forward passes into one batch, right-padded to the
longest (`merge_recordings` when only the rows at n are kept), which the
collector then serves to the reducers as if it had been one forward pass
(`StateCollector.replay`).

How the rows are copied (`Recorder`). A tensor operation run inside the
forward pass, between the model's own, costs several times what it costs
outside it (measured on the shared CPU: an ``index_select`` of a block's
output took 29 µs in a hook, 4 µs in a loop; issue 28, docs/benchmarks.md).
So when every state of the forward is small (`REFERENCE_BYTES`) and on one
device, the hooks only keep a reference to each state ``x^l`` and its
version counter, and the measured rows of all of them are copied when block
L has run, before the model's head computes its logits, so the forward's
peak memory does not grow (stacked whole then selected, or each state's
rows straight into one tensor: `STACK_FIRST_BYTES`). A state written in
place by a later block (its version counter moved) would make the reference
wrong: the recording is then marked (`Recording.error`) and the collector
copies each state in its own hook from then on (`StateCollector.copy_in_hooks`),
as it always does for larger forwards and for models spread over devices.

The values do not change: every reduction is per row over the row's measured
tokens (``BatchInfo.token_mask``: positions ``first_index + 1 .. n``), and
the extra right pads are outside it, as lm-eval's own pads are. Attention
probabilities (``[B, H, T, T]`` per block) are never recorded: a run that
reads them reduces each forward pass at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lm_coupling.capture.architecture import block_output_hidden
from lm_coupling.capture.torch_adapter import write_count
from lm_coupling.errors import LmCouplingError
from lm_coupling.states import DocumentRef

__all__ = [
    "REFERENCE_BYTES",
    "STACK_FIRST_BYTES",
    "Recording",
    "Recorder",
    "forward_shape",
    "stacks_whole",
    "merge_recordings",
    "stack_recordings",
]

REFERENCE_BYTES = 8 * 2**20
"""Largest forward (every state of every row, ``(L+1) B T d`` elements) whose states are
referenced during the forward and copied together after block L (8 MiB); a larger
one is copied state by state in the hooks."""

STACK_FIRST_BYTES = 512 * 2**10
"""Largest forward (every state of every row) whose referenced states are stacked whole before
the measured rows are selected (512 KiB); a larger one has each state's measured rows copied
straight into the recording. Measured on the shared CPU (issue 28, docs/benchmarks.md): below
about this size the two operations of the stack beat one copy per state; above it the stack of
every row costs 1.2-5.6 times the copies of the measured rows alone."""


def stacks_whole(nbytes: int) -> bool:
    """Whether referenced states of ``nbytes`` in all are stacked whole (`STACK_FIRST_BYTES`)."""
    return nbytes <= STACK_FIRST_BYTES


def forward_shape(hidden, last_index: list[int], rows: list[int] | None) -> tuple[int, int]:
    """``(rows measured, positions measured)`` of a forward pass, checked against its indices.

    The positions measured are ``0 .. max(last_index)``: no row measures a
    later one (an answer's tokens after every row's n), so the capture serves
    and a recording keeps only those.

    Args:
        hidden: what block 1 received as its hidden states.
        last_index: the capture's ``[b]`` target positions.
        rows: the forward's rows measured, or None for every row.

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
    n_rows, max_last = len(last_index), max(last_index, default=-1)
    if rows is not None:
        max_row = max(rows, default=-1)
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
        last, first, target: per measured row, its target position n, its
            first real token and its gold next token (-1: none), as given to
            `StateCollector.record`.
        documents: per measured row, the documents it measures.
        stacked: ``x^0..x^L`` of the measured rows, once every block has run:
            ``[L+1, b, T, d]`` when the reducers read ``hidden_states``, else
            the rows at the target positions ``[L+1, b, d]``; the model's
            dtype, on the device of block 1. None before.
        n_tokens: T, the positions kept (None before the forward).
        complete: every block's output was recorded.
        error: why the recording is unusable though every block ran (a
            state written in place after its hook read it), else None.
    """

    last: list[int]
    first: list[int]
    target: list[int]
    documents: tuple[tuple[DocumentRef, ...], ...]
    stacked: torch.Tensor | None = None
    n_tokens: int | None = None
    complete: bool = False
    error: str | None = None

    @property
    def size(self) -> int:
        """b, the measured rows."""
        return len(self.last)

    @property
    def states(self) -> list[torch.Tensor]:
        """Per l = 0..L, ``x^l`` of the measured rows (views of `stacked`; empty before)."""
        return [] if self.stacked is None else list(self.stacked.unbind(0))

    @property
    def nbytes(self) -> int:
        """Bytes of the recorded states (of the positions kept)."""
        return 0 if self.stacked is None else self.stacked.numel() * self.stacked.element_size()


class Recorder:
    """The hooks of one recording: keep the measured rows of each state, run nothing else.

    Args:
        recording: where the states go.
        n_layers: L (the recording is complete after block L).
        rows: the forward's rows measured (None: every row).
        whole_rows: keep ``[b, T, d]`` per state (else the rows at the target positions).
        by_reference: reference the states during the forward and copy them
            together after block L, when the forward's states are small
            (`REFERENCE_BYTES`); else copy each state in its own hook.
        on_written: called (no argument) when a referenced state was written
            in place after its hook (the collector then copies in the hooks).
    """

    def __init__(
        self,
        recording: Recording,
        n_layers: int,
        rows: list[int] | None,
        whole_rows: bool,
        by_reference: bool = True,
        on_written=None,
    ) -> None:
        self.recording, self.n_layers, self.rows = recording, n_layers, rows
        self.whole_rows, self.by_reference, self.on_written = whole_rows, by_reference, on_written
        self.phase = "waiting"  # -> "running" -> "done"
        self.width = 0  # the positions kept (set by the pre-hook)
        self.kept: list[torch.Tensor] = []  # per state so far: a reference, or a copy
        self.versions: list[int] = []  # the references' version counters when read
        self._indices: dict[tuple[torch.device, int | None], torch.Tensor] = {}
        if rows is not None and whole_rows:  # made before the forward, where it is cheap
            self._indices[(torch.device("cpu"), None)] = torch.tensor(rows)

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook on block 1: x^0 is its input hidden states."""
        if self.phase != "waiting":
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        _, self.width = forward_shape(hidden, self.recording.last, self.rows)
        self.phase = "running"
        self.recording.n_tokens = self.width
        if self.by_reference:
            batch, n_tokens, width = hidden.shape
            elements = (self.n_layers + 1) * batch * n_tokens * width
            self.by_reference = elements * hidden.element_size() <= REFERENCE_BYTES
        self._keep(hidden)
        return None

    def post_hook(self, layer: int, module: nn.Module, args: tuple, output) -> None:
        """Forward hook on block ``layer`` (1-based): x^layer is its output."""
        if self.phase != "running":
            return None
        self._keep(block_output_hidden(output))
        if layer == self.n_layers:
            self.phase = "done"
            self._finish()
        return None

    def _keep(self, hidden: torch.Tensor) -> None:
        """Keep a reference to ``x^l`` (and its version), or a copy of its measured rows."""
        if self.by_reference:
            self.kept.append(hidden)
            self.versions.append(write_count(hidden))
        else:  # a copy, never a view: the model may write the state in place
            self.kept.append(self._measured(hidden.detach(), dim=0))

    def _finish(self) -> None:
        """After block L: the measured rows of every state, as one tensor."""
        kept, self.kept = self.kept, []
        recording = self.recording
        if not self.by_reference:
            recording.stacked = torch.stack(_joinable(kept))
            recording.complete = True
            return
        written = [
            layer
            for layer, (state, version) in enumerate(zip(kept, self.versions, strict=True))
            if write_count(state) != version
        ]
        if written:
            recording.error = (
                f"the model wrote state x^{written[0]} in place after its block returned it, "
                "so its recorded reference changed; its states are now copied in each hook"
            )
            if self.on_written is not None:
                self.on_written()
            return
        recording.stacked = self._measured_stack(kept)
        recording.complete = True

    def _measured_stack(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The measured rows of every referenced state, as one new ``[L+1, b, ...]`` tensor.

        A forward whose states pass `STACK_FIRST_BYTES` has each state's
        measured rows (and positions) copied once, straight into their place:
        its other rows are never copied. A smaller one is stacked whole and its
        measured rows selected after (two operations, not one per state).
        States of mixed dtypes or devices are joined first (`_joinable`).
        """
        first = states[0]
        joinable = _joinable(states)
        if joinable is not states or stacks_whole(len(states) * first.nbytes):
            stacked = torch.stack(joinable)
            return self._measured(stacked.detach() if stacked.requires_grad else stacked, dim=1)
        size, width, depth = len(self.recording.last), self.width, len(states)
        shape = (depth, size, width) if self.whole_rows else (depth, size)
        out = torch.empty((*shape, first.shape[-1]), dtype=first.dtype, device=first.device)
        for layer, state in enumerate(states):
            state = state.detach()
            if not self.whole_rows:  # the rows at n, from the [B T, d] view
                index = self._index(state.device, state.shape[1])
                torch.index_select(state.flatten(0, 1), 0, index, out=out[layer])
            elif self.rows is None:
                out[layer].copy_(state.narrow(1, 0, width))
            else:
                rows = self._index(state.device)
                torch.index_select(state.narrow(1, 0, width), 0, rows, out=out[layer])
        return out

    def _measured(self, states: torch.Tensor, dim: int) -> torch.Tensor:
        """A copy of the measured rows of ``states`` (rows: dimension ``dim``, positions: the next).

        Whole rows keep every position up to the last one measured; otherwise
        only each row's target position n (``[.., b, d]``).
        """
        if not self.whole_rows:  # one gather of the rows at n from the [.., B T, d] view
            return states.flatten(dim, dim + 1).index_select(
                dim, self._index(states.device, states.shape[dim + 1])
            )
        if self.rows is None:
            return states.narrow(dim + 1, 0, self.width).clone(
                memory_format=torch.contiguous_format
            )
        # The rows first (a contiguous source copies fastest), then the positions kept: a
        # view of them (the few positions after the last n stay in its memory).
        rows = states.index_select(dim, self._index(states.device))
        return rows if self.width == rows.shape[dim + 1] else rows.narrow(dim + 1, 0, self.width)

    def _index(self, device: torch.device, n_tokens: int | None = None) -> torch.Tensor:
        """The measured rows (or, given ``n_tokens``, the flat positions ``b T + n``) on ``device``.

        Made once per device and kind (blocks may be spread over devices).
        """
        cached = self._indices.get((device, n_tokens))
        if cached is None:
            if n_tokens is None:
                values = self.rows
            else:
                rows = range(len(self.recording.last)) if self.rows is None else self.rows
                values = [b * n_tokens + n for b, n in zip(rows, self.recording.last, strict=True)]
            cpu = self._indices.get((torch.device("cpu"), n_tokens))
            host = torch.tensor(values) if cpu is None else cpu
            cached = self._indices[(device, n_tokens)] = host.to(device)
        return cached


def _joinable(states: list[torch.Tensor]) -> list[torch.Tensor]:
    """``states`` on one device and in one dtype, so that they stack (as they almost always are).

    A block that returns another dtype than the others (a hybrid's float32
    layer in a bfloat16 model) or, copied in its hook, sits on another device
    is converted to the first state's device and the promoted dtype.
    """
    first = states[0]
    if all(s.dtype == first.dtype and s.device == first.device for s in states):
        return states
    dtype = first.dtype
    for state in states:
        dtype = torch.promote_types(dtype, state.dtype)
    return [state.to(device=first.device, dtype=dtype) for state in states]


def merge_recordings(
    recordings: list[Recording], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    """The rows at n of several recordings as one batch (whole rows: `stack_recordings`).

    Args:
        recordings: complete recordings of one model that kept the rows at
            the target positions (``[L+1, b, d]``).
        device: where the merged states are made.
        dtype: what they are made in.

    Returns:
        ``(states, n_tokens)``: ``[L+1, sum b, d]``, the rows of every
        recording in order; and ``T_max``, the longest recording's positions.
    """
    n_tokens = max(recording.n_tokens for recording in recordings)
    parts = [recording.stacked.to(device) for recording in recordings]
    merged = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return merged.to(dtype), n_tokens


def stack_recordings(
    recordings: list[Recording],
    device: torch.device,
    dtype: torch.dtype,
    buffer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """The whole-row states of several recordings as one ``[sum b, L+1, T_max, d]`` stack.

    Each recording's rows, in order, hold its states ``x^0..x^L`` at its
    positions and zeros after them (the right pads). One tensor, filled
    once (one copy per recording): a reducer of every state at once reads it
    as it is (``LayerView.stack``). It is laid out layer by layer in memory
    (a ``[L+1, sum b, T_max, d]`` tensor, transposed), so each layer's
    ``[sum b, T_max, d]`` is a contiguous view.

    Args:
        recordings: complete recordings of whole rows (``[L+1, b, T, d]``).
        device: where the stack is made.
        dtype: what it is made in.
        buffer: memory to make it in when it is large enough (a flat tensor
            of ``dtype`` on ``device``, reused across calls); else new memory.

    Returns:
        ``(stack, T_max)``.
    """
    n_tokens = max(recording.n_tokens for recording in recordings)
    depth, _, _, width = recordings[0].stacked.shape
    rows = sum(recording.size for recording in recordings)
    shape = (depth, rows, n_tokens, width)
    numel = depth * rows * n_tokens * width
    if buffer is not None and buffer.numel() >= numel:
        layers = buffer[:numel].view(shape)
    else:
        layers = torch.empty(shape, device=device, dtype=dtype)
    start = 0
    for recording in recordings:
        block = layers[:, start : start + recording.size]
        block[:, :, : recording.n_tokens] = recording.stacked
        if recording.n_tokens < n_tokens:
            block[:, :, recording.n_tokens :] = 0
        start += recording.size
    return layers.transpose(0, 1), n_tokens
