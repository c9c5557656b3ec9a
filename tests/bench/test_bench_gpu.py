"""``python bench/gpu.py --device cpu --quick`` runs end to end and prints its whole table.

The script runs as a user would run it (a subprocess in the checkout); the test
checks the table's rows and that the printed ratios are finite and positive,
never the timings themselves.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LM_CONFIGS = ("plain", "traj_lens", "all")


def _table(stdout: str) -> dict[str, list[str]]:
    """Rows of the printed table by label: cells split on runs of two or more spaces."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("bench/gpu.py on "))
    rows = {}
    for line in lines[start + 3 :]:
        if line.startswith("machine:") or not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


def _header_list(stdout: str, name: str) -> list[str]:
    """A ``name=[...]`` list from the engine's header line."""
    found = re.search(rf"{name}=\[([^\]]*)\]", stdout)
    assert found, f"no {name}=[...] in the output"
    return [item.strip(" '") for item in found.group(1).split(",")]


@pytest.fixture(scope="module")
def quick_run() -> str:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "bench/gpu.py", "--device", "cpu", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard only: about a minute on a quiet 2-core machine
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_engine_rows_cover_every_route_and_k(quick_run):
    from lm_coupling.jacobian import engine as jacobian

    rows = _table(quick_run)
    routes = _header_list(quick_run, "routes")
    assert set(routes) >= set(getattr(jacobian, "METHODS", ("auto", "dense", "gram")))
    ks = _header_list(quick_run, "K")
    assert len(ks) == 2
    for k in ks:
        for route in routes:
            seconds, *_, engine_mb, _routes, diff = rows[f"engine {route} K={k}"]
            assert math.isfinite(float(seconds)) and float(seconds) > 0
            assert math.isfinite(float(engine_mb)) and float(engine_mb) > 0
            assert math.isfinite(float(diff))
        assert float(rows[f"engine dense K={k}"][-1]) == 0.0
    batched = [label for label in rows if "batched" in label]
    assert len(batched) == 1
    seconds, *_, diff = rows[batched[0]]
    assert float(seconds) > 0
    assert float(diff) < 1e-4  # a batched document's matrix equals its one-at-a-time matrix
    authors = [label for label in rows if label.startswith("authors' route")]
    assert len(authors) == 1 and float(rows[authors[0]][0]) > 0


@pytest.mark.slow
def test_lmeval_rows_have_finite_ratios_and_count_coupled_documents(quick_run):
    rows = _table(quick_run)
    for batch in ("8", "auto"):
        for name in LM_CONFIGS:
            seconds, ratio, peak, mem_ratio, *_, batch_info, _ = rows[f"lm-eval {name} bs={batch}"]
            for value in (seconds, ratio, peak, mem_ratio):
                assert math.isfinite(float(value)) and float(value) > 0
            coupled = int(re.search(r"coupled (\d+)", batch_info).group(1))
            # --quick: lmc_arc_easy_offline, 2 documents, coupling_docs=all for "all"
            assert coupled == (2 if name == "all" else 0)
        assert float(rows[f"lm-eval plain bs={batch}"][1]) == 1.0


@pytest.mark.slow
def test_jlens_fit_rows_agree_with_the_naive_route(quick_run):
    rows = _table(quick_run)
    seconds, *_, diff = rows["J-lens fit engine, 1 doc (max|dJ| vs naive)"]
    assert float(seconds) > 0
    assert float(diff) < 1e-4  # the engine's J_l equals the whole-sequence backward rows
    (naive,) = [cells for label, cells in rows.items() if label.startswith("J-lens fit naive")]
    speed_up = float(naive[1])
    assert math.isfinite(speed_up) and speed_up > 0
