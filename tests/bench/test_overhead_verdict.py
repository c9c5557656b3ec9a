"""The overhead bench's per-document verdict says when its rounds straddle the target."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def overhead():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("overhead")
    finally:
        sys.path.remove(str(BENCH))


def test_rounds_on_both_sides_of_the_target_are_called_noise(overhead):
    line = overhead.verdict_line(1.073, [1.040, 1.108])
    assert line.startswith("traj_lens MISSES the 1.05x")
    assert "rounds span 1.040-1.108, across the target" in line


@pytest.mark.parametrize(
    ("ratio", "rounds", "verdict"),
    [(1.02, [1.01, 1.03], "meets"), (1.09, [1.07, 1.11], "MISSES"), (1.02, [1.02], "meets")],
)
def test_rounds_on_one_side_give_a_plain_verdict(overhead, ratio, rounds, verdict):
    line = overhead.verdict_line(ratio, rounds)
    assert line == f"traj_lens {verdict} the 1.05x per-document CPU target ({ratio:.3f}x)"
