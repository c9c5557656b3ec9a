"""The benches' peak memory: a reset starts a new window (``bench/timing.py``)."""

from __future__ import annotations

import mmap

import numpy
import pytest


@pytest.fixture
def timing(bench_module):
    return bench_module("timing")


def test_cpu_peak_counts_again_from_a_reset(timing):
    # Fresh anonymous mappings, every page written: unlike a heap allocation, which a
    # long-lived worker's C heap may serve from memory it freed and still holds resident,
    # a new mapping has to grow the resident set, and unmapping it shrinks the set at once.
    big = _written_mapping(300)
    high = timing.peak_mb("cpu")
    big.close()
    if not timing.reset_peak("cpu"):
        pytest.skip("this system cannot reset a process's peak resident set")
    low = timing.peak_mb("cpu")
    assert low < high - 250  # the freed 300 MiB no longer count
    resident = _resident_mb()  # the new window starts here (its peak cannot be below it)
    again = _written_mapping(100)
    assert timing.peak_mb("cpu") >= resident + 80  # and a new allocation does
    again.close()


def _written_mapping(mib: int) -> mmap.mmap:
    """A new anonymous mapping of ``mib`` MiB with every page written."""
    mapping = mmap.mmap(-1, mib * 2**20)
    numpy.frombuffer(mapping, dtype=numpy.uint8)[:] = 1
    return mapping


def _resident_mb() -> float:
    """The process's resident set now (``VmRSS``), in MiB."""
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
