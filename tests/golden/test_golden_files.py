"""Golden files: the results JSON and geometry files of one fixed run do not change.

The numbers and file formats are a contract with the report and with users'
own scripts. The golden run (`golden_run.py`) is rerun here through
`lm_coupling.evaluate`; every key must be present with the same value, floats
to round-off (rtol 1e-5: the Jacobian routes' float32 round-off), and no key may
appear or vanish except the volatile ones the golden run lists.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from golden_run import HERE, golden_arguments, written_files

import lm_coupling

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def golden_output(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("golden")
    lm_coupling.evaluate(**golden_arguments(out))
    return written_files(out)


def _differences(expected: Any, found: Any, where: str = "") -> list[str]:
    if isinstance(expected, dict) and isinstance(found, dict):
        problems = [f"{where}/{k}: missing" for k in expected if k not in found]
        problems += [f"{where}/{k}: unexpected" for k in found if k not in expected]
        for key in expected.keys() & found.keys():
            problems += _differences(expected[key], found[key], f"{where}/{key}")
        return problems
    if isinstance(expected, list) and isinstance(found, list):
        if len(expected) != len(found):
            return [f"{where}: length {len(found)}, expected {len(expected)}"]
        pairs = enumerate(zip(expected, found, strict=True))
        return [p for i, (e, f) in pairs for p in _differences(e, f, f"{where}[{i}]")]
    if (
        isinstance(expected, float)
        and isinstance(found, (int, float))
        and not isinstance(found, bool)
    ):
        if math.isnan(expected) and math.isnan(found):
            return []
        if math.isclose(found, expected, rel_tol=1e-5, abs_tol=1e-6):
            return []
    elif expected == found and type(expected) is type(found):
        return []
    return [f"{where}: {found!r}, expected {expected!r}"]


@pytest.mark.parametrize(
    "name", ["results", "geometry_lmc_arc_easy_offline", "geometry_lmc_gsm8k_offline"]
)
def test_file_equals_golden(golden_output, name):
    expected = json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))
    assert name in golden_output, f"the run wrote no {name} file"
    problems = _differences(expected, golden_output[name])
    assert not problems, f"{name} differs from tests/golden/{name}.json:\n" + "\n".join(
        problems[:40]
    )


def test_golden_data_is_frozen_beside_the_test():
    # The golden numbers must not follow the bundled samples.
    assert Path(golden_arguments(HERE)["metadata"]["lmc_data_dir"]) == HERE / "data"
    assert (HERE / "data" / "gsm8k" / "train.jsonl").is_file()
