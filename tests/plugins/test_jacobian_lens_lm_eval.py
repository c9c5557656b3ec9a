"""The Jacobian lens through the real lm-eval run: fitted and read in one run, then loaded.

Run 1 selects only the reading metrics (and the task-level ``dataset_entropy``)
on tiny GPT-2 at batch size 4 (padded rows): the fit comes in by itself
(``jlens_fit`` on ``jlens_docs=3`` documents, ``jlens_estimator=last_position``;
the default reference estimator is tested against TransformerLens in
``tests/capture/test_jacobian_lens_fit.py``), the lens is saved beside the
geometry file, its ``J_l`` must equal the average over the sampled documents
of dense autograd Jacobians ``d x^L_n / d x^l_n`` through the whole sequence,
and every document's values must equal an independent read-out through that
lens from the model's own states and head. ``dataset_entropy`` is one value
per task in lm-eval's results, no per-document value, no warning. Run 2 loads
the lens (``jlens_path``), read out in the forward passes beside the logit lens
(a named lens, ``MetricSpec.lens``): the same values, no fit, and the
logit-lens metrics identical to run 1's, which had no lens beside them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from fixtures.jacobians import autograd_total_jacobian, states_at_last
from fixtures.tiny import save_tiny_model

from lm_coupling.demo.run import demo_tasks_data
from lm_coupling.errors import ConfigurationError
from lm_coupling.model.architecture import locate_model_parts
from lm_coupling.plugins.builtin.jacobian_lens_file import load_lens

pytestmark = pytest.mark.slow

TASK = "lmc_arc_easy_offline"
READ = ("jlens_entropy", "jlens_tv_to_target", "jlens_fixation_depth")
LOGIT = ("logit_lens_entropy", "tv_to_target", "fixation_depth")


def _run(root, model_dir, metrics: str, metric_args: str, out: str):
    command = [sys.executable, "-m", "lm_coupling", "run", "--model", "hf"]
    command += ["--model_args", f"pretrained={model_dir}", "--tasks", TASK, "--limit", "5"]
    command += ["--batch_size", "4", "--log_samples", "--output_path", str(root / out)]
    command += ["--metrics", metrics, "--metric_args", metric_args]
    data = demo_tasks_data()
    if data is not None:
        command += ["--metadata", json.dumps({"lmc_data_dir": str(data)})]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (samples,) = (root / out).rglob(f"samples_{TASK}_*.jsonl")
    rows = {}
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["doc_id"], row)
    (geometry,) = (root / out).rglob(f"geometry_{TASK}_*.json")
    (results,) = (root / out).rglob("results_*.json")
    return {
        "rows": rows,
        "geometry": json.loads(geometry.read_text()),
        "results": json.loads(results.read_text()),
        "stderr": done.stderr,
        "folder": geometry.parent,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("jlens")
    model_dir = save_tiny_model(root / "gpt2", "gpt2", tokenizer=tokenizer, init_std=0.2, seed=1)
    one = _run(
        root, model_dir, ",".join((*READ, *LOGIT, "dataset_entropy")),
        "jlens_docs=3,jlens_estimator=last_position", "one",
    )  # fmt: skip
    (lens_file,) = one["folder"].glob(f"jlens_{TASK}_*.pt")  # saved beside the geometry file
    loaded = _run(
        root, model_dir, ",".join((*READ, *LOGIT)), f"jlens_path={lens_file}", "load"
    )  # fmt: skip
    return model_dir, lens_file, one, loaded


@pytest.fixture(scope="module")
def hflm(runs):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(runs[0]), batch_size=1, device="cpu")


def _prompt(hflm, row) -> tuple[list[int], int]:
    """The gold request's context as HFLM encodes and truncates it, and the gold token."""
    request = row["arguments"][f"gen_args_{int(row['target'])}"]
    context_enc, continuation_enc = hflm._encode_pair(request["arg_0"], request["arg_1"])
    inp = (context_enc + continuation_enc)[-(hflm.max_length + 1) :][:-1]
    return inp[: len(inp) - len(continuation_enc) + 1], continuation_enc[0]


def test_lens_fitted_in_the_run_equals_average_of_dense_autograd_jacobians(runs, hflm):
    _, lens_file, one, _ = runs
    raw = torch.load(lens_file, weights_only=True)  # TransformerLens's artifact format
    assert raw["metadata"]["lm_coupling"]["version"] == 2
    assert raw["metadata"]["estimator"] == "lm_coupling_last_position"
    record = load_lens(lens_file, raw["metadata"]["lm_coupling"]["n_layers"], raw["d_model"])
    rows, section = one["rows"], one["geometry"]["jacobian_lens"]
    sampled = [d for d, row in rows.items() if math.isfinite(row.get("jlens_fit") or math.nan)]
    assert len(sampled) == record["n_documents"] == section["fitted_on"] == 3
    assert section["saved"] == str(lens_file) and section["read_through"] == "fitted in this run"
    model = hflm.model
    parts = locate_model_parts(model)
    L, d = parts.n_layers, parts.d_model
    reference = torch.zeros(L + 1, d, d)
    for doc_id in sampled:
        ids = torch.tensor(_prompt(hflm, rows[doc_id])[0])
        states, _ = states_at_last(model, parts, ids)
        for layer in range(L):
            reference[layer] += autograd_total_jacobian(model, parts, ids, layer, states[layer])
        reference[L] += torch.eye(d)
    reference /= len(sampled)
    torch.testing.assert_close(record["jacobians"], reference, rtol=1e-5, atol=1e-5)
    gain = torch.linalg.matrix_norm(reference) / d**0.5
    np.testing.assert_allclose(section["gain_profile"], gain, atol=1e-5)


def _independent_read(hflm, J, row) -> dict[str, float]:
    model = hflm.model
    parts = locate_model_parts(model)
    L = parts.n_layers
    norm, head = model.transformer.ln_f, model.lm_head  # GPT-2's own final norm and head
    tokens, gold = _prompt(hflm, row)
    states, model_logits = states_at_last(model, parts, torch.tensor(tokens))
    with torch.no_grad():
        logits = head(norm(torch.einsum("lij,lj->li", J, states))).double()
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])
    top1 = logits.argmax(-1)
    changed = [layer for layer in range(L + 1) if top1[layer] != top1[L]]
    torch.testing.assert_close(  # the last layer's J-lens is the model's own output
        torch.softmax(logits[L], -1), torch.softmax(model_logits.double(), -1), atol=1e-6,
        rtol=1e-5,
    )  # fmt: skip
    return {
        "jlens_entropy": float(entropy.mean()),
        "jlens_tv_to_target": float((1 - logp[:, gold].exp()).mean()),
        "jlens_fixation_depth": (max(changed) + 1) / L if changed else 0.0,
        "profile": entropy.numpy(),
    }


def test_every_document_read_in_the_same_run_equals_the_independent_read_out(runs, hflm):
    _, lens_file, one, _ = runs
    raw = torch.load(lens_file, weights_only=True)
    J = load_lens(lens_file, raw["metadata"]["lm_coupling"]["n_layers"], raw["d_model"])
    J = J["jacobians"]
    rows = one["rows"]
    assert len(rows) == 5
    profiles = []
    for row in rows.values():
        expected = _independent_read(hflm, J, row)
        assert row["jlens_entropy"] == pytest.approx(expected["jlens_entropy"], abs=1e-5)
        assert row["jlens_tv_to_target"] == pytest.approx(expected["jlens_tv_to_target"], abs=1e-5)
        assert row["jlens_fixation_depth"] == pytest.approx(expected["jlens_fixation_depth"])
        profiles.append(expected["profile"])
    profile = one["geometry"]["profiles"]["jlens_entropy"]
    np.testing.assert_allclose(profile["mean"], np.mean(profiles, axis=0), atol=1e-5)


def test_task_level_metric_is_one_value_per_task_without_warnings(runs):
    _, _, one, _ = runs
    table = one["results"]["results"][TASK]
    section = one["geometry"]["dataset_entropy"]
    assert table["dataset_entropy,none"] == pytest.approx(section["value"], abs=1e-12)
    assert table["dataset_entropy_stderr,none"] == "N/A"
    assert section["n"] == 5 and one["geometry"]["n_measured"]["dataset_entropy"] == 5
    assert all("dataset_entropy" not in row for row in one["rows"].values())
    catalogue = one["results"]["config"]["lm_coupling"]["catalogue"]["metrics"]
    assert catalogue["dataset_entropy"]["task_level"] is True
    assert "task_level" not in catalogue["jlens_entropy"]  # recorded only when true
    assert "GeometryWarning" not in one["stderr"], one["stderr"][-3000:]
    assert "computed on 0 documents" not in one["stderr"]
    assert "dataset_entropy" in one["stderr"]  # the account line counts it


def test_loaded_lens_reads_the_same_values_beside_the_logit_lens(runs):
    _, lens_file, one, loaded = runs
    assert loaded["geometry"]["jacobian_lens"]["read_through"] == str(lens_file)
    assert "fitted_on" not in loaded["geometry"]["jacobian_lens"]  # loaded, not fitted
    for doc_id, row in loaded["rows"].items():
        assert "jlens_fit" not in row
        assert math.isfinite(row["logit_lens_entropy"])
        for name in READ:
            assert row[name] == pytest.approx(one["rows"][doc_id][name], abs=1e-6)
        for name in LOGIT:  # the J-lens is read beside the logit lens, which it leaves alone
            assert row[name] == one["rows"][doc_id][name], (doc_id, name)
    catalogue = loaded["results"]["config"]["lm_coupling"]["catalogue"]["metrics"]
    assert all(catalogue[name]["lens"] == "jacobian" for name in READ)
    assert "lens" not in catalogue["logit_lens_entropy"]
    seconds = loaded["geometry"]["timings"]["seconds_per_document"]
    assert seconds["plugin:builtin.jacobian_lens"] > 0  # its read-out in the forward passes


def test_selection_brings_the_fit_in_unless_a_lens_is_loaded(tmp_path):
    from lm_coupling.selection import make_selection

    assert "jlens_fit" in make_selection("jlens_entropy", None).metrics
    lens = tmp_path / "lens.pt"
    lens.write_bytes(b"")
    assert "jlens_fit" not in make_selection("jlens_entropy", f"jlens_path={lens}").metrics
    with pytest.raises(ConfigurationError, match="not a file"):
        make_selection("jlens_entropy", f"jlens_path={tmp_path / 'missing.pt'}")
