"""Hand the memory a one-off check freed back to the operating system.

The preflight checks (`preflight.check_model` when a run opens,
`preflight.check_first_batch` on its first batch) run probe forward passes
and Jacobian probes whose tensors are freed at once. glibc's allocator keeps
much of such freed memory resident in the process, so the benchmark's own
scoring peak later stacks on top of it: at GPT-2-small shape on CPU, about
100-250 MiB of peak resident memory that plain lm-eval does not have.
``malloc_trim(0)`` returns it. It is called once after each check, never
per batch (it walks the heap).
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["trim_host_memory"]


@functools.cache
def _malloc_trim():
    """The C library's ``malloc_trim`` (glibc), or None where it has none (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # the symbols the process already has
    except (OSError, AttributeError):
        return None


def trim_host_memory() -> bool:
    """Return freed heap memory to the operating system; whether the C library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
