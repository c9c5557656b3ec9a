"""The report's token-wise heatmaps from geometry-file records (no model, no torch)."""

from __future__ import annotations

import numpy as np

from lm_coupling.report.tokenwise import tokenwise_figure, tokenwise_matrix, with_tokenwise


def geometry(task: str, section: str = "matrices", identity=("m", "main", "float32")):
    rng = np.random.default_rng(0)
    return {
        "task": task,
        "identity": identity,
        section: {
            "tokenwise_self_coupling": {"mean": rng.uniform(size=(6, 6)).tolist(), "n": 2},
            "tokenwise_context_fixed_output": {"mean": rng.uniform(size=(2, 3, 3)).tolist()},
        },
        "tokenwise": {"blocks": [0, -1], "positions": ["n-2", "n-1", "n"], "fixed_input": "n-2"},
    }


def test_one_panel_for_self_coupling_and_one_per_block_and_context():
    ax = tokenwise_figure(geometry("hellaswag"), "m main")
    axes = [a for a in ax.figure.axes if a.get_images()]
    assert len(axes) == 1 + 2  # self-coupling, then fixed output for blocks 0 and -1
    assert [t.get_text() for t in axes[0].get_xticklabels()][:3] == ["b0 n-2", "b0 n-1", "b0 n"]
    np.testing.assert_allclose(
        axes[0].get_images()[0].get_array(),
        np.asarray(geometry("hellaswag")["matrices"]["tokenwise_self_coupling"]["mean"]),
    )
    assert "J^-1" in axes[2].get_title()


def test_matrices_are_read_from_either_section_and_files_without_them_are_left_out():
    assert tokenwise_matrix(geometry("t", "profiles"), "tokenwise_self_coupling").shape == (6, 6)
    plain = {"task": "a", "identity": ("m", "main", "float32"), "matrices": {"coupling": {}}}
    chosen = with_tokenwise([geometry("b"), plain, geometry("c", identity=("o", "x", "y"))])
    assert {k: v["task"] for k, v in chosen.items()} == {
        ("m", "main", "float32"): "b",
        ("o", "x", "y"): "c",
    }
    assert tokenwise_figure(plain, "none") is None
