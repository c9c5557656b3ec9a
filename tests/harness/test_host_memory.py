"""`trim_host_memory` hands freed heap memory back (glibc), as the preflight checks need.

The checks' probes free their tensors at once, but the allocator keeps the
freed heap pages resident; the benchmark's peak would then stack on them.
The test frees most of a fragmented heap (small blocks, every hundredth kept)
and reads the resident size before and after the trim.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lm_coupling.harness.host_memory import trim_host_memory


def _resident_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_trim_returns_a_fragmented_heap_to_the_system():
    if not trim_host_memory():
        pytest.skip("this C library has no malloc_trim (not glibc)")
    blocks = [bytearray(1000) for _ in range(100_000)]  # ~100 MiB of heap blocks
    kept = blocks[::100]  # one block in a hundred pins its part of the heap
    del blocks
    before = _resident_mib()
    assert trim_host_memory()
    after = _resident_mib()
    assert before - after > 40, f"resident {before:.0f} MiB -> {after:.0f} MiB after the trim"
    assert len(kept) == 1000
