"""Shared runs of the real lm-eval command line, offline on CPU.

Every CLI run here is a subprocess of the console scripts beside
``sys.executable`` (``lm_eval``, ``lm-coupling``) or of ``python -m
lm_coupling``; runs are session-scoped and shared between tests, also between
pytest-xdist workers (`shared_value`: each is launched once per test run), so the
whole folder costs about ten runs. The items are five real ones per benchmark from
``../shared/benchmarks`` when that folder is beside the checkout, else the
samples bundled with lm-coupling (a user's clone): the tests run in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fixtures.benchmarks import write_benchmark_items
from fixtures.shared import shared_value
from harness_cli import (
    LLAMA_METRIC_ARGS,
    MAX_LEN,
    HarnessSetup,
    RunOutput,
    add_sample_mmlu_subjects,
    check_ok,
    prompt_of,
    require_startup_hook,
    run_cli,
)


@pytest.fixture(scope="session")
def harness_setup(tmp_path_factory) -> HarnessSetup:
    """Two tiny models (gpt2, llama) and 5 items per benchmark, offline.

    Real items from ``../shared/benchmarks`` where present (HellaSwag, not in
    the shared folder, and the two `lmc_mmlu_sample` subjects missing from the
    real MMLU rows come from the bundled samples); else the bundled samples.
    """
    return shared_value(tmp_path_factory, "harness", _build_setup)


def _build_setup(root: Path) -> HarnessSetup:
    from fixtures.tiny import save_tiny_model, train_tokenizer

    tokenizer = train_tokenizer()
    models = {
        name: save_tiny_model(
            root / name, name, tokenizer=tokenizer, init_std=0.2, max_len=MAX_LEN, seed=1
        )
        for name in ("gpt2", "llama")
    }
    data_dir = root / "data"
    if write_benchmark_items(data_dir, n_items=5) == "real":
        add_sample_mmlu_subjects(data_dir / "mmlu")
    return HarnessSetup(root, models, data_dir)


@pytest.fixture(scope="session")
def stock_run(harness_setup, tmp_path_factory) -> RunOutput:
    """Stock ``lm_eval`` without ``--metrics``: gpt2, batch 4, all six benchmarks."""
    args = harness_setup.args("gpt2", 4)
    return shared_value(tmp_path_factory, "run_stock", _launch("lm_eval", args))


@pytest.fixture(scope="session")
def metrics_run(harness_setup, tmp_path_factory) -> RunOutput:
    """The literal ``lm_eval ... --metrics all``: gpt2, batch 4."""
    require_startup_hook()
    args = [*harness_setup.args("gpt2", 4), "--metrics", "all"]
    return shared_value(tmp_path_factory, "run_metrics_bs4", _launch("lm_eval", args))


@pytest.fixture(scope="session")
def metrics_run_bs1(harness_setup, tmp_path_factory) -> RunOutput:
    """``lm-coupling run ... --metrics all``: gpt2, batch 1."""
    args = [*harness_setup.args("gpt2", 1), "--metrics", "all"]
    return shared_value(tmp_path_factory, "run_metrics_bs1", _launch("lm-coupling", args))


@pytest.fixture(scope="session")
def llama_run(harness_setup, tmp_path_factory) -> RunOutput:
    """``python -m lm_coupling run --metrics all``: llama, batch auto, coupling on 2
    documents with a K (1000) the 32-wide model cannot hold."""
    args = [*harness_setup.args("llama", "auto"), "--metrics", "all"]
    args += ["--metric_args", LLAMA_METRIC_ARGS]
    return shared_value(tmp_path_factory, "run_llama", _launch("python -m lm_coupling", args))


def _launch(program: str, args: list[str]):
    """A `shared_value` build: run ``program`` in the folder it is given; fail on error."""
    return lambda cwd: check_ok(run_cli(program, args, cwd))


@pytest.fixture(scope="session")
def reference_hflm():
    """``hflm(model_path)``: lm-eval's own stock ``hf`` model, loaded once per path."""
    import warnings

    from lm_eval.models.huggingface import HFLM

    loaded: dict[Path, Any] = {}

    def load(model_path: Path):
        if model_path not in loaded:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded[model_path] = HFLM(pretrained=str(model_path), batch_size=1, device="cpu")
        return loaded[model_path]

    return load


@pytest.fixture(scope="session")
def library_geometry(reference_hflm):
    """``measure(model_path, sample_row)``: the library's value for the prompt alone."""
    import torch

    from lm_coupling.geometry import GeometryRunner
    from lm_coupling.selection import make_selection

    runners: dict[tuple[Path, str | None], GeometryRunner] = {}

    def measure(model_path: Path, row: dict[str, Any], metric_args: str | None = None):
        hflm = reference_hflm(model_path)
        if (model_path, metric_args) not in runners:
            selection = make_selection("all", metric_args)
            runners[model_path, metric_args] = GeometryRunner(hflm.model, selection)
        runner = runners[model_path, metric_args]
        tokens, gold = prompt_of(hflm, row)
        return runner.measure_prompt(torch.tensor(tokens), gold, sampled=True)

    return measure
