"""Figure functions drawn from small leaderboards whose values are known."""

from __future__ import annotations

import numpy as np
import pandas as pd

from lm_coupling.report.benchmarks import AVERAGE
from lm_coupling.report.figures import training_dynamics


def _family_board() -> pd.DataFrame:
    rows = []
    for model, scale in (("fam/tiny", 1.0), ("fam/small", 2.0)):
        # Revisions out of order on purpose: lines must follow the step, not the row order.
        for step in (64, 0, 8, 1):
            rows.append(
                {
                    "model": model,
                    "revision": f"step{step}",
                    AVERAGE: 0.25 + 0.001 * step * scale,
                    "coupling": 0.5 + 0.004 * step,
                    "lss": 2.0 - 0.01 * step,
                    "expodistance": 1e4 / (1 + step) ** 2,
                }
            )
    rows.append({"model": "other", "revision": "main", AVERAGE: 0.9, "coupling": 0.1})
    return pd.DataFrame(rows)


def test_training_dynamics_draws_each_model_in_step_order():
    board = _family_board()
    axes = training_dynamics(board, ["coupling", "lss", "expodistance"], AVERAGE)
    assert axes.shape == (2, 4)
    steps = [0, 1, 8, 64]
    for ax, column in zip(axes[0], [AVERAGE, "coupling", "lss", "expodistance"], strict=True):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"tiny", "small"}  # "other" has no step revision
        for model in ("tiny", "small"):
            expected = (
                board[board["model"] == f"fam/{model}"]
                .assign(s=lambda d: d["revision"].str[4:].astype(int))
                .sort_values("s")[column]
            )
            np.testing.assert_array_equal(lines[model].get_xdata(), steps)
            np.testing.assert_allclose(lines[model].get_ydata(), expected.to_numpy())
        assert ax.get_xscale() == "symlog"  # step 0 stays on the axis
    assert axes[0][3].get_yscale() == "log"  # expodistance spans four decades
    assert axes[0][1].get_yscale() == "linear"
    assert not axes[1][0].axison
    for ax, column in zip(axes[1][1:], ["coupling", "lss", "expodistance"], strict=True):
        tiny = next(line for line in ax.get_lines() if line.get_label() == "tiny")
        rows = board[board["model"] == "fam/tiny"].set_index("revision")
        order = [f"step{s}" for s in steps]
        np.testing.assert_allclose(tiny.get_xdata(), rows.loc[order, column])
        np.testing.assert_allclose(tiny.get_ydata(), rows.loc[order, AVERAGE])
    assert axes[1][3].get_xscale() == "log"


def test_a_long_score_column_label_is_wrapped_inside_the_figure():
    """``score:<task>:<metric>`` (a single-task run's score) plus its zoom note: both ends shown."""
    from lm_coupling.report.figures import metric_vs_score

    target = "score:lmc_arc_easy_offline:acc_norm"
    board = pd.DataFrame(
        {
            "model": [f"org/model-{i}" for i in range(6)],
            "revision": ["main"] * 6,
            "coupling_k4": [0.21, 0.28, 0.39, 0.44, 0.47, 0.25],
            target: [0.437, 0.446, 0.440, 0.451, 0.410, 0.457],
        }
    )
    ax = metric_vs_score(board, "coupling_k4", target, tasks="1 task(s)")
    figure = ax.figure
    figure.canvas.draw()
    label = ax.yaxis.label
    assert label.get_text().replace("\n", "").startswith(target)  # all of it, wrapped
    assert "zoomed: " in label.get_text() and "of [0, 1])" in label.get_text()
    box = label.get_window_extent()
    whole = figure.bbox
    assert whole.y0 <= box.y0 and box.y1 <= whole.y1, (box, whole)  # neither end cut off
    assert whole.x0 <= box.x0 and box.x1 <= whole.x1
    xbox = ax.xaxis.label.get_window_extent()
    assert whole.x0 <= xbox.x0 and xbox.x1 <= whole.x1


def test_wrap_label_breaks_after_separators_only():
    from lm_coupling.report.figures import wrap_label

    text = "score:lmc_arc_easy_offline:acc_norm (zoomed: 0.408-0.459, 5.1% of [0, 1])"
    lines = wrap_label(text, 40).split("\n")
    assert "".join(lines).replace(" ", "") == text.replace(" ", "")  # nothing lost
    assert all(len(line) <= 40 for line in lines)
    assert wrap_label("short", 40) == "short"


def test_metric_vs_score_without_a_revision_column_labels_every_model():
    # A leaderboard read back from a user's CSV may lack `revision`: each point is
    # then labelled by its model's short name (this raised IndexError before).
    from lm_coupling.report.figures import metric_vs_score

    board = pd.DataFrame(
        {
            "model": ["org/a", "org/b", "org/c"],
            "coupling": [0.1, 0.5, 0.9],
            AVERAGE: [0.3, 0.5, 0.7],
        }
    )
    ax = metric_vs_score(board, "coupling", AVERAGE)
    assert {"a", "b", "c"} <= {text.get_text() for text in ax.texts}
