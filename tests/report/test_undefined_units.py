"""A unit left out because its value is undefined on a model is not called missing."""

from __future__ import annotations

import math

import pandas as pd

from lm_coupling.report.build import task_set_notes
from lm_coupling.report.tasksets import geometry_table


def _long(rows):
    return pd.DataFrame(
        [
            {"model": m, "revision": "main", "dtype": "float32", "metric": metric, "unit": u,
             "value": v, "n": 4.0, "k_used": math.nan}
            for m, metric, u, v in rows
        ]
    )  # fmt: skip


def test_undefined_and_missing_units_are_told_apart():
    long = _long(
        [
            ("a", "thought_fixation_boundary", "arc", 0.5),
            ("b", "thought_fixation_boundary", "arc", math.nan),  # measured, undefined
            ("a", "thought_fixation_boundary", "wino", 0.4),
            ("b", "thought_fixation_boundary", "wino", 0.6),
            ("a", "lss", "arc", 3.0),
            ("b", "lss", "arc", 3.5),
            ("a", "lss", "gsm8k", 4.0),  # b never ran gsm8k
        ]
    )
    wide, sets = geometry_table(long)
    assert sets.dropped == {"thought_fixation_boundary": ["arc"], "lss": ["gsm8k"]}
    assert sets.undefined == {"thought_fixation_boundary": ["arc"]}
    notes = task_set_notes(wide.reset_index(), sets, [])
    boundary = next(n for n in notes if n.startswith("thought_fixation_boundary"))
    assert "undefined (NaN) on some models" in boundary and "only some models" not in boundary
    lss = next(n for n in notes if n.startswith("lss"))
    assert "only some models have them: gsm8k" in lss and "undefined" not in lss
    assert wide.loc[("b", "main", "float32"), "thought_fixation_boundary"] == 0.6
