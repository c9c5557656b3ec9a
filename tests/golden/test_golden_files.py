"""Golden files: the results JSON and geometry files of one fixed run do not change.

The numbers and file formats are a contract with the report and with users'
own scripts. The golden run (`golden_run.py`) is rerun here through
`lm_coupling.evaluate`; every key must be present with the same value, floats
to round-off (rtol 1e-5: the Jacobian routes' float32 round-off), and no key may
appear or vanish except the volatile ones (`fixtures.outputs.VOLATILE`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fixtures.outputs import differences, written_files
from golden_run import HERE, golden_arguments

import lm_coupling

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def golden_output(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("golden")
    lm_coupling.evaluate(**golden_arguments(out))
    return written_files(out)


@pytest.mark.parametrize(
    "name", ["results", "geometry_lmc_arc_easy_offline", "geometry_lmc_gsm8k_offline"]
)
def test_file_equals_golden(golden_output, name):
    expected = json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))
    assert name in golden_output, f"the run wrote no {name} file"
    problems = differences(expected, golden_output[name])
    assert not problems, f"{name} differs from tests/golden/{name}.json:\n" + "\n".join(problems)


def test_golden_data_is_frozen_beside_the_test():
    # The golden numbers must not follow the bundled samples.
    assert Path(golden_arguments(HERE)["metadata"]["lmc_data_dir"]) == HERE / "data"
    assert (HERE / "data" / "gsm8k" / "train.jsonl").is_file()
