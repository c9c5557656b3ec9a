"""The plugin contract through the real ``lm_eval``, with plugins installed beside lm-coupling.

The example package is pip-installed (its ``cosine_to_last`` is written the
short way, one ``@metric`` function); a probe plugin (a one-module
distribution written here) supplies a norm-free lens and metrics that
answer wrongly on purpose; a typo plugin and a good one are registered by
hand in the ``lm_eval`` process before it runs. Two runs share the checks:
one with every metric, one with the logit-lens metrics alone.

- the logit-lens metrics are identical with and without the plugin lens,
  and the plugin lens's metric is there beside them (its catalogue names
  its lens) and equals the norm-free lens computed here;
- a profile one entry short of its axis is refused on every document,
  every failing document counted in the warning;
- the hand-registered typo is refused at registration; the hand-registered
  metric is computed;
- a metric NaN on every document keeps its row, with the reason; one whose
  spec declares NaN an expected answer is counted as such, not warned;
- the short form's metric equals an independent computation;
- the report draws a profile on its declared bounds (any interval), labels
  scatter axes with the declared label, keeps the all-NaN metric's column in
  the leaderboard and gives each plugin's share of the capture time.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.plugin_sites import plugin_env, write_plugin

from lm_coupling.demo.assets import bundled_model_path, bundled_tasks_data_path

TASK = "lmc_arc_easy_offline"
LIMIT = 5
TOL = 1e-5
LENS_METRICS = ("logit_lens_entropy", "tv_to_target")
PROBES = ("no_norm_entropy", "short_profile", "never_crossed", "always_nan")
MATRICES = ("block_gram", "short_matrix")
METRICS = (*LENS_METRICS, "cosine_to_last", *PROBES, "hand_norm", *MATRICES)

PROBE_SOURCE = '''
"""A norm-free lens and metrics of the states at n, some answering wrongly on purpose."""

import math

from lm_coupling import hookimpl, metric


class NoNormLens:
    name = "no_norm"

    def __init__(self, parts):
        self.parts = parts

    def logits(self, layer, hidden):
        return self.parts.unembed_fp32(hidden)  # no final norm


@hookimpl
def lmc_lens(selected, parts):
    return NoNormLens(parts) if "no_norm_entropy" in selected else None


@metric("entropy of the norm-free lens / ln V", lens="no_norm", profile="states")
def no_norm_entropy(logits):
    log_p = logits.log_softmax(dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1) / math.log(logits.shape[-1])
    return entropy.mean(dim=1), entropy


@metric("a states profile one entry short", profile="states")
def short_profile(states):
    norms = states.norm(dim=-1)
    return norms.mean(dim=1), norms[:, :-1]


@metric("a threshold never crossed", nan_expected=True)
def never_crossed(states):
    return states[:, 0, 0] * float("nan")


@metric("NaN on every document")
def always_nan(states):
    return states[:, 0, 0] * float("nan")
'''

MATRIX_SOURCE = '''
"""Matrices of the states at n declared with their axes (blocks x blocks), one a column short."""

from lm_coupling import metric


@metric("mean Gram matrix of the block outputs at n", profile=("blocks", "blocks"))
def block_gram(states):
    gram = states[:, 1:] @ states[:, 1:].transpose(1, 2)
    return gram.mean(dim=(1, 2)), gram


@metric("a blocks x blocks matrix one column short", profile=("blocks", "blocks"))
def short_matrix(states):
    gram = states[:, 1:] @ states[:, 1:].transpose(1, 2)
    return gram.mean(dim=(1, 2)), gram[:, :, :-1]
'''

HAND_REGISTERING_LM_EVAL = '''
"""lm_eval, after registering two plugins by hand (a typo one and a good one)."""

import sys
import types

from lm_coupling import hookimpl, metric
from lm_coupling.errors import PluginError
from lm_coupling.plugins import get_plugin_manager

typo = types.ModuleType("typo")
typo.lmc_compute_bach = hookimpl(lambda states: None)
try:
    get_plugin_manager().register(typo, name="typo")
except PluginError as exc:
    print(f"TYPO REFUSED: {exc}", file=sys.stderr)

good = types.ModuleType("good")
hand_norm = metric("norm of x^L_n", name="hand_norm")
good.hand_norm = hand_norm(lambda states: states[:, -1].norm(dim=-1))
get_plugin_manager().register(good, name="hand")

from lm_eval.__main__ import cli_evaluate

sys.exit(cli_evaluate())
'''


@pytest.fixture(scope="module")
def probe_site(tmp_path_factory) -> Path:
    """The probe plugin, and an ``lm_eval`` script that registers plugins by hand."""
    site = tmp_path_factory.mktemp("probe")
    write_plugin(site, "lmc_contract_probe", "lmc_probe", PROBE_SOURCE)
    write_plugin(site, "lmc_contract_matrix", "lmc_matrix_probe", MATRIX_SOURCE)
    (site / "bin").mkdir()
    (site / "bin" / "lm_eval").write_text(HAND_REGISTERING_LM_EVAL, encoding="utf-8")
    return site


def _run(example_site: Path, probe_site: Path, out: Path, metrics, hand: bool) -> dict:
    model_args = f"pretrained={bundled_model_path()},dtype=float32"
    lm_eval = [sys.executable, str(probe_site / "bin" / "lm_eval")] if hand else [
        str(Path(sys.executable).parent / "lm_eval")
    ]  # fmt: skip
    command = [*lm_eval, "--model", "hf", "--model_args", model_args, "--tasks", TASK]
    command += ["--limit", str(LIMIT), "--batch_size", "2", "--device", "cpu"]
    command += ["--output_path", str(out), "--log_samples", "--metrics", ",".join(metrics)]
    command += ["--metadata", json.dumps({"lmc_data_dir": str(bundled_tasks_data_path())})]
    done = subprocess.run(
        command,
        env=plugin_env(example_site, probe_site),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    (geometry,) = out.rglob(f"geometry_{TASK}_*.json")
    rows = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
    return {
        "folder": out,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "results": json.loads(results.read_text(encoding="utf-8")),
        "samples": {row["doc_id"]: row for row in rows},
        "geometry": json.loads(geometry.read_text(encoding="utf-8")),
    }


@pytest.fixture(scope="module")
def runs(example_site, probe_site, tmp_path_factory) -> dict:
    """The run with every metric (plugins registered by hand too) and the logit lens alone."""
    every = _run(example_site, probe_site, tmp_path_factory.mktemp("every"), METRICS, hand=True)
    alone = _run(example_site, probe_site, tmp_path_factory.mktemp("alone"), LENS_METRICS, False)
    return {"every": every, "alone": alone}


@pytest.fixture(scope="module")
def reference(runs):
    """Per document, x^0_n .. x^L_n (x^L before the final norm) from the model itself."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(bundled_model_path()), batch_size=1, device="cpu", dtype="float32")
    model, out = lm.model, {}
    blocks = model.transformer.h
    for doc_id, row in runs["every"]["samples"].items():
        request = row["arguments"][f"gen_args_{int(row['target'])}"]
        context, _ = lm._encode_pair(request["arg_0"], request["arg_1"])
        kept = {}
        hook = blocks[-1].register_forward_hook(
            lambda m, a, o, kept=kept: kept.update(x=o[0] if isinstance(o, tuple) else o)
        )
        try:
            with torch.no_grad():
                hidden = model(torch.tensor([context]), output_hidden_states=True).hidden_states
        finally:
            hook.remove()
        states = torch.stack([*hidden[: len(blocks)], kept["x"]])[:, 0, -1].double()
        out[doc_id] = {"states": states, "unembed": model.lm_head.weight.detach().double()}
    return out


@pytest.mark.slow
def test_the_logit_lens_is_untouched_by_a_plugin_lens_beside_it(runs, reference):
    every, alone = runs["every"], runs["alone"]
    for doc_id, row in every["samples"].items():
        for name in LENS_METRICS:
            assert row[name] == alone["samples"][doc_id][name], (doc_id, name)
        states = reference[doc_id]["states"]
        log_p = (states @ reference[doc_id]["unembed"].T).log_softmax(dim=-1)
        entropy = -(log_p.exp() * log_p).sum(dim=-1) / math.log(log_p.shape[-1])
        assert row["no_norm_entropy"] == pytest.approx(float(entropy.mean()), abs=TOL)
        assert row["no_norm_entropy"] != pytest.approx(row["logit_lens_entropy"], abs=1e-3)
    results = every["results"]["results"][TASK]
    for name in LENS_METRICS:
        assert results[f"{name},none"] == alone["results"]["results"][TASK][f"{name},none"]
    catalogue = every["results"]["config"]["lm_coupling"]["catalogue"]["metrics"]
    assert catalogue["no_norm_entropy"]["lens"] == "no_norm"
    assert "lens" not in catalogue["logit_lens_entropy"]  # the logit lens: the default


@pytest.mark.slow
def test_the_short_route_equals_an_independent_computation(runs, reference):
    geometry = runs["every"]["geometry"]
    profiles = []
    for doc_id, row in runs["every"]["samples"].items():
        states = reference[doc_id]["states"]
        cosine = torch.nn.functional.cosine_similarity(states, states[-1:], dim=-1)
        assert row["cosine_to_last"] == pytest.approx(float(cosine.mean()), abs=TOL)
        assert row["hand_norm"] == pytest.approx(float(states[-1].norm()), rel=TOL)
        profiles.append(cosine)
    mean = torch.stack(profiles).mean(dim=0)
    assert geometry["profiles"]["cosine_to_last"]["mean"] == pytest.approx(mean.tolist(), abs=TOL)
    catalogue = runs["every"]["results"]["config"]["lm_coupling"]["catalogue"]
    assert catalogue["profiles"]["cosine_to_last"]["bounds"] == [-1.0, 1.0]


@pytest.mark.slow
def test_a_short_profile_is_refused_on_every_document(runs):
    run = runs["every"]
    failures = [f for f in run["geometry"]["failures"] if f.get("plugin") == "lmc_probe"]
    assert sorted(f["doc_id"] for f in failures) == list(range(LIMIT))
    assert all(f["metrics"] == ["short_profile"] for f in failures)
    assert all("declared axis needs 5 entries" in f["error"] for f in failures)
    assert "short_profile" not in run["geometry"]["profiles"]
    for row in run["samples"].values():  # the probe's other metrics keep their values
        assert math.isfinite(row["no_norm_entropy"])
    assert f"failed on {LIMIT} documents" in run["stderr"]


@pytest.mark.slow
def test_a_matrix_is_checked_against_its_declared_axes(runs, reference):
    run = runs["every"]
    failures = [f for f in run["geometry"]["failures"] if f.get("plugin") == "lmc_matrix_probe"]
    assert sorted(f["doc_id"] for f in failures) == list(range(LIMIT))
    assert all(f["metrics"] == ["short_matrix"] for f in failures)
    assert all("(4, 3) per document where its declared axes need 4 x 4" in f["error"]
               for f in failures)  # fmt: skip
    assert "short_matrix" not in run["geometry"]["matrices"]
    grams = []
    for doc_id, row in run["samples"].items():
        assert math.isnan(row.get("short_matrix", math.nan))
        blocks = reference[doc_id]["states"][1:]
        grams.append(blocks @ blocks.T)
        assert row["block_gram"] == pytest.approx(float(grams[-1].mean()), rel=TOL)
    mean = torch.stack(grams).mean(dim=0)
    written = torch.tensor(run["geometry"]["matrices"]["block_gram"]["mean"], dtype=torch.float64)
    torch.testing.assert_close(written, mean, rtol=TOL, atol=TOL)


@pytest.mark.slow
def test_a_hand_registered_typo_is_refused(runs):
    stderr = runs["every"]["stderr"]
    assert "TYPO REFUSED" in stderr and "unknown hook 'lmc_compute_bach'" in stderr


@pytest.mark.slow
def test_an_all_nan_metric_keeps_its_row_and_an_expected_nan_is_no_failure(runs):
    run = runs["every"]
    results = run["results"]["results"][TASK]
    for name in ("always_nan", "never_crossed", "short_profile"):
        assert f"{name},none" in results, name
        assert math.isnan(float(results[f"{name},none"])), name
        assert name in run["stdout"], name  # lm-eval's table
    reasons = run["results"]["config"]["lm_coupling"]["undefined"][TASK]
    assert "undefined" in reasons["always_nan"] and "expected" in reasons["never_crossed"]
    stderr = run["stderr"]
    assert "NaN) for never_crossed" not in stderr  # an expected NaN: never warned
    assert "NaN on every document, an expected answer: never_crossed" in stderr
    assert "undefined geometry (NaN) for always_nan" in stderr
    assert "computed on 0 documents: always_nan, short_profile" in stderr


@pytest.mark.slow
def test_the_report_reads_the_declarations_and_each_plugin_s_time(runs, tmp_path):
    import pandas as pd

    from lm_coupling.catalogue import recorded_catalogue
    from lm_coupling.report.build import build_report
    from lm_coupling.report.figures import layer_profile, metric_vs_score

    run = runs["every"]
    catalogue = recorded_catalogue(run["results"]["config"])
    profile = run["geometry"]["profiles"]["cosine_to_last"]["mean"]
    ax = layer_profile(profile, "cosine_to_last", catalogue=catalogue)
    assert ax.get_ylim() == pytest.approx((-1.04, 1.04))  # its bounds, (-1, 1)
    board = pd.DataFrame(
        {
            "model": ["a", "b"],
            "revision": ["main"] * 2,
            "cosine_to_last": [0.1, 0.2],
            "acc": [0.3, 0.4],
        }
    )
    ax = metric_vs_score(board, "cosine_to_last", "acc", catalogue=catalogue)
    assert ax.get_xlabel().startswith("cosine to the last state")
    seconds = run["geometry"]["timings"]["seconds_per_document"]
    assert seconds["plugin:lmc_probe"] > 0 and seconds["plugin:builtin.lens"] > 0
    report = build_report(run["folder"], tmp_path / "report")
    assert "always_nan" in report.leaderboard.columns
    assert report.leaderboard["always_nan"].isna().all()
    summary = report.summary.read_text(encoding="utf-8")
    assert "share of the capture time" in summary and "lmc_probe" in summary
