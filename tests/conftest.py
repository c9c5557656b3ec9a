"""Shared fixtures: offline environment, tiny models, a locally trained tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

# Under pytest-xdist every worker, and every lm_eval process it launches, gets its share
# of the cores: torch's default of one thread per core in each of them oversubscribes
# the machine. Set before torch is imported (it reads OMP_NUM_THREADS once).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))

import random  # noqa: E402

import numpy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from fixtures.shared import shared_value  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fixtures.tiny import build_tiny_model, train_tokenizer  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent


# The longest files, longest first, as `--durations` measured them (whole file, fixtures
# included). Only an ordering hint: a file missing here runs with the other slow files.
LONGEST_FILES = (
    "real/test_real_smollm2.py",
    "real/test_real_references.py",
    "harness/test_lm_eval_options.py",
    "harness/test_library_core.py",
    "report/test_report_build.py",
    "harness/test_resume.py",
    "harness/test_harness_errors.py",
    "harness/test_harness_runs.py",
    "sweep/test_sweep_end_to_end.py",
    "harness/test_harness_cache.py",
    "demo/test_bundled_demo.py",
    "bench/test_bench_gpu.py",
    "harness/test_harness_data_parallel.py",
)


def _file_rank(path, slow_files) -> int:
    """0, 1, ... for `LONGEST_FILES`; then other files with slow tests; then the rest."""
    name = path.relative_to(TESTS_DIR).as_posix()
    if name in LONGEST_FILES:
        return LONGEST_FILES.index(name)
    return len(LONGEST_FILES) + (path not in slow_files)


def pytest_collection_modifyitems(config, items):
    """Run the longest files first; skip `gpu` tests cleanly where CUDA is absent.

    Longest first: pytest-xdist hands out whole files (``--dist loadfile``) in this
    order, so the long ones start at once and the short ones fill the gaps at the end
    instead of one long file running alone last. Order within a file is kept.
    """
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: _file_rank(item.path, slow_files))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_random_state():
    """Seed torch, numpy and `random` before each test: the same draws in any order.

    Under pytest-xdist a test's unseeded draws otherwise depend on which tests ran
    before it in the same worker. ``LMC_TEST_SEED`` (0 by default) picks another
    seed, to check that a test holds for more than one draw.
    """
    seed = int(os.environ.get("LMC_TEST_SEED", "0"))
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="session")
def tokenizer():
    """A byte-level BPE tokenizer trained here, offline."""
    return train_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """Factory of cached tiny models: ``tiny_model("llama", dtype=torch.float64)``."""
    cache = {}

    def make(model_type: str = "gpt2", dtype: torch.dtype = torch.float32, seed: int = 0, **sizes):
        key = (model_type, dtype, seed, tuple(sorted(sizes.items())))
        if key not in cache:
            model = build_tiny_model(model_type, len(tokenizer), seed=seed, dtype=dtype, **sizes)
            # Assert the built sizes: misspelled config attributes are silently ignored.
            assert model.config.hidden_size == sizes.get("d_model", 32)
            assert model.config.num_hidden_layers == sizes.get("n_layers", 3)
            cache[key] = model
        return cache[key]

    return make


@pytest.fixture(scope="session")
def trained_family(tmp_path_factory):
    """A folder holding ``fam/``: two checkpoints of one run and its held-out tasks.

    ``fam/tiny/step1200`` is the bundled trained model, ``fam/tiny/step0`` its
    architecture and tokenizer at a seeded initialisation, ``fam/tasks_data`` the
    bundled items. Made once per test run (`shared_value`), read by the sweep;
    tests write their outputs beside ``fam/`` under names of their own.
    """
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from lm_coupling.demo.assets import bundled_model_path, bundled_tasks_data_path

    def make(root):
        run = root / "fam" / "tiny"
        shutil.copytree(bundled_model_path(), run / "step1200")
        shutil.copytree(bundled_model_path(), run / "step0")
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(bundled_model_path(), local_files_only=True)
        AutoModelForCausalLM.from_config(config).save_pretrained(run / "step0")
        shutil.copytree(bundled_tasks_data_path(), root / "fam" / "tasks_data")
        return root

    return shared_value(tmp_path_factory, "trained_family", make)
