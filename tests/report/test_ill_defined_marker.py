"""The coupling heatmap marks the blocks whose top-K subspace the engine flags ill-defined."""

from __future__ import annotations

import numpy as np
import torch

from lm_coupling.metrics.coupling import largest_gap_k, spectral_gap
from lm_coupling.report import figures as fig
from lm_coupling.report.ill_defined import mark_ill_defined


def test_flagged_blocks_are_marked_and_the_note_gives_their_gaps():
    figure = fig.coupling_figure(np.random.rand(4, 4).tolist(), 2, "t")
    ax = figure.axes[0]
    lines = len(ax.lines)
    assert mark_ill_defined(ax, [True, False, None, True], [1.01, 2.0, None, 1.03]) == 2
    assert len(ax.lines) == lines + 2  # one row marker set, one column marker set
    (note,) = [t.get_text() for t in ax.texts if "ill-defined" in t.get_text()]
    assert "2 of 4 blocks" in note and "1.010-1.030" in note
    assert mark_ill_defined(ax, [False] * 4) == 0 and mark_ill_defined(ax, None) == 0


def test_largest_gap_k_maximises_the_worst_blocks_gap():
    S = torch.tensor(
        [[10.0, 9.0, 3.0, 2.9, 1.0, 0.5], [8.0, 7.9, 7.8, 2.0, 1.9, 1.0]]
    )  # gaps at K = 1..5: block 0: 1.11, 3, 1.03, 2.9, 2; block 1: 1.01, 1.01, 3.9, 1.05, 1.9
    worst = torch.stack([spectral_gap(S, k).amin() for k in range(1, 6)])
    assert largest_gap_k(S, 1, 5) == 1 + int(worst.argmax()) == 5
    assert largest_gap_k(S, 2, 4) == 4  # min(2.9, 1.05) beats min(3, 1.01) and min(1.03, 3.9)
