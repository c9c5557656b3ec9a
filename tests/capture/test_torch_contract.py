"""Contract test: the torch internal that capture/torch_adapter.py relies on.

A recording keeps a reference to each state of a small forward and trusts it
only if nothing wrote it in place since its hook read it (`write_count`).
"""

from __future__ import annotations

import torch

from lm_coupling.capture.torch_adapter import write_count


def test_write_count_moves_with_every_in_place_write_and_only_then():
    state = torch.randn(2, 3, 4)
    before = write_count(state)
    _ = state + 1, state.index_select(0, torch.tensor([1])), state.clone()
    assert write_count(state) == before  # reading, copying: no write
    state.mul_(1.0)  # a write that changes no value still counts
    assert write_count(state) == before + 1
    state[:, :1].add_(2.0)  # through a view of it
    assert write_count(state) == before + 2
    view = state[1]
    view.zero_()
    assert write_count(state) == write_count(view) == before + 3


def test_write_count_is_read_without_a_copy_under_no_grad():
    with torch.no_grad():
        state = torch.ones(4, 5)
        count = write_count(state)
        state.add_(1.0)
    assert isinstance(count, int) and write_count(state) == count + 1
