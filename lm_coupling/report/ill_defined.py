"""A marker on the coupling heatmap for blocks whose top-K subspace is ill-defined.

When ``s_K / s_{K+1}`` of block l' is close to 1, its top-K singular vectors
are not pinned down (a 1% perturbation of ``s_K`` may turn the subspace by
``0.01 / (1 - s_{K+1} / s_K)``, Wedin's bound), nor the coupling values that
read them. The coupling plugin flags such blocks (``coupling.ill_defined``,
docs/metrics.md); the report marks them on both axes of the heatmap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.axes import Axes

MARK = "tab:red"


def mark_ill_defined(
    ax: Axes, flags: Sequence[bool | None] | None, gaps: Sequence[float | None] | None = None
) -> int:
    """Mark the flagged blocks (1..L) beside a heatmap's rows and above its columns.

    ``flags``: per block, whether its top-K subspace is ill-defined; ``gaps``:
    per block, ``s_K / s_{K+1}`` (their range is printed). Returns the count marked.
    """
    blocks = [i + 1 for i, flag in enumerate(flags or ()) if flag]
    if not blocks:
        return 0
    n = len(flags)
    ax.plot([0.5 - 0.02 * n] * len(blocks), blocks, ">", color=MARK, ms=4, clip_on=False)
    ax.plot(blocks, [0.5 - 0.02 * n] * len(blocks), "v", color=MARK, ms=4, clip_on=False)
    marked = [gaps[b - 1] for b in blocks if gaps and gaps[b - 1] is not None]
    marked = [g for g in marked if math.isfinite(g)]
    span = f"; s_K/s_K+1 {min(marked):.3f}-{max(marked):.3f}" if marked else ""
    ax.text(
        0.0, -0.16, f"red marks: {len(blocks)} of {n} blocks with an ill-defined top-K "
        f"subspace{span}", transform=ax.transAxes, fontsize=7, color=MARK,
    )  # fmt: skip
    return len(blocks)
