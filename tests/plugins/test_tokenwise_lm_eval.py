"""Token-wise metrics and a preset through the real ``lm-coupling run`` on the bundled model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from lm_coupling.demo.assets import bundled_model_path
from lm_coupling.demo.run import demo_tasks_data

pytestmark = pytest.mark.slow

TOKENWISE = ("tokenwise_self_coupling", "tokenwise_context_fixed_input")


def tokenwise_matrix(geometry, name):
    """The mean matrix of ``name`` in a geometry file (``matrices``, else ``profiles``)."""
    for section in ("matrices", "profiles"):
        mean = ((geometry.get(section) or {}).get(name) or {}).get("mean")
        if mean:
            return np.asarray(mean, dtype=float)
    return None


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenwise")
    command = [sys.executable, "-m", "lm_coupling", "run", "--model", "hf"]
    command += ["--model_args", f"pretrained={bundled_model_path()},dtype=float32"]
    command += ["--tasks", "lmc_hellaswag_offline", "--limit", "2", "--log_samples"]
    command += ["--metrics", ",".join(("coupling", *TOKENWISE)), "--output_path", str(out)]
    args = "preset=iclr2025,k=8,coupling_docs=1,tokenwise_docs=1,tokenwise_positions=3"
    command += ["--metric_args", f"{args},tokenwise_layers=0:-1"]
    data = demo_tasks_data()
    if data is not None:
        command += ["--metadata", json.dumps({"lmc_data_dir": str(data)})]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("LM_COUPLING_DATA_DIR", None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_preset_is_recorded_with_its_expanded_values(run_dir):
    (results,) = run_dir.rglob("results_*.json")
    options = json.loads(results.read_text())["config"]["lm_coupling"]["options"]
    assert options["preset"] == "iclr2025" and options["preset_overrides"] == ["k"]
    assert (options["k"], options["norm"], options["pairs"]) == (8, "l1", "all")


def test_per_document_values_and_matrices_are_written(run_dir):
    (samples,) = run_dir.rglob("samples_lmc_hellaswag_offline_*.jsonl")
    docs = sorted((json.loads(line) for line in samples.read_text().splitlines()),
                  key=lambda d: d["doc_id"])  # fmt: skip
    (geometry,) = run_dir.rglob("geometry_lmc_hellaswag_offline_*.json")
    geo = json.loads(geometry.read_text())
    # The token-wise sample (tokenwise_docs=1) is drawn, seeded; the geometry file names it.
    (sampled,) = geo["sample"]["doc_ids"]["tokenwise_docs"]
    for name in TOKENWISE:
        for doc in docs:
            if doc["doc_id"] == sampled:
                assert math.isfinite(doc[name]), name  # the sampled document
            else:
                assert doc.get(name) is None, name  # outside the sample: not written
    self_matrix = tokenwise_matrix(geo, "tokenwise_self_coupling")
    assert self_matrix.shape == (2 * 3, 2 * 3)
    assert tokenwise_matrix(geo, "tokenwise_context_fixed_input").shape == (2, 3, 3)
    assert geo["tokenwise"]["positions"] == ["n-2", "n-1", "n"]
