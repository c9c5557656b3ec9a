"""The geometry work's progress line, beside lm-eval's own progress bar.

The Jacobian metrics of the sampled documents run inside lm-eval's "Running
loglikelihood requests" loop, whose estimate then jumps without saying why.
`GeometryProgress` draws one more ``tqdm`` line under lm-eval's bar (``position=1``,
so the two never overwrite each other): sampled documents measured out of
those planned, with tqdm's rate and time estimate, e.g.::

    Running loglikelihood requests:  40%|████      | 96/240 [00:31<00:47, 3.05it/s]
    lm-coupling coupling,alignment_ratio:  32%|███▏      | 8/25 [00:24<00:51, 3.0s/doc]
"""

from __future__ import annotations

import os
from typing import Any


class GeometryProgress:
    """A second progress line for the sampled (Jacobian) documents of a run.

    Args:
        label: what is measured (the sampled metrics' names).
        disable: draw nothing (data-parallel ranks other than 0).
    """

    def __init__(self, label: str, disable: bool = False):
        self.label = label
        self.disable = disable or int(os.environ.get("RANK", "0")) != 0
        self._bar: Any = None

    def plan(self, total: int) -> None:
        """Set how many documents will be measured (the bar opens on the first plan)."""
        if self.disable or total <= 0:
            return
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                desc=f"lm-coupling {self.label}",
                unit="doc",
                position=1,
                leave=False,
                dynamic_ncols=True,
            )
        elif total != self._bar.total:
            self._bar.total = total
            self._bar.refresh()

    def advance(self, n: int = 1) -> None:
        """``n`` more documents measured."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Close the line (lm-eval's bar stays where it is)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
