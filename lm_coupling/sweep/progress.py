"""One progress line per model over the whole sweep, with the time left.

lm-eval's own bars (one model's requests) run in the model's process below;
these lines, on stderr, frame them: ``[sweep |######..............| 3/12 | 2 done, 0 failed, 1
complete | 4m10s elapsed, ~13m left] gpt2@main: running 2 tasks``. The time
left is the mean wall time of the models run so far times the models still
to run (models found complete cost nothing).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

BAR_WIDTH = 20


class SweepProgress:
    """Counts and the time estimate of a sweep over ``total`` models."""

    def __init__(self, total: int, to_run: int, stream: TextIO | None = None):
        self.total = total
        self.to_run = to_run
        self.stream = stream if stream is not None else sys.stderr
        self.position = 0
        self.counts = {"done": 0, "failed": 0, "complete": 0}
        self.run_seconds: list[float] = []
        self.start = time.monotonic()

    def eta(self) -> float | None:
        """Seconds left (None before the first model has run)."""
        if not self.run_seconds:
            return None
        left = self.to_run - len(self.run_seconds)
        return max(left, 0) * sum(self.run_seconds) / len(self.run_seconds)

    def _prefix(self) -> str:
        elapsed = tqdm.format_interval(time.monotonic() - self.start)
        eta = self.eta()
        left = "?" if eta is None else tqdm.format_interval(eta)
        counts = ", ".join(f"{n} {k}" for k, n in self.counts.items())
        finished = sum(self.counts.values())
        filled = round(BAR_WIDTH * finished / max(self.total, 1))
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return (
            f"[sweep |{bar}| {self.position}/{self.total} | {counts} | "
            f"{elapsed} elapsed, ~{left} left]"
        )

    def line(self, label: str, message: str) -> None:
        """Print one status line for a model."""
        print(f"{self._prefix()} {label}: {message}", file=self.stream, flush=True)

    def begin(self, label: str, message: str) -> None:
        """A model starts (or is found complete)."""
        self.position += 1
        self.line(label, message)

    def end(self, label: str, status: str, seconds: float, ran: bool = True) -> None:
        """A model ends with ``status`` (done, failed or complete)."""
        self.counts[status] = self.counts.get(status, 0) + 1
        if ran:
            self.run_seconds.append(seconds)
        self.line(label, f"{status} ({tqdm.format_interval(seconds)})")
