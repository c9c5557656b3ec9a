"""Fixtures of the plugin tests: fake installed distributions with entry points."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """Factory that "installs" a one-module distribution into ``tmp_path``.

    ``fake_distribution(dist, module, source, entry_points)`` writes
    ``module.py`` and ``{dist}-0.1.dist-info/`` (METADATA and
    entry_points.txt in the ``lm_coupling`` group), then puts ``tmp_path``
    first on ``sys.path`` so that ``importlib.metadata`` finds it. The module
    is dropped from ``sys.modules`` at teardown.
    """
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(
        dist: str, module: str, source: str, entry_points: dict[str, str], version: str = "0.1"
    ) -> Path:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[lm_coupling]\n{lines}")
        importlib.invalidate_caches()
        monkeypatch.delitem(sys.modules, module, raising=False)
        return tmp_path

    return make
