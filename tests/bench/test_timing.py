"""The benches' peak memory: a reset starts a new window (``bench/timing.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture
def timing(bench_module):
    return bench_module("timing")


def test_cpu_peak_counts_again_from_a_reset(timing):
    big = b"\x01" * (300 * 2**20)  # 300 MiB, every page written
    assert len(big) == 300 * 2**20
    high = timing.peak_mb("cpu")
    del big
    if not timing.reset_peak("cpu"):
        pytest.skip("this system cannot reset a process's peak resident set")
    low = timing.peak_mb("cpu")
    assert low < high - 250  # the freed 300 MiB no longer count
    resident = _resident_mb()  # the new window starts here (its peak cannot be below it)
    # 400 MiB: more than the freed 300 MiB the C heap may still hold resident and reuse
    again = b"\x01" * (400 * 2**20)
    assert timing.peak_mb("cpu") >= resident + 80  # and a new allocation does
    del again


def _resident_mb() -> float:
    """The process's resident set now (``VmRSS``), in MiB."""
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
