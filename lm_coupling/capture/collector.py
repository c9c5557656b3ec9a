"""Streaming forward hooks: one batched forward pass, served layer by layer to reducers.

A forward pre-hook on block 1 takes x^0 (its input) and a forward hook on
every block l takes x^l (its output, before the final norm). Each state goes
at once, as one `LayerView`, to the reducers started for the batch (the
plugins' ``lmc_layer_reducer``), then is dropped: capture never holds the
``L x B x T x d`` stack. A view carries what the selected metrics declared
(`lm_coupling.states.Need`). Every lens the run reads is held by name
(`lm_coupling.capture.lens`); a reducer with ``update_lens`` receives, after
x^L, the logits of every state at n through the lens its metrics name, from
one read-out per lens and batch. The hooks live for one forward call
(registered on entry, removed in ``finally``, as lm-eval's ``hf_steered.py``).
A reducer that raises is dropped from the batch, its error kept under its
name (``CaptureHandle.errors``). Right padding (loglikelihood) has
``first_index = 0``, left padding (generation) the number of pads; either way
a document's values equal those of its prompt alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from lm_coupling.capture.lens import read_all, shared_transform
from lm_coupling.errors import LmCouplingError
from lm_coupling.model.architecture import ModelParts, block_output_hidden, work_dtype
from lm_coupling.model.attention import attention_modules
from lm_coupling.states import BatchInfo, DocumentRef, GeometryStates, LayerReducer, LayerView, Lens

__all__ = ["CaptureHandle", "ReducerFactory", "StateCollector"]

ReducerFactory = Callable[[BatchInfo], "LayerReducer | None"]
"""Starts one reducer for a batch (None: nothing to reduce in this batch)."""


@dataclass
class CaptureHandle:
    """What :meth:`StateCollector.capture` yields, filled once the forward's last block ran.

    Attributes:
        states: the batch's :class:`GeometryStates` (None without a complete forward).
        reduced: per reducer name, what its ``finalize()`` returned.
        errors: per reducer name, the error (text) that dropped it.
        info: the batch's :class:`BatchInfo` (None before the forward).
        lens_errors: per lens name, its error (text); its readers' values are NaN.
        seconds: per reducer name, the wall seconds of its calls (its plugin's
            share of the capture).
    """

    states: GeometryStates | None = None
    reduced: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    info: BatchInfo | None = None
    lens_errors: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def _as_list(values, name: str) -> list[int]:
    """A list of ints from a sequence or 1-D tensor of indices (the harness's lists as they are)."""
    if type(values) is list and all(type(v) is int for v in values):
        return values
    tensor = torch.as_tensor(values).detach().cpu()
    if tensor.dim() != 1 or tensor.is_floating_point():
        raise ValueError(
            f"{name} must be a 1-D integer sequence with one entry per document, got "
            f"shape {tuple(tensor.shape)} dtype {tensor.dtype}"
        )
    return tensor.tolist()


def forward_shape(hidden, last_index: list[int], rows: list[int] | None) -> tuple[int, int]:
    """``(rows measured, positions 0 .. max(last_index))`` of a forward, checked.

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


class _Run:
    """The hook state of one capture: waits for the first forward, streams it, then idles."""

    def __init__(
        self,
        collector: StateCollector,
        last: list[int],
        first: list[int],
        target: list[int],
        factories: Mapping[str, ReducerFactory],
        documents: tuple[tuple[DocumentRef, ...], ...],
        handle: CaptureHandle,
        rows: list[int] | None = None,
        lens_of: Mapping[str, str] | None = None,
    ) -> None:
        self.collector = collector
        self.lens_of = {
            name: (lens_of or {}).get(name, next(iter(collector.lenses), "")) for name in factories
        }  # per reducer, the name of the lens it reads
        self.rows = rows  # the forward's rows measured (None: every row)
        self.last_list = last
        self.last, self.first, self.target = (
            torch.tensor(v, dtype=torch.int64) for v in (last, first, target)
        )
        self.factories, self.documents, self.handle = factories, documents, handle
        self.phase = "waiting"  # -> "running" -> "done"
        self.reducers: dict[str, LayerReducer] = {}
        self.attentions: dict[int, torch.Tensor | None] = {}
        self.whole_lens: list[str] = []  # reducers served every state's lens at once
        self.rows_at_n: list[torch.Tensor] = []  # x^l_n of l = 0.., for their read-out

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook on block 1: x^0 is its input hidden states."""
        if self.phase != "waiting":
            return None
        hidden = args[0] if args else kwargs.get("hidden_states")
        batch, n_tokens = forward_shape(hidden, self.last_list, self.rows)
        self.begin(batch, n_tokens, work_dtype(hidden))
        self.serve(0, hidden)
        return None

    def begin(self, batch: int, n_tokens: int, dtype: torch.dtype) -> None:
        """Start the reducers for a batch of ``batch`` measured rows and ``n_tokens`` positions."""
        self.phase = "running"
        collector, device = self.collector, self.collector.device
        last, first = self.last.to(device), self.first.to(device)
        positions = torch.arange(n_tokens, device=device)[None]
        self.handle.info = info = BatchInfo(
            n_layers=collector.parts.n_layers,
            d_model=collector.parts.d_model,
            vocab_size=collector.parts.vocab_size,
            size=batch,
            n_tokens=n_tokens,
            last_index=last,
            first_index=first,
            token_mask=(positions > first[:, None]) & (positions <= last[:, None]),
            target_tokens=self.target.to(device),
            documents=self.documents or tuple(() for _ in range(batch)),
            lens=next(iter(collector.lenses), ""),
            dtype=dtype,
            final_norm=collector.parts.final_norm_fp32,
        )
        for name, factory in self.factories.items():
            try:
                reducer = self._call(name, factory, replace(info, lens=self.lens_of[name]))
            except Exception as exc:  # a plugin's failure is its own
                self.handle.errors[name] = repr(exc)
                continue
            if reducer is not None:
                self.reducers[name] = reducer
        self.whole_lens = [
            name
            for name, reducer in self.reducers.items()
            if callable(getattr(reducer, "update_lens", None))
            and self.lens_of[name] in self.collector.lenses
        ]

    def attention_hook(self, layer: int, module: nn.Module, args: tuple, output) -> None:
        """Forward hook on block ``layer``'s attention: keep its probabilities until x^layer."""
        if self.phase != "running":
            return None
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        self.attentions[layer] = weights.detach() if isinstance(weights, torch.Tensor) else None
        return None

    def post_hook(self, layer: int, module: nn.Module, args: tuple, output) -> None:
        """Forward hook on block ``layer`` (1-based): x^layer is its output."""
        if self.phase != "running":
            return None
        self.serve(layer, block_output_hidden(output))
        if layer == self.collector.parts.n_layers:
            self.phase = "done"
            # Finalized here, inside the forward: the reducers' buffers (the windowed
            # LSS's ring of unit steps) are freed before the model's logits exist.
            self.finish()
        return None

    def serve(self, layer: int, hidden: torch.Tensor) -> None:
        """Serve one state ``hidden [B, T, d]`` of the forward to every reducer, then drop it."""
        if not self.reducers:
            return
        collector = self.collector
        device = collector.device
        hidden = self._measured(hidden.detach())[:, : self.handle.info.n_tokens]
        dtype = work_dtype(hidden)
        rows = torch.arange(len(self.last), device=hidden.device)
        at_n = hidden[rows, self.last.to(hidden.device)].to(device=device, dtype=dtype)
        if self.whole_lens:
            self.rows_at_n.append(at_n)
        fields = dict(
            layer=layer,
            hidden=hidden.to(device=device, dtype=dtype) if collector.hidden_states else None,
            at_n=at_n,
            attentions=self._attentions(layer, device, dtype),
        )
        views: dict[str, LayerView] = {}  # one per lens, its read shared by its readers
        for name, reducer in list(self.reducers.items()):
            lens = self.lens_of[name]
            if lens not in views:
                served = lens in self.collector.lenses
                read = (lambda lens=lens: self._lens(lens, layer, at_n)) if served else None
                views[lens] = LayerView(**fields, lens=read)
            try:
                self._call(name, reducer.update, views[lens])
            except Exception as exc:  # a plugin's failure is its own
                self.handle.errors[name] = repr(exc)
                del self.reducers[name]

    def _lens(self, lens: str, layer: int, at_n: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``(N(x^l_n), logits of lens)``; None, None once that lens failed (read when asked)."""
        if lens in self.handle.lens_errors:
            return None, None
        parts, reader = self.collector.parts, self.collector.lenses[lens]
        try:
            normed = parts.final_norm_fp32(at_n)
            transform = shared_transform(reader)
            if transform is None:
                return normed, reader.logits(layer, at_n)
            moved = transform(layer, at_n)  # the logit lens: x itself, its norm already taken
            return normed, parts.unembed_fp32(
                normed if moved is at_n else parts.final_norm_fp32(moved)
            )
        except Exception as exc:  # a plugin's lens fails its readers, not the capture
            self.handle.lens_errors[lens] = repr(exc)
            return None, None

    def _serve_whole_lens(self) -> None:
        """After x^L: the lens logits ``[B, L+1, V]`` of every state, to the reducers taking them.

        One read-out of every state's transformed rows per lens (`read_all`).
        """
        rows, self.rows_at_n = self.rows_at_n, []
        read: dict[str, torch.Tensor] = {}
        for name in [name for name in self.whole_lens if name in self.reducers]:
            lens = self.lens_of[name]
            if lens not in read and lens not in self.handle.lens_errors:
                try:
                    lens_object, parts = self.collector.lenses[lens], self.collector.parts
                    read[lens] = self._call(name, read_all, lens_object, parts, rows)
                except Exception as exc:  # a plugin's lens fails its readers, not the capture
                    self.handle.lens_errors[lens] = repr(exc)
            if lens not in read:
                continue
            try:
                self._call(name, self.reducers[name].update_lens, read[lens])
            except Exception as exc:  # a plugin's failure is its own
                self.handle.errors[name] = repr(exc)
                del self.reducers[name]

    def _attentions(self, layer: int, device, dtype) -> torch.Tensor | None:
        if not self.collector.attentions or layer == 0:
            return None
        weights = self.attentions.pop(layer, None)  # None: the module gave none
        if weights is None:
            return None
        width = self.handle.info.n_tokens  # causal: positions up to n attend to no later one
        return self._measured(weights)[..., :width, :width].to(device=device, dtype=dtype)

    def _measured(self, tensor: torch.Tensor) -> torch.Tensor:
        """The measured rows of a ``[B, ...]`` tensor of the forward (all rows: itself)."""
        if self.rows is None:
            return tensor
        return tensor.index_select(0, torch.tensor(self.rows, device=tensor.device))

    def _call(self, name: str, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)``, its wall seconds added to reducer ``name``'s (``handle.seconds``)."""
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            seconds = self.handle.seconds
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

    def finish(self) -> None:
        """Finalize every reducer of a complete forward and set the handle's states."""
        parts, info = self.collector.parts, self.handle.info
        self._serve_whole_lens()
        for name, reducer in self.reducers.items():
            try:
                self.handle.reduced[name] = self._call(name, reducer.finalize)
            except Exception as exc:  # a plugin's failure is its own
                self.handle.errors[name] = repr(exc)
        self.handle.states = GeometryStates(
            parts.n_layers,
            parts.d_model,
            parts.vocab_size,
            size=info.size,
            documents=info.documents,
        )


class StateCollector:
    """Serve one forward pass's states, layer by layer, to named reducers.

    Args:
        model: the causal LM the hooks attach to.
        parts: its located parts (:func:`~lm_coupling.model.architecture.locate_model_parts`).
        hidden_states: views carry the states ``[B, T, d]`` (need ``hidden_states``).
        lens: the lenses whose logits at n the views carry (need ``lens``): one
            lens, or ``{name: lens}`` side by side; None for none.
        attentions: views carry each block's attention probabilities (need
            ``attentions``; the model must run eager attention).

    Views live on the device of the first block's parameters, in float32
    (float64 for a float64 model).
    """

    def __init__(
        self,
        model: nn.Module,
        parts: ModelParts,
        *,
        hidden_states: bool = True,
        lens: Lens | Mapping[str, Lens] | None = None,
        attentions: bool = False,
    ) -> None:
        if not isinstance(parts, ModelParts):
            raise TypeError(f"parts must be ModelParts (from locate_model_parts), got {parts!r}")
        lenses = lens if isinstance(lens, Mapping) else {getattr(lens, "name", ""): lens}
        self.lenses = {name: one for name, one in lenses.items() if one is not None}
        for one in self.lenses.values():
            if not callable(getattr(one, "logits", None)):
                raise TypeError(f"lens must have a logits(layer, hidden) method, got {one!r}")
        self.model, self.parts = model, parts
        self.hidden_states, self.attentions = bool(hidden_states), bool(attentions)
        self.attention_modules = attention_modules(parts.blocks) if self.attentions else []
        first_param = next(parts.blocks[0].parameters(), None)
        self.device = first_param.device if first_param is not None else torch.device("cpu")

    @contextmanager
    def capture(
        self,
        last_index: Sequence[int] | torch.Tensor,
        first_index: Sequence[int] | torch.Tensor,
        target_tokens: Sequence[int] | torch.Tensor | None,
        reducers: Mapping[str, ReducerFactory],
        documents: Sequence[Sequence[DocumentRef]] | None = None,
        rows: Sequence[int] | torch.Tensor | None = None,
        lenses: Mapping[str, str] | None = None,
    ) -> Iterator[CaptureHandle]:
        """Capture the first model forward run inside the context (later ones pass untouched).

        Args:
            last_index: ``[B]`` position n of each row's last context token.
            first_index: ``[B]`` position of each row's first real token (the
                number of left pads), excluded from the token mask.
            target_tokens: ``[B]`` gold next token at n, -1 for none (or None).
            reducers: per name, ``factory(BatchInfo) -> LayerReducer | None``.
            documents: per row, the documents it measures (default: none).
            rows: the forward's rows to measure, increasing (default: every
                row); the arguments above then have one entry per measured row.
            lenses: per reducer name, the name of the lens its views read
                (default: the collector's first lens).

        Yields:
            A :class:`CaptureHandle`, filled once the forward's last block ran.

        Raises:
            ValueError: index shapes disagree, ``first_index > last_index``, or (in
                the forward) the batch size or length does not fit the indices.
        """
        last, first, target, docs, measured = _indices(
            last_index, first_index, target_tokens, documents, rows
        )
        handle = CaptureHandle()
        run = _Run(self, last, first, target, dict(reducers), docs, handle, measured, lenses)
        with self._hooks(run.pre_hook, run.post_hook, run.attention_hook):
            yield handle

    @contextmanager
    def _hooks(self, pre_hook, post_hook, attention_hook) -> Iterator[None]:
        """The hooks of one forward call, every handle removed on exit (also when it raises)."""
        hooks = []
        try:
            hooks.append(self.parts.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
            for layer, module in enumerate(self.attention_modules, start=1):
                hooks.append(module.register_forward_hook(partial(attention_hook, layer)))
            for layer, block in enumerate(self.parts.blocks, start=1):
                hooks.append(block.register_forward_hook(partial(post_hook, layer)))
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def capture_prompt(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        target_token: int = -1,
        reducers: Mapping[str, ReducerFactory] | None = None,
        documents: Sequence[Sequence[DocumentRef]] | None = None,
        lenses: Mapping[str, str] | None = None,
    ) -> CaptureHandle:
        """Capture one prompt alone, without padding (the reference route).

        The target position n is the last token ``T - 1``; the token mask covers
        positions 1..T-1.

        Args:
            input_ids: ``[T]`` token ids of the prompt.
            target_token: gold next token at n, -1 for none.
            reducers: as for :meth:`capture`.
            documents: as for :meth:`capture` (one row).
            lenses: as for :meth:`capture`.

        Returns:
            The :class:`CaptureHandle` of a batch of one.

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
        with (
            torch.no_grad(),
            self.capture([n], [0], [target_token], reducers or {}, documents, None, lenses) as h,
        ):
            ids = ids[None].to(device=self.parts.input_device, dtype=torch.int64)
            self.model(ids, use_cache=False)
        if h.states is None:
            raise LmCouplingError(
                "the forward pass did not run every decoder block through its hooks; "
                "check the model's override (register_override)"
            )
        return h


def _indices(
    last_index: Sequence[int] | torch.Tensor,
    first_index: Sequence[int] | torch.Tensor,
    target_tokens: Sequence[int] | torch.Tensor | None,
    documents: Sequence[Sequence[DocumentRef]] | None,
    rows: Sequence[int] | torch.Tensor | None,
) -> tuple[list[int], list[int], list[int], tuple, list[int] | None]:
    """The capture's indices as lists of ints, checked (``StateCollector.capture``)."""
    last = _as_list(last_index, "last_index")
    first = _as_list(first_index, "first_index")
    target = [-1] * len(last) if target_tokens is None else _as_list(target_tokens, "target_tokens")
    if not (len(last) == len(first) == len(target)):
        raise ValueError(
            f"last_index, first_index and target_tokens need one entry per document, got "
            f"lengths {len(last)}, {len(first)}, {len(target)}"
        )
    if any(not 0 <= f <= n for f, n in zip(first, last, strict=True)):
        raise ValueError(
            f"need 0 <= first_index <= last_index per row, got first_index={first} "
            f"last_index={last}"
        )
    docs = tuple(
        tuple(ref if type(ref) is DocumentRef else DocumentRef(*ref) for ref in row)
        for row in documents or ()
    )
    if docs and len(docs) != len(last):
        raise ValueError(
            f"documents must have one entry (possibly empty) per last_index entry, got "
            f"{len(docs)} for {len(last)}"
        )
    measured = None if rows is None else _as_list(rows, "rows")
    if measured is not None:
        if len(measured) != len(last) or any(
            b <= a for a, b in zip(measured, measured[1:], strict=False)
        ):
            raise ValueError(
                f"rows must be increasing, one per last_index entry, got {measured} "
                f"for {len(last)} entries"
            )
        if measured and measured[0] < 0:
            raise ValueError(f"rows must be non-negative, got {measured}")
    return last, first, target, docs, measured
