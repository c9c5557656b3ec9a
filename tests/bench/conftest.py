"""The bench scripts as modules: they run as ``python bench/<script>.py`` and import each other."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_module(monkeypatch):
    """``bench_module(name)`` imports ``bench/<name>.py`` with ``bench/`` on ``sys.path``.

    The path is taken away again after the test (the module stays imported).
    """
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module
