"""Each report figure rendered from known values, with layout properties that can fail."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from layout import layout_problems

from lm_coupling.catalogue import Catalogue
from lm_coupling.report import figures as fig
from lm_coupling.report.stats import MIN_MODELS, correlations


def _profiles(n_layers: int) -> dict:
    states = np.linspace(0, 1, n_layers + 1)
    entropy = 0.9 - 0.5 / (1 + np.exp(-12 * (states - 0.5)))
    out = {
        "norm": np.exp(1 + states),
        "windowed_lss": 1.5 + 0.1 * np.arange(n_layers),
        "logit_lens_entropy": entropy,
        "tv_to_target": np.clip(entropy + 0.05, 0, 1),
    }
    return {k: dict(mean=v.tolist(), stderr=[0.01] * len(v)) for k, v in out.items()}


def _matrix(n: int) -> np.ndarray:
    """Off-diagonal values in [0.2, 0.6]; a diagonal of 1 that must not set the colour scale."""
    matrix = 0.2 + 0.4 * np.arange(n * n).reshape(n, n) / (n * n)
    np.fill_diagonal(matrix, 1.0)
    return matrix


def _tick_values(axis) -> list[float]:
    low, high = sorted(axis.get_view_interval())
    return [t for t in axis.get_majorticklocs() if low <= t <= high]


@pytest.mark.parametrize("n_layers", [4, 12])
def test_profiles_figure_layers_titles_and_window(n_layers):
    title = "fam/tiny @ step8, task lmc_arc_challenge_offline"
    figure = fig.profiles_figure(_profiles(n_layers), n_layers, title)
    figure.canvas.draw()
    assert layout_problems(figure) == []
    suptitle = figure.get_suptitle()
    assert "fam/tiny" in suptitle and "lmc_arc_challenge_offline" in suptitle
    titles = [ax.get_title() for ax in figure.axes]
    windowed = any("windowed LSS" in t for t in titles)
    window = Catalogue.installed().profile("windowed_lss").min_blocks
    assert window == 11
    assert windowed == (n_layers >= window)
    omitted = f"windowed LSS (11 layers) omitted: {n_layers} blocks < its minimum of {window}"
    assert (omitted in suptitle) == (n_layers < window)
    for ax in figure.axes:
        assert ax.lines, "empty panel"
        ticks = _tick_values(ax.xaxis)
        assert ticks and all(float(t).is_integer() for t in ticks)
        first = 1 if "windowed" in ax.get_title() else 0
        assert min(ticks) >= first and max(ticks) <= n_layers
        if n_layers <= 12 and first == 0 and n_layers < 12:
            assert ticks == list(range(0, n_layers + 1))
        assert ax.yaxis.get_offset_text().get_text() == ""  # no "1e-5+9.99e-1" over the title


@pytest.mark.parametrize("n_layers", [2, 6, 24])
def test_coupling_figure_blocks_one_to_l_and_offdiagonal_colour_scale(n_layers):
    matrix = _matrix(n_layers)
    figure = fig.coupling_figure(matrix.tolist(), 10, "gpt2-small, task winogrande")
    figure.canvas.draw()
    assert layout_problems(figure) == []
    heat = figure.axes[0]
    assert "winogrande" in figure.get_suptitle() and "K = 10" in heat.get_title()
    image = heat.get_images()[0]
    off = matrix[~np.eye(n_layers, dtype=bool)]
    assert image.get_clim() == pytest.approx((off.min(), off.max()))
    assert np.ma.getmaskarray(image.get_array()).diagonal().all()
    for axis in (heat.xaxis, heat.yaxis):
        ticks = _tick_values(axis)
        assert all(float(t).is_integer() for t in ticks)
        assert min(ticks) >= 1 and max(ticks) <= n_layers


def _board(n: int, outlier: bool = False) -> pd.DataFrame:
    x = np.linspace(0.5, 1.5, n)
    if outlier:
        x[0] = 3.7e5  # expodistance at initialisation against values near 1
    rows = dict(
        model=["fam/tiny"] * n,
        revision=[f"step{2**i if i else 0}" for i in range(n)],
        expodistance=x,
        average=np.linspace(0.2, 0.6, n) + 0.01 * np.sin(np.arange(n)),
    )
    return pd.DataFrame(rows)


def test_metric_vs_score_below_minimum_prints_no_p_value():
    board = _board(MIN_MODELS - 1)
    row = correlations(board, ["expodistance"], ["average"], "expodistance").iloc[0]
    assert math.isnan(row["p_hc3"]) and math.isnan(row["p_holm"]) and "fewer than" in row["reason"]
    ax = fig.metric_vs_score(board, "expodistance", "average", fit=row, tasks="7 task(s)")
    ax.figure.canvas.draw()
    assert "p (HC3)" not in ax.get_title() and "no fit" in ax.get_title()
    assert not [line for line in ax.get_lines() if line.get_label() == "OLS"]


def test_metric_vs_score_flags_influence_log_axis_and_labels_do_not_overlap():
    board = _board(12, outlier=True)
    row = correlations(board, ["expodistance"], ["average"], "expodistance").iloc[0]
    assert row["influential"] and row["x_log_scale"]
    assert row["cooks_d_model"] == "fam/tiny@step0"
    ax = fig.metric_vs_score(board, "expodistance", "average", fit=row, tasks="7 task(s)")
    figure = ax.figure
    figure.canvas.draw()
    assert layout_problems(figure) == []
    assert ax.get_xscale() == "log"
    assert "p (HC3)" in ax.get_title() and "7 task(s)" in ax.get_title()
    legend = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "influential" in legend and "Cook's D" in legend
    notes = [t for t in ax.texts if t.get_text().isdigit()]
    assert len(notes) >= 8  # most points get their step; the rest are counted, never overlapped
    frame = ax.get_window_extent()
    for note in notes:
        box = note.get_window_extent()
        assert frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)


def test_training_dynamics_has_no_empty_panel():
    board = _board(6).assign(lss=np.linspace(2, 1, 6))
    axes = fig.training_dynamics(board, ["expodistance", "lss"], "average")
    figure = axes[0][0].figure
    figure.canvas.draw()
    assert layout_problems(figure) == []
    for ax in axes.ravel():
        assert ax.lines or ax.get_legend() is not None


def test_bounded_profiles_use_the_unit_axis_and_say_when_flat():
    profiles = _profiles(4)
    flat = [0.9986, 0.99859, 0.99858, 0.99855, 0.99853]  # a random model's entropy
    profiles["logit_lens_entropy"] = dict(mean=flat, stderr=[1e-6] * 5)
    figure = fig.profiles_figure(profiles, 4, "random model, task t")
    figure.canvas.draw()
    assert layout_problems(figure) == []
    axes = {ax.get_title(): ax for ax in figure.axes}
    entropy, tv = axes["logit-lens entropy H/ln V"], axes["TV to target"]
    for ax in (entropy, tv):
        low, high = ax.get_ylim()
        assert low <= 0.0 and high >= 1.0 and high - low < 1.1
    notes = [t.get_text() for t in entropy.texts]
    assert notes == ["flat: 0.99853-0.9986"]
    assert not [t for t in tv.texts if t.get_text().startswith("flat")]  # spans 0.45-0.95
    norm = axes["norm ||x^l||"]
    assert norm.get_ylim()[0] > 2.0  # the norm (e to e^2) keeps its own scale


def test_coupling_figure_says_how_far_it_zooms():
    matrix = _matrix(4)
    figure = fig.coupling_figure(matrix.tolist(), 10, "m, task t")
    heat, bar = figure.axes  # the heatmap and its colour bar
    assert "directed" in heat.get_title()
    off = matrix[~np.eye(4, dtype=bool)]
    share = f"{100 * (off.max() - off.min()):.2g}% of [0, 1]"
    assert "zoomed" in bar.get_ylabel() and share in bar.get_ylabel()


def test_metric_vs_score_labels_zoomed_unit_axes():
    board = pd.DataFrame(
        dict(
            model=[f"m{i}" for i in range(6)],
            revision=["main"] * 6,
            coupling_k10=np.linspace(0.6, 0.7, 6),
            lss=np.linspace(1.5, 2.5, 6),
            average=np.linspace(0.3, 0.5, 6),
        )
    )
    ax = fig.metric_vs_score(board, "coupling_k10", "average")
    assert "zoomed" in ax.get_xlabel() and "zoomed" in ax.get_ylabel()
    ax = fig.metric_vs_score(board, "lss", "average")
    assert "zoomed" not in ax.get_xlabel()  # LSS is not a [0, 1] quantity


def test_a_fit_that_is_not_significant_is_drawn_dashed_and_zoom_is_stated():
    rng = np.random.default_rng(1)
    board = pd.DataFrame(
        dict(
            model=[f"m{i}" for i in range(8)],
            revision=["main"] * 8,
            lss=np.linspace(1.5, 2.5, 8),
            average=0.25 + 0.012 * rng.random(8),  # noise within 1.2 points
        )
    )
    row = correlations(board, ["lss"], ["average"], "lss").iloc[0]
    assert row["p_holm"] >= 0.05
    ax = fig.metric_vs_score(board, "lss", "average", fit=row)
    ax.figure.canvas.draw()
    line = next(line for line in ax.get_lines() if "OLS" in line.get_label())
    assert "n.s." in line.get_label() and line.get_linestyle() == "--"
    assert line.get_color() == "grey"
    assert "(n.s.)" in ax.get_title()
    low, high = ax.get_ylim()
    assert f"y-axis spans {100 * (high - low):.2g} of 100 points" in ax.get_title()
    assert "x-axis" not in ax.get_title()  # LSS is not a [0, 1] quantity: nothing to zoom
    assert layout_problems(ax.figure) == []
    strong = board.assign(average=0.2 + 0.1 * board["lss"])
    row = correlations(strong, ["lss"], ["average"], "lss").iloc[0]
    ax = fig.metric_vs_score(strong, "lss", "average", fit=row)
    line = next(line for line in ax.get_lines() if line.get_label() == "OLS")
    assert line.get_linestyle() == "-" and "n.s." not in ax.get_title()


def test_training_dynamics_says_no_p_value_and_how_far_it_zooms():
    board = _board(6).assign(average=0.25 + 0.002 * np.arange(6))
    axes = fig.training_dynamics(board, ["expodistance"], "average")
    title = axes[0][0].get_title()
    low, high = axes[0][0].get_ylim()
    assert f"y-axis spans {100 * (high - low):.2g} of 100 points" in title
    suptitle = axes[0][0].figure.get_suptitle()
    assert "not independent" in suptitle and "no fit or p-value" in suptitle
    assert layout_problems(axes[0][0].figure) == []
