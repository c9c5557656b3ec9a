"""The real ``lm_eval`` command line with and without ``--metrics``.

Runs (session fixtures in conftest.py): stock ``lm_eval`` (gpt2, batch 4),
``lm_eval --metrics all`` (gpt2, batch 4), ``lm-coupling run --metrics all``
(gpt2, batch 1) and ``python -m lm_coupling run --metrics all
--metric_args coupling_docs=2,k=1000`` (llama, batch auto), all over
``lmc_demo`` on five items per benchmark, with a 128-token context that
lm-eval truncates.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from fixtures.catalogue import default_metrics, sampled_metrics
from harness_cli import LLAMA_METRIC_ARGS, MAX_LEN, result_key

from lm_coupling.harness.outputs import SCHEMA

pytestmark = pytest.mark.slow

ALL_METRICS = default_metrics()
SAMPLED = sampled_metrics()
TASKS = (
    "lmc_arc_easy_offline",
    "lmc_arc_challenge_offline",
    "lmc_hellaswag_offline",
    "lmc_mmlu_offline_astronomy",
    "lmc_mmlu_offline_high_school_biology",
    "lmc_mmlu_offline_elementary_mathematics",
    "lmc_truthfulqa_mc2_offline",
    "lmc_winogrande_offline",
    "lmc_gsm8k_offline",
)
N_LAYERS = 3
D_MODEL = 32


def _geometry_key(key: str) -> bool:
    return key.split(",")[0].removesuffix("_stderr") in ALL_METRICS


def _table_lines(stdout: str) -> list[tuple[str, ...]]:
    """Table rows as stripped cells (column widths depend on the longest name)."""
    return [
        tuple(cell.strip() for cell in line.split("|"))
        for line in stdout.splitlines()
        if line.startswith("|") and not line.startswith("|--")
    ]


def test_every_benchmark_ran(stock_run, metrics_run):
    assert set(TASKS) <= set(stock_run.results["results"])
    assert set(TASKS) == set(metrics_run.samples)
    for task in TASKS:
        assert metrics_run.results["n-samples"][task]["effective"] >= 1
    # ARC names its few-shot split (the one lm-eval's rule picks; lmc_demo asks 2 shots in
    # the task's config): lm-eval no longer warns about it per run.
    for run in (stock_run, metrics_run):
        for task in ("lmc_arc_easy_offline", "lmc_arc_challenge_offline"):
            assert f"[Task: {task}] num_fewshot > 0 but fewshot_split is None" not in run.stderr


def test_accuracy_identical_with_and_without_metrics(stock_run, metrics_run):
    for section in ("results", "groups"):
        stock, geo = stock_run.results[section], metrics_run.results[section]
        assert set(stock) == set(geo)
        for task, stock_values in stock.items():
            kept = {k: v for k, v in geo[task].items() if not _geometry_key(k)}
            assert kept == stock_values, task
    for task in TASKS:
        stock_docs, geo_docs = stock_run.docs(task), metrics_run.docs(task)
        assert stock_docs.keys() == geo_docs.keys()
        for doc_id, row in stock_docs.items():
            assert geo_docs[doc_id]["resps"] == row["resps"], (task, doc_id)
            assert geo_docs[doc_id]["filtered_resps"] == row["filtered_resps"]
            for metric in row["metrics"]:
                assert geo_docs[doc_id][metric] == row[metric], (task, doc_id, metric)


def test_stock_output_has_no_geometry(stock_run):
    assert "lm_coupling" not in stock_run.results["config"]
    assert stock_run.results["config"]["model"] == "hf"
    assert not stock_run.geometry
    assert not list(stock_run.output_dir.glob("*/geometry_*.json"))
    for values in stock_run.results["results"].values():
        assert not [k for k in values if _geometry_key(k)]
    for rows in stock_run.samples.values():
        for row in rows:
            assert not set(ALL_METRICS) & set(row)
    for cells in _table_lines(stock_run.stdout):
        assert not set(ALL_METRICS) & set(cells), cells


def _table_rows(stdout: str) -> set[tuple[str, ...]]:
    """(task, version, filter, n-shot, metric, arrow, value, ±, stderr) per printed row."""
    rows, task, version = set(), "", ""
    for cells in _table_lines(stdout):
        if len(cells) < 11 or cells[5] == "Metric":
            continue
        # Task and version are printed on a task's first row only.
        task, version = (cells[1], cells[2]) if cells[1] else (task, version)
        rows.add((task, version, *cells[3:10]))
    return rows


def test_printed_table_is_stock_plus_geometry_rows(stock_run, metrics_run):
    stock_rows = _table_rows(stock_run.stdout)
    geo_rows = _table_rows(metrics_run.stdout)
    assert len(stock_rows) >= len(TASKS)
    # Every stock row is printed unchanged; the rest are geometry rows.
    assert stock_rows <= geo_rows
    assert {row[4] for row in geo_rows - stock_rows} == set(ALL_METRICS)


def test_results_json_carries_metrics_and_provenance(metrics_run):
    results = metrics_run.results
    for task in TASKS:
        values = results["results"][task]
        for name in ALL_METRICS:
            assert math.isfinite(values[result_key(task, name)]), (task, name)
            assert result_key(task, f"{name}_stderr") in values
    info = results["config"]["lm_coupling"]
    import lm_coupling

    assert info["version"] == lm_coupling.__version__
    assert info["metrics"] == list(ALL_METRICS)
    assert info["options"]["coupling_docs"] == 25 and info["options"]["k"] == 10
    shape = info["model_shape"]
    assert shape["model_type"] == "gpt2"
    assert (shape["n_layers"], shape["d_model"]) == (N_LAYERS, D_MODEL)
    assert shape["n_params"] == results["config"]["model_num_parameters"]
    assert shape["vocab_size"] > 0
    assert results["higher_is_better"]["lmc_arc_easy_offline"]["coupling"] is True
    assert results["higher_is_better"]["lmc_arc_easy_offline"]["lss"] is False


def _geometry_rows(rows: list[dict]) -> list[dict]:
    """The rows of one document that carry its geometry: its first filter's only.

    Geometry does not depend on lm-eval's answer filters, so a generation
    task's second filter (GSM8K's flexible-extract) repeats none of it.
    """
    carrying = [row for row in rows if "lss" in row["metrics"]]
    assert len(carrying) == 1, [row.get("filter") for row in rows]
    for row in rows:
        if row is not carrying[0]:
            assert not set(ALL_METRICS) & set(row["metrics"]), row.get("filter")
    return carrying


def test_samples_carry_per_document_geometry(metrics_run):
    for task in TASKS:
        by_doc: dict[int, list[dict]] = {}
        for row in metrics_run.samples[task]:
            by_doc.setdefault(row["doc_id"], []).append(row)
        for rows in by_doc.values():
            (row,) = _geometry_rows(rows)
            for name in ALL_METRICS:
                assert name in row["metrics"]
            assert math.isfinite(row["lss"]) and row["lss"] >= 1.0 - 1e-6
            assert 0.0 <= row["logit_lens_entropy"] <= 1.0 + 1e-6


def _check_profile(summary: dict, length: int) -> None:
    assert set(summary) == {"mean", "stderr", "n"}
    assert len(summary["mean"]) == len(summary["stderr"]) == len(summary["n"]) == length


def test_geometry_files_follow_the_schema(metrics_run):
    assert set(metrics_run.geometry) == set(TASKS)
    for task, document in metrics_run.geometry.items():
        n_docs = len(metrics_run.docs(task))
        assert document["schema"] == SCHEMA
        assert document["task"] == task
        model = document["model"]
        expected = {"name", "revision", "dtype", "model_type", "n_layers", "d_model"}
        assert expected | {"n_params", "vocab_size"} <= set(model)
        assert model["n_layers"] == N_LAYERS and model["d_model"] == D_MODEL
        assert document["metrics"] == list(ALL_METRICS)
        assert document["options"] == metrics_run.results["config"]["lm_coupling"]["options"]
        assert document["n_documents"] == n_docs
        assert document["failures"] == []
        profiles = document["profiles"]
        for name, length in (
            ("norm", N_LAYERS + 1),
            ("windowed_lss", N_LAYERS),
            ("logit_lens_entropy", N_LAYERS + 1),
            ("tv_to_target", N_LAYERS + 1),
        ):
            _check_profile(profiles[name], length)
            assert profiles[name]["n"] == [n_docs] * length
        for name in ("coupling", "alignment_ratio"):
            matrix = document["matrices"][name]
            assert matrix["n"] == n_docs
            assert len(matrix["mean"]) == N_LAYERS
            assert all(len(row) == N_LAYERS for row in matrix["mean"])
        coupling = document["coupling"]
        assert coupling["k"] == 10 and coupling["n_sampled"] == n_docs
        assert coupling["norm"] == "l1" and coupling["pairs"] == "offdiag"
        assert len(coupling["spectral_gap"]) == N_LAYERS == len(coupling["method"])
        assert len(coupling["singular_values"]) == N_LAYERS
    stamps = {p.name.rsplit("_", 1)[-1] for p in metrics_run.output_dir.glob("*/geometry_*")}
    assert stamps == {f"{metrics_run.timestamp}.json"}


def test_geometry_file_means_match_results(metrics_run):
    # The windowed profile and the per-document values aggregate the same documents.
    for task in TASKS:
        docs = metrics_run.docs(task)
        mean = sum(row["lss"] for row in docs.values()) / len(docs)
        found = metrics_run.results["results"][task][result_key(task, "lss")]
        assert found == pytest.approx(mean, abs=1e-9)


def _assert_matches_library(
    run, model_path, library_geometry, coupling_docs: int, metric_args: str | None = None
) -> int:
    checked = 0
    for task in TASKS:
        rows_by_doc: dict[int, list[dict]] = {}
        for row in run.samples[task]:
            rows_by_doc.setdefault(row["doc_id"], []).append(row)
        # The coupling sample is seeded and random (harness/sample.py); the file names it.
        sample = set(run.geometry[task]["sample"]["doc_ids"]["coupling_docs"])
        assert len(sample) == min(coupling_docs, len(rows_by_doc)) and sample <= set(rows_by_doc)
        for doc_id, all_rows in rows_by_doc.items():
            rows = _geometry_rows(all_rows)
            reference = library_geometry(model_path, rows[0], metric_args)
            for name in ALL_METRICS:
                expected = reference.values[name]
                for row in rows:
                    if name in SAMPLED and doc_id not in sample:
                        assert name not in row, (task, doc_id, name)
                    elif math.isfinite(expected):
                        assert row[name] == pytest.approx(expected, abs=1e-4), (task, doc_id, name)
                    else:
                        assert name not in row, (task, doc_id, name)
            checked += 1
    return checked


def test_gpt2_batched_geometry_equals_each_prompt_alone(
    metrics_run, harness_setup, library_geometry
):
    checked = _assert_matches_library(
        metrics_run, harness_setup.models["gpt2"], library_geometry, coupling_docs=25
    )
    assert checked == sum(len(metrics_run.docs(t)) for t in TASKS)


def test_llama_geometry_equals_each_prompt_alone(llama_run, harness_setup, library_geometry):
    assert llama_run.results["config"]["lm_coupling"]["model_shape"]["model_type"] == "llama"
    model = harness_setup.models["llama"]
    _assert_matches_library(llama_run, model, library_geometry, 2, LLAMA_METRIC_ARGS)
    for task in TASKS:
        n_docs = len(llama_run.docs(task))
        coupling = llama_run.geometry[task]["coupling"]
        assert coupling["n_sampled"] == min(2, n_docs)
        assert llama_run.geometry[task]["matrices"]["coupling"]["n"] == min(2, n_docs)
        assert llama_run.geometry[task]["n_measured"]["coupling"] == min(2, n_docs)


def test_k_is_recorded_as_used(llama_run):
    # k=1000 on a 32-wide model: K = d_model - 1 = 31 is what was computed.
    info = llama_run.results["config"]["lm_coupling"]
    assert info["options"]["k"] == D_MODEL - 1
    assert info["options_requested"] == {"k": 1000}
    assert info["options"]["alignment_k"] == 30  # fits: unchanged
    for task in TASKS:
        document = llama_run.geometry[task]
        assert document["options"] == info["options"]
        assert document["coupling"]["k"] == D_MODEL - 1
        assert len(document["coupling"]["singular_values"][0]) == D_MODEL  # K + 1 values


def test_batch_size_does_not_change_geometry(metrics_run, metrics_run_bs1):
    assert metrics_run_bs1.results["config"]["batch_size"] == "1"
    for task in TASKS:
        batched, alone = metrics_run.docs(task), metrics_run_bs1.docs(task)
        assert batched.keys() == alone.keys()
        for doc_id, row in batched.items():
            for name in ALL_METRICS:
                assert alone[doc_id][name] == pytest.approx(row[name], abs=1e-5), (task, name)
        for profile, summary in metrics_run.geometry[task]["profiles"].items():
            other = metrics_run_bs1.geometry[task]["profiles"][profile]["mean"]
            np.testing.assert_allclose(
                np.asarray(other, dtype=float), np.asarray(summary["mean"], dtype=float), atol=1e-5
            )


def test_metrics_named_in_output_of_lm_coupling_run(metrics_run_bs1):
    assert re.search(r"\|\s*coupling\s*\|", metrics_run_bs1.stdout)


RUNS = ("metrics_run", "metrics_run_bs1", "llama_run")  # batch 4, 1 and auto


@pytest.mark.parametrize("run_name", RUNS)
def test_every_document_is_captured_in_lm_evals_own_batches(run_name, request):
    run = request.getfixturevalue(run_name)
    info = run.results["config"]["lm_coupling"]
    assert set(info["capture"]) == set(TASKS)
    for task in TASKS:
        n_docs = len(run.docs(task))
        expected = {"in_batch": n_docs, "alone": 0, "cached": 0, "failed": 0}
        assert info["capture"][task] == expected, task
        assert run.geometry[task]["capture"] == expected, task
        measured = run.geometry[task]["n_measured"]
        assert measured == info["n_measured"][task]
        for name in ALL_METRICS:
            if name not in SAMPLED:
                assert measured[name] == n_docs, (task, name)
    if run_name == "llama_run":
        assert run.results["config"]["batch_size"] == "auto"
        # lm-eval's search found a batch holding several documents (with capture on).
        assert max(int(b) for b in run.results["config"]["batch_sizes"]) > 1


def _input_length(hflm, row) -> tuple[int, int]:
    """(tokens of the longest model input lm-eval built for a document, their budget)."""
    arguments = row["arguments"]
    first = arguments["gen_args_0"]
    if isinstance(first["arg_1"], dict):
        budget = MAX_LEN - first["arg_1"]["max_gen_toks"]
        return len(hflm.tok_encode(first["arg_0"])), budget
    lengths = []
    for request in arguments.values():
        context_enc, continuation_enc = hflm._encode_pair(request["arg_0"], request["arg_1"])
        lengths.append(len(context_enc) + len(continuation_enc) - 1)
    return max(lengths), MAX_LEN


@pytest.mark.parametrize(
    "task", ["lmc_arc_easy_offline", "lmc_winogrande_offline", "lmc_gsm8k_offline"]
)
def test_context_truncation_is_exercised(task, metrics_run, harness_setup, reference_hflm):
    # Log-likelihood, WinoGrande partial scoring and generation (left padding)
    # all have documents whose input lm-eval cut to the context window.
    hflm = reference_hflm(harness_setup.models["gpt2"])
    truncated = [
        doc_id
        for doc_id, row in metrics_run.docs(task).items()
        if _input_length(hflm, row)[0] > _input_length(hflm, row)[1]
    ]
    assert truncated, task
