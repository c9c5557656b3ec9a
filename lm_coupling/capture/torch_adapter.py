"""The one module that uses torch beyond its documented public API.

One use: a tensor's version counter (`write_count`), which lets a recording
keep a reference to a block's output during the forward pass instead of a
copy, and see whether anything wrote it in place meanwhile
(`lm_coupling.capture.recording.Recorder`).
``tests/capture/test_torch_contract.py`` checks it against the installed torch.
"""

from __future__ import annotations

import torch

__all__ = ["write_count"]


def write_count(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor``'s memory has had (through it or any view of it).

    Relies on: ``torch.Tensor._version``, the counter autograd keeps per
    storage view family and that every in-place operation increments (torch
    has no public name for it; it reads no tensor data and synchronises no
    device).
    """
    return tensor._version
