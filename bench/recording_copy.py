"""The two ways a recording copies its referenced states, timed on the same states.

When block L has run, a `Recorder` that referenced the forward's states copies
the measured rows of all of them (`lm_coupling.capture.recording`): a forward
up to `STACK_FIRST_BYTES` is stacked whole and its measured rows selected
after; a larger one has each state's measured rows copied straight into the
recording. This script times both routes of the package's own code on the
same random states at several shapes (the route is chosen by setting the
threshold), checks that they give equal tensors, and prints the ratio per
shape with the route the threshold picks, so the threshold can be re-checked
on another machine.

In a recording the copy runs after the forward's other work has pushed the
states out of the core's caches (timed after a real forward of the bundled
model, session 19: the first copy 70 µs, the same copy again 27 µs, in a loop
18 µs). ``--cold`` times that case: before each copy a scratch buffer of
`COLD_SCRATCH_BYTES` is written (the caches then hold it, not the states);
without it every copy after the first finds the states in cache.

Run: ``python bench/recording_copy.py [--repeats 5] [--threads 1] [--cold]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch
from timing import machine_line, print_table

import lm_coupling.capture.recording as recording_module
from lm_coupling.capture.recording import Recorder, Recording

SHAPES = [  # (rows B, positions T, width d, blocks L, measured rows)
    (8, 27, 64, 4, (1, 5)),  # the bundled model on the synthetic ARC items (median T)
    (8, 48, 64, 4, (1, 5)),
    (8, 64, 64, 4, (1, 5)),
    (8, 200, 64, 4, (0, 3, 6)),
    (8, 8, 768, 12, (1, 5)),  # GPT-2-small shape, short batches (still referenced)
    (8, 20, 768, 12, (1, 5)),
    (32, 60, 256, 8, (0, 9, 17, 30)),
]


def _recorder(shape: tuple) -> tuple[Recorder, list[torch.Tensor]]:
    batch, n_tokens, width, n_layers, rows = shape
    last = [n_tokens - 3] * len(rows)
    recording = Recording(last, [0] * len(rows), [-1] * len(rows), ((),) * len(rows))
    recorder = Recorder(recording, n_layers, list(rows), whole_rows=True)
    recorder.width = n_tokens - 2  # the positions up to the last n
    states = [torch.randn(batch, n_tokens, width) for _ in range(n_layers + 1)]
    return recorder, states


@contextlib.contextmanager
def _threshold(value: int) -> Iterator[None]:
    """``STACK_FIRST_BYTES = value`` inside the context (the route every copy then takes)."""
    saved = recording_module.STACK_FIRST_BYTES
    recording_module.STACK_FIRST_BYTES = value
    try:
        yield
    finally:
        recording_module.STACK_FIRST_BYTES = saved


COLD_SCRATCH_BYTES = 32 * 2**20
"""Bytes written between copies with ``--cold`` (more than a server core's L2 and its L3 share)."""


def _time(
    recorder: Recorder,
    states: list[torch.Tensor],
    threshold: int,
    repeats: int,
    scratch: torch.Tensor | None = None,
) -> float:
    """Median µs per copy with ``STACK_FIRST_BYTES = threshold``.

    With ``scratch``, it is written before each copy (outside the timing), so
    that every copy reads its states from memory, not from cache.
    """
    calls = max(20, 20000 // max(1, sum(s.numel() for s in states) // 4096))
    if scratch is not None:
        calls = max(20, calls // 20)  # each copy pays a sweep of the scratch buffer
    samples = []
    with _threshold(threshold):
        for _ in range(repeats):
            elapsed = 0.0
            for _ in range(calls):
                if scratch is not None:
                    scratch.add_(1.0)
                start = time.perf_counter()
                recorder._measured_stack(states)
                elapsed += time.perf_counter() - start
            samples.append(elapsed / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--cold", action="store_true", help="evict the states from cache before each copy"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scratch = torch.zeros(COLD_SCRATCH_BYTES // 4) if args.cold else None
    whole, into_place = 2**62, 0
    rows = []
    for shape in SHAPES:
        recorder, states = _recorder(shape)
        with _threshold(whole):
            expected = recorder._measured_stack(states)
        with _threshold(into_place):
            placed = recorder._measured_stack(states)
        if not torch.equal(expected, placed):
            raise RuntimeError(f"the two routes differ at shape {shape}: the bench is broken")
        stacked_us = _time(recorder, states, whole, args.repeats, scratch)
        placed_us = _time(recorder, states, into_place, args.repeats, scratch)
        nbytes = len(states) * states[0].nbytes
        chosen = "stack" if recording_module.stacks_whole(nbytes) else "into place"
        batch, n_tokens, width, n_layers, measured = shape
        rows.append((f"B{batch} T{n_tokens} d{width} L{n_layers} b{len(measured)}", nbytes / 2**10,
                     stacked_us, placed_us, stacked_us / placed_us, chosen))  # fmt: skip
    print(machine_line("cpu"))
    print(f"STACK_FIRST_BYTES = {recording_module.STACK_FIRST_BYTES // 2**10} KiB; "
          f"median of {args.repeats} repeats; {args.threads} thread(s); "
          + ("states evicted from cache before each copy (--cold)" if args.cold
             else "states in cache (a loop of copies)"))  # fmt: skip
    header = ("shape", "states KiB", "stack whole µs", "into place µs", "stack / into", "route")
    print_table("copying a recording's referenced states", header, rows)


if __name__ == "__main__":
    main()
