"""``bench/census.py`` on a fixed sample, and ``docs/architectures.md`` as its rendering.

The sample (GPT-2 and Llama: key/value caches; Gemma-2: sliding windows
shorter than the right-padded batch's padding, soft-capping; Mamba: every
cache layer a recurrent state; Bamba: Mamba-2 layers beside attention;
Qwen3-Next: gated delta-rule layers beside attention; Jamba: blocks of two
classes, Mamba and attention; DeepSeek-V3.2: indexer attention keeping 4 keys
of 8 to 16; xLSTM: mLSTM cells, a final norm and soft-cap of its own;
OpenAI-GPT: no cache) runs as a user runs the script, in a subprocess; each
must be verified: coupling and
LSS equal the independent whole-sequence values to 1e-5, in a batch of four
right-padded documents and alone. On a transformers older than the pinned
one, the sample leaves out what that release lacks or computes differently
(``tests/fixtures/transformers_range.py``: Qwen3-Next and DeepSeek-V3.2 are
newer than 4.56, whose xLSTM fails on prompts longer than a chunk).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from fixtures.transformers_range import VERSION, installed, is_fixed
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = {
    "gpt2": "cache",
    "llama": "cache",
    "gemma2": "cache",
    "mamba": "sequence",
    "bamba": "sequence",
    "qwen3_next": "sequence",
    "jamba": "sequence",
    "deepseek_v32": "sequence",
    "xlstm": "sequence",
    "openai-gpt": "sequence",
}
RUNNABLE = {
    m: r for m, r in SAMPLE.items() if installed(m) and (m != "xlstm" or is_fixed("xlstm chunks"))
}
"""The sample the installed transformers can run (all of it on the pinned release)."""


def test_the_sample_is_verified(tmp_path):
    out = tmp_path / "census.json"
    subprocess.run(
        [sys.executable, "bench/census.py", "--only", ",".join(RUNNABLE), "--json", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=900,
    )
    rows = {row["model_type"]: row for row in json.loads(out.read_text())}
    assert {m: (r["status"], r["reason"]) for m, r in rows.items()} == {
        m: ("verified", "") for m in RUNNABLE
    }
    assert {m: r["replay"] for m, r in rows.items()} == RUNNABLE
    assert all(r["coupling_error"] <= 1e-5 and r["lss_error"] <= 1e-5 for r in rows.values())
    assert len(rows["jamba"]["blocks"]) == 2  # attention and Mamba blocks in one list


def test_the_census_page_covers_the_installed_mapping():
    """docs/architectures.md: the installed transformers, one row per mapping entry, counts."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    page = (ROOT / "docs" / "architectures.md").read_text()
    documented = re.search(r"transformers (\d+\.\d+\.\d+)", page).group(1)
    if Version(VERSION) < Version(documented):
        pytest.skip(
            f"docs/architectures.md is the census of transformers {documented}, not of the "
            f"older {VERSION} installed (bench/census.py renders the page for one release)"
        )
    assert f"transformers {transformers.__version__}" in page
    rows = re.findall(r"^\| ([^|]+?) \| ([\w ]+?) \|", page, flags=re.M)[1:]  # header first
    assert [name for name, _ in rows] == list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    statuses = [status for _, status in rows]
    verified = statuses.count("verified")
    text = len(statuses) - statuses.count("skipped") - statuses.count("not run")
    assert f"**{verified} of {text} text causal LMs run verified**" in page
    for name, status in rows:
        if status in ("verified", "skipped"):
            continue
        line = next(x for x in page.splitlines() if x.startswith(f"| {name} |"))
        assert line.rsplit("|", 2)[-2].strip(), f"{name} is {status} without a reason"
