"""Shared runs of the real lm-eval command line, offline on CPU.

Every CLI run here is a subprocess of the console scripts beside
``sys.executable`` (``lm_eval``, ``lm-coupling``) or of ``python -m
lm_coupling``; runs are session-scoped and shared between tests, so the whole
folder costs about ten runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fixtures.benchmarks import shared_benchmarks_dir
from harness_cli import (
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
    """Two tiny models (gpt2, llama) and 5 real items per benchmark, offline.

    HellaSwag (not in the shared folder) and the two `lmc_mmlu_sample`
    subjects missing from the real MMLU rows come from the bundled samples.
    """
    if shared_benchmarks_dir() is None:
        pytest.skip("the real benchmark items (/work/shared/benchmarks) are absent")
    from fixtures.benchmarks import write_offline_benchmarks

    from lm_coupling.demo.tiny import save_tiny_model, train_tokenizer

    root = tmp_path_factory.mktemp("harness")
    tokenizer = train_tokenizer()
    models = {
        name: save_tiny_model(
            root / name, name, tokenizer=tokenizer, init_std=0.2, max_len=MAX_LEN, seed=1
        )
        for name in ("gpt2", "llama")
    }
    data_dir = root / "data"
    write_offline_benchmarks(data_dir, n_items=5)
    add_sample_mmlu_subjects(data_dir / "mmlu")
    return HarnessSetup(root, models, data_dir)


@pytest.fixture(scope="session")
def stock_run(harness_setup) -> RunOutput:
    """Stock ``lm_eval`` without ``--metrics``: gpt2, batch 4, all six benchmarks."""
    cwd = harness_setup.root / "run_stock"
    return check_ok(run_cli("lm_eval", harness_setup.args("gpt2", 4), cwd))


@pytest.fixture(scope="session")
def metrics_run(harness_setup) -> RunOutput:
    """The literal ``lm_eval ... --metrics all``: gpt2, batch 4."""
    require_startup_hook()
    cwd = harness_setup.root / "run_metrics_bs4"
    return check_ok(run_cli("lm_eval", [*harness_setup.args("gpt2", 4), "--metrics", "all"], cwd))


@pytest.fixture(scope="session")
def metrics_run_bs1(harness_setup) -> RunOutput:
    """``lm-coupling run ... --metrics all``: gpt2, batch 1."""
    cwd = harness_setup.root / "run_metrics_bs1"
    args = [*harness_setup.args("gpt2", 1), "--metrics", "all"]
    return check_ok(run_cli("lm-coupling", args, cwd))


@pytest.fixture(scope="session")
def llama_run(harness_setup) -> RunOutput:
    """``python -m lm_coupling run --metrics all``, coupling on 2 documents: llama, batch 3."""
    cwd = harness_setup.root / "run_llama"
    args = [*harness_setup.args("llama", 3), "--metrics", "all"]
    args += ["--metric_args", "coupling_docs=2"]
    return check_ok(run_cli("python -m lm_coupling", args, cwd))


@pytest.fixture(scope="session")
def library_geometry():
    """``measure(model_path, sample_row)``: the library's value for the prompt alone."""
    import warnings

    import torch
    from lm_eval.models.huggingface import HFLM

    from lm_coupling.geometry import GeometryRunner
    from lm_coupling.selection import make_selection

    loaded: dict[Path, tuple[Any, GeometryRunner]] = {}

    def measure(model_path: Path, row: dict[str, Any]):
        if model_path not in loaded:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hflm = HFLM(pretrained=str(model_path), batch_size=1, device="cpu")
            loaded[model_path] = (hflm, GeometryRunner(hflm.model, make_selection("all")))
        hflm, runner = loaded[model_path]
        tokens, gold = prompt_of(hflm, row)
        return runner.measure_prompt(torch.tensor(tokens), gold, sampled=True)

    return measure
