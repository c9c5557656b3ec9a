"""Timing, peak memory, machine load and the one table printer shared by the bench scripts.

The bench scripts run as ``python bench/<script>.py``, so this folder is on
``sys.path`` and they import this module as ``timing``.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def is_cuda(device: str) -> bool:
    """Whether ``device`` names a CUDA device."""
    return str(device).startswith("cuda")


def sync(device: str) -> None:
    """Wait for queued kernels on ``device`` (a no-op on CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``(fn(), wall seconds)``, synchronised on ``device`` before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def reset_peak(device: str) -> bool:
    """Start a new peak-memory window on ``device``; whether it could.

    CUDA: the allocator's peak statistics. CPU: the process's peak resident
    set (``VmHWM``, which ``ru_maxrss`` reads), reset by writing 5 to
    ``/proc/self/clear_refs`` (Linux); elsewhere the peak keeps counting from
    the process's start.
    """
    if is_cuda(device):
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def trim_heap() -> bool:
    """Hand the C heap's freed memory back to the system (glibc ``malloc_trim``); whether it could.

    The bench's own measurement hygiene between a warm-up and the timed run,
    never done by the package.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # no glibc (macOS, musl)
        return False
    trim(0)
    return True


def peak_mb(device: str) -> float:
    """Peak memory in MiB: CUDA ``max_memory_allocated`` or the process's peak RSS on CPU.

    On Linux the CPU peak is ``VmHWM`` of ``/proc/self/status``, the window
    :func:`reset_peak` restarts; ``ru_maxrss`` also keeps the peak an exited
    thread recorded before the reset, so it can stay above a new window's
    peak. Elsewhere, ``ru_maxrss``.
    """
    if is_cuda(device):
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_label(device: str) -> str:
    """What :func:`peak_mb` measures on ``device``."""
    return "peak GPU MiB" if is_cuda(device) else "peak RSS MiB"


def median(values: Sequence[float]) -> float:
    """Median of the finite values (NaN when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def machine_line(device: str) -> str:
    """The machine: device name, CPU threads and load averages (1, 5, 15 min)."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    name = torch.cuda.get_device_name() if is_cuda(device) else "CPU"
    return (
        f"machine: {name}; torch {torch.__version__}; {torch.get_num_threads()} threads of "
        f"{os.cpu_count()} cores; load average {load}"
    )


def fmt(value: Any, spec: str = ".3f") -> str:
    """A table cell: floats with ``spec`` (``.2e`` below 0.01), "-" for None, else text."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return format(value, ".2e" if 0 < abs(value) < 1e-2 else spec)
    return str(value)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a plain-text table: a title, a header, a rule and left-aligned first column.

    Cells are formatted with :func:`fmt`; every column is as wide as its widest cell.
    """
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]

    def join(row: Sequence[str]) -> str:
        return "  ".join(
            f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    line = join([str(h) for h in header])
    print(f"\n{title}")
    print(line)
    print("-" * len(line))
    for row in cells:
        print(join(row))
