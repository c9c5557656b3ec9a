"""Layer by Layer's measures through the real lm-eval run, against an independent computation.

One run per architecture (tiny GPT-2, Llama, GPT-NeoX), batch size 4 (so rows
are padded), shared by every test here. The reference takes each document's
prompt alone (no padding, batch of one), the model's own
``output_hidden_states`` for ``x^0 .. x^{L-1}`` and the last block's output for
``x^L`` (HF's last hidden state is after the final norm), and the textbook
formulas in float64 (SVD, arccos).
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
from fixtures.tiny import save_tiny_model

from lm_coupling.demo.run import demo_tasks_data
from lm_coupling.model.architecture import block_output_hidden, locate_model_parts

pytestmark = pytest.mark.slow

TASK = "lmc_arc_easy_offline"
METRICS = (
    "prompt_entropy",
    "prompt_entropy_min_layer",
    "curvature",
    "curvature_min_layer",
    "effective_rank",
    "dataset_entropy",
)
TOL = 1e-5


@pytest.fixture(scope="module", params=["gpt2", "llama", "gpt_neox"])
def run(request, tmp_path_factory, tokenizer):
    arch = request.param
    root = tmp_path_factory.mktemp(f"lbl_{arch}")
    model_dir = save_tiny_model(root / arch, arch, tokenizer=tokenizer, init_std=0.2, seed=1)
    command = [sys.executable, "-m", "lm_coupling", "run", "--model", "hf"]
    command += ["--model_args", f"pretrained={model_dir}", "--tasks", TASK, "--limit", "6"]
    command += ["--batch_size", "4", "--log_samples", "--output_path", str(root / "out")]
    command += ["--metrics", ",".join(METRICS)]
    data = demo_tasks_data()
    if data is not None:
        command += ["--metadata", json.dumps({"lmc_data_dir": str(data)})]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (samples,) = (root / "out").rglob(f"samples_{TASK}_*.jsonl")
    rows = {}
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["doc_id"], row)
    (geometry,) = (root / "out").rglob(f"geometry_{TASK}_*.json")
    return arch, model_dir, rows, json.loads(geometry.read_text())


def _prompt(hflm, row) -> list[int]:
    """The gold request's context as HFLM encodes and truncates it (multiple choice)."""
    request = row["arguments"][f"gen_args_{int(row['target'])}"]
    context_enc, continuation_enc = hflm._encode_pair(request["arg_0"], request["arg_1"])
    inp = (context_enc + continuation_enc)[-(hflm.max_length + 1) :][:-1]
    return inp[: len(inp) - len(continuation_enc) + 1]


def _states(model, tokens: list[int]) -> np.ndarray:
    """``[L+1, T, d]`` float64: ``output_hidden_states`` 0..L-1 and the last block's output."""
    last = {}
    parts = locate_model_parts(model)
    handle = parts.blocks[-1].register_forward_hook(
        lambda _m, _a, out: last.update(x=block_output_hidden(out)[0])
    )
    try:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_hidden_states=True)
    finally:
        handle.remove()
    states = [h[0] for h in out.hidden_states[: parts.n_layers]] + [last["x"]]
    return torch.stack(states).double().numpy()


def _reference(z: np.ndarray) -> dict[str, float]:
    """Textbook formulas on one state's measured tokens ``z [T, d]``."""
    s = np.linalg.svd(z, compute_uv=False)
    lam = s**2 / (s**2).sum()
    lam = lam[lam > 0]
    q = s / s.sum()
    q = q[q > 0]
    v = np.diff(z, axis=0)
    cos = (v[1:] * v[:-1]).sum(1) / (np.linalg.norm(v[1:], axis=1) * np.linalg.norm(v[:-1], axis=1))
    return {
        "prompt_entropy": float(-(lam * np.log(lam)).sum()),
        "effective_rank": float(np.exp(-(q * np.log(q)).sum())),
        "curvature": float(np.arccos(np.clip(cos, -1, 1)).mean()),
    }


@pytest.fixture(scope="module")
def reference(run):
    from lm_eval.models.huggingface import HFLM

    _, model_dir, rows, _ = run
    hflm = HFLM(pretrained=str(model_dir), batch_size=1, device="cpu")
    out = {}
    for doc_id, row in rows.items():
        states = _states(hflm.model, _prompt(hflm, row))[:, 1:]  # measured: tokens 1..n
        per_layer = [_reference(z) for z in states]
        out[doc_id] = {
            "profiles": {k: np.array([p[k] for p in per_layer]) for k in per_layer[0]},
            "pooled": states.mean(axis=1),  # [L+1, d]
        }
    return out


def test_values_and_profiles_equal_the_independent_computation(run, reference):
    arch, _, rows, geometry = run
    assert len(rows) == 6
    for doc_id, row in rows.items():
        ref = reference[doc_id]["profiles"]
        for name in ("prompt_entropy", "curvature", "effective_rank"):
            assert row[name] == pytest.approx(ref[name].mean(), abs=TOL), (arch, doc_id, name)
        depth = len(ref["prompt_entropy"]) - 1
        expected = np.argmin(ref["prompt_entropy"]) / depth
        assert row["prompt_entropy_min_layer"] == pytest.approx(expected, abs=1e-6)
        expected = np.argmin(ref["curvature"]) / depth
        assert row["curvature_min_layer"] == pytest.approx(expected, abs=1e-6)
    for name in ("prompt_entropy", "curvature", "effective_rank"):
        profile = geometry["profiles"][name]
        mean = np.mean([reference[d]["profiles"][name] for d in rows], axis=0)
        np.testing.assert_allclose(profile["mean"], mean, atol=TOL, rtol=0)
        assert profile["n"] in (6, [6] * len(mean))


def test_dataset_entropy_equals_the_gram_entropy_over_documents(run, reference):
    arch, _, rows, geometry = run
    section = geometry["dataset_entropy"]
    pooled = np.stack([reference[d]["pooled"] for d in sorted(rows)])  # [N, L+1, d]
    expected = []
    for layer in range(pooled.shape[1]):
        z = pooled[:, layer]
        lam = np.linalg.eigvalsh(z @ z.T)
        lam = lam[lam > 1e-12 * lam.max()] / lam[lam > 1e-12 * lam.max()].sum()
        expected.append(float(-(lam * np.log(lam)).sum()))
    np.testing.assert_allclose(section["profile"], expected, atol=TOL, rtol=0)
    assert section["value"] == pytest.approx(np.mean(expected), abs=TOL)
    assert section["n"] == 6 and section["left_out"] == 0
    assert section["by_count"]["n"] == [1, 2, 4, 6]
    assert section["by_count"]["value"][0] == pytest.approx(0.0, abs=1e-9)  # one document
    assert section["by_count"]["value"][-1] == pytest.approx(section["value"], abs=1e-12)
    assert math.isfinite(section["min_layer"])
