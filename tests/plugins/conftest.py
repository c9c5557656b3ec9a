"""Fixtures of the plugin tests: the example package installed by pip, fake distributions."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lmc-plugin-example"


@pytest.fixture(scope="session")
def example_site(tmp_path_factory) -> Path:
    """A folder where pip installed the example package (from a copy: no build files here)."""
    site = tmp_path_factory.mktemp("example") / "site"
    source = site.parent / "example-source"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    command += ["--no-index", "--quiet", "--target", str(site), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert any(site.glob("lmc_plugin_example-0.1.0.dist-info/entry_points.txt"))
    return site


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
