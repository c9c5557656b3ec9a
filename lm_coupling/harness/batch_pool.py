"""Reduce the measured rows of several benchmark batches together.

lm-eval scores a multiple-choice task in batches whose rows are mostly the
same documents' other answers: a batch of 8 requests measures two or three
documents. Reducing each batch alone costs a fixed few hundred small tensor
operations and plugin calls per batch, which is most of the geometry's
overhead where the forward pass is cheap (a small model, a GPU). A
`BatchPool` records each batch's measured rows (`GeometryRunner.record`) and
reduces the pooled batches as one (`GeometryRunner.replay`): once they hold
`POOL_BYTES` or `POOL_ROWS` rows, before a batch's sampled documents are
measured, and when lm-eval's ``loglikelihood`` or ``generate_until`` returns.
The values are those of reducing each batch alone (``capture.recording``);
only the moment they are stored changes.

A batch is reduced at once, as before, when its recording alone would pass
`POOL_BYTES` (a large model's batch: its forward pass hides the fixed cost),
or when a selected metric reads attention probabilities (not recorded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm_coupling.errors import LmCouplingError
from lm_coupling.harness.plan import GeometryKey

__all__ = ["POOL_BYTES", "POOL_ROWS", "BatchPool"]

POOL_BYTES = 2 * 2**20
"""Most bytes of recorded states a pool holds before it reduces them (2 MiB).

The reduction's own intermediates are a few times the pooled states (the
trajectory summaries' steps, unit steps and window sums): at 8 MiB the bundled
model's peak memory rose by about 70 MiB, at 2 MiB by about 15, while a pool
still joins about 50 of its documents."""

POOL_ROWS = 256
"""Most measured rows a pool holds before it reduces them."""


@dataclass(frozen=True)
class _Held:
    recording: Any  # capture.recording.Recording
    matches: tuple[tuple[int, GeometryKey], ...]  # (row of the recording, key)
    forward_seconds: float  # the forward pass's time per key


class BatchPool:
    """The recorded batches of one ``loglikelihood`` or ``generate_until`` call.

    Args:
        session: the run's `GeometrySession` (its runner records and replays;
            values are stored in it, failures recorded in it).
        budget_bytes: reduce once the held recordings hold this many bytes
            (default `POOL_BYTES`).
        max_rows: reduce once this many measured rows are held (default
            `POOL_ROWS`; 1 reduces every batch alone).
    """

    def __init__(
        self, session: Any, budget_bytes: int | None = None, max_rows: int | None = None
    ) -> None:
        self.session = session
        self.budget_bytes = POOL_BYTES if budget_bytes is None else int(budget_bytes)
        self.max_rows = POOL_ROWS if max_rows is None else int(max_rows)
        self.held: list[_Held] = []
        self.held_keys: set[GeometryKey] = set()
        self.nbytes = self.rows = 0

    def accepts(self, rows: int, n_tokens: int) -> bool:
        """Whether a batch of ``rows`` measured rows of ``n_tokens`` positions is recorded."""
        runner = self.session.runner
        return runner.can_record and runner.recording_bytes(rows, n_tokens) <= self.budget_bytes

    def holds(self, key: GeometryKey) -> bool:
        """Whether ``key``'s batch is recorded and not reduced yet."""
        return key in self.held_keys

    def add(
        self, recording: Any, matches: list[tuple[int, GeometryKey]], forward_seconds: float
    ) -> None:
        """Hold a batch's recording; reduce the held batches once they reach the budget.

        Args:
            recording: the batch's ``Recording``.
            matches: ``(row of the recording, key)`` of each key measured; keys
                sharing a row (duplicate prompts) each get their own copy.
            forward_seconds: the forward pass's time per key.

        Raises:
            LmCouplingError: the recording is incomplete (the forward did not
                run every block through the hooks) or was refused (its
                ``error``: a state written in place); nothing is held.
        """
        if recording.error is not None:
            raise LmCouplingError(recording.error)
        if not recording.complete:
            raise LmCouplingError(
                "the forward pass did not run every decoder block through its hooks; "
                "check the model's override (register_override)"
            )
        self.held.append(_Held(recording, tuple(matches), forward_seconds))
        self.held_keys.update(key for _, key in matches)
        self.nbytes += recording.nbytes
        self.rows += recording.size
        if self.nbytes >= self.budget_bytes or self.rows >= self.max_rows:
            self.flush()

    def close(self) -> None:
        """Drop the held batches unreduced and free the memory kept for reductions."""
        self.held, self.held_keys, self.nbytes, self.rows = [], set(), 0, 0
        runner = self.session.runner
        if runner is not None:
            runner.release_buffers()

    def flush(self) -> None:
        """Reduce every held batch as one and store its documents' values.

        A failure makes the held documents' values NaN (``session.fail``),
        never the benchmark's scores.
        """
        held, self.held = self.held, []
        self.held_keys, self.nbytes, self.rows = set(), 0, 0
        if not held:
            return
        session = self.session
        error = None
        try:
            handle = session.runner.replay([batch.recording for batch in held])
            documents = session.runner.compute(handle)
        except Exception as exc:  # geometry must never cost the benchmark its scores
            error = repr(exc)  # the text only: the traceback must not outlive this block
        if error is not None:
            session.fail([key for batch in held for _, key in batch.matches], error)
            return
        offset = 0
        measurements = []
        for batch in held:
            stored: set[int] = set()
            for row, key in batch.matches:
                document = documents[offset + row]
                document.timings["forward_capture"] = batch.forward_seconds
                # Keys sharing a row (duplicate prompts) each keep their own copy.
                measurements.append((key, document if row not in stored else document.copy()))
                stored.add(row)
            offset += batch.recording.size
        session.store_many(measurements, "in_batch")
