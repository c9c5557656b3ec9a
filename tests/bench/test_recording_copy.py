"""``python bench/recording_copy.py`` times both copy routes and checks they agree.

The script runs as a user would run it (a subprocess in the checkout); the
test reads the route each shape gets from `STACK_FIRST_BYTES` and the ratios'
sign and finiteness, never the timings themselves.
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


@pytest.mark.parametrize("cold", [False, True], ids=["in-cache", "cold"])
def test_each_shape_gets_the_route_of_its_size_and_both_routes_agree(cold):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [
            sys.executable,
            "bench/recording_copy.py",
            "--repeats",
            "1",
            *(["--cold"] if cold else []),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: seconds on a quiet 2-core machine
    )
    assert proc.returncode == 0, proc.stderr[-4000:]  # it raises when the routes differ
    lines = proc.stdout.splitlines()
    assert ("evicted from cache before each copy" in proc.stdout) is cold
    start = lines.index("copying a recording's referenced states") + 3
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[start:] if line.strip()]
    assert len(rows) == 7
    from lm_coupling.capture.recording import STACK_FIRST_BYTES

    for shape, kib, stacked_us, placed_us, ratio, route in rows:
        assert float(stacked_us) > 0 and float(placed_us) > 0 and math.isfinite(float(ratio))
        want = "stack" if float(kib) * 2**10 <= STACK_FIRST_BYTES else "into place"
        assert route == want, shape
    assert rows[0][-1] == "stack" and rows[-1][-1] == "into place"
