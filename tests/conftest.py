"""Shared fixtures: offline environment, tiny models, a locally trained tokenizer."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lm_coupling.demo.tiny import build_tiny_model, train_tokenizer  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests cleanly where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
