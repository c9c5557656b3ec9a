"""Bad model and data input is refused before the model loads, with the fix, through the CLI.

Each case runs the real ``lm-coupling run`` command line and checks the exit
code, the message, and that the output folder (holding an earlier file) is
exactly as it was. The models named here are never loaded: a folder with an
empty ``config.json`` would fail at loading, so a refusal that came late would
show another message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def _refused(tmp_path: Path, model_args: str, *extra: str, python: list[str] | None = None):
    """Run the CLI on ``model_args``; return (exit code, stderr, output folder unchanged)."""
    out = tmp_path / "results"
    out.mkdir(exist_ok=True)
    (out / "earlier.json").write_text('{"kept": true}\n', encoding="utf-8")
    before = _snapshot(out)
    command = python or [str(BIN / "lm-coupling")]
    done = subprocess.run(
        [
            *command, "run", "--model", "hf", "--model_args", model_args,
            "--tasks", "lmc_arc_easy_offline", "--metrics", "lss", "--limit", "2",
            "--output_path", str(out), *extra,
        ],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )  # fmt: skip
    return done.returncode, done.stderr, _snapshot(out) == before


def _write_gguf(path: Path, quantization: str, architecture: str = "llama") -> Path:
    """A small GGUF file (``architecture`` header) whose embedding is stored as ``quantization``."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    qtype = GGMLQuantizationType[quantization]
    _, type_size = GGML_QUANT_SIZES[qtype]
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((2, type_size), np.uint8), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unreadable_gguf_quantization_is_named(tmp_path):
    """Q8_K, which gguf cannot dequantize, is refused naming the type and what to do."""
    _write_gguf(tmp_path / "model.Q8_K.gguf", "Q8_K")
    code, err, unchanged = _refused(tmp_path, f"pretrained={tmp_path},gguf_file=model.Q8_K.gguf")
    assert code == 2 and unchanged, err[-2000:]
    assert "stores tensors as Q8_K" in err and "cannot dequantize" in err
    assert "llama-quantize" in err and "Traceback" not in err


def test_gguf_architecture_transformers_cannot_load_is_named(tmp_path):
    """An RWKV-6 GGUF (llama.cpp reads it, transformers' GGUF loader does not) is refused early."""
    from lm_coupling.harness.gguf_checkpoint import transformers_architectures

    assert "rwkv6" not in transformers_architectures() and "llama" in transformers_architectures()
    _write_gguf(tmp_path / "model.gguf", "Q4_1", architecture="rwkv6")
    code, err, unchanged = _refused(tmp_path, f"pretrained={tmp_path},gguf_file=model.gguf")
    assert code == 2 and unchanged, err[-2000:]
    assert "architecture 'rwkv6'" in err and "cannot load it from GGUF" in err, err[-2000:]
    assert "llama" in err and "no gguf_file=" in err and "Traceback" not in err


def test_renamed_gguf_architecture_passes_the_check(tmp_path):
    """llama.cpp's ``qwen2moe`` is transformers' ``qwen2_moe``: the check follows the rename."""
    from lm_coupling.harness.gguf_checkpoint import check_gguf

    _write_gguf(tmp_path / "model.gguf", "Q4_1", architecture="qwen2moe")
    header = check_gguf({"pretrained": str(tmp_path), "gguf_file": "model.gguf"})
    assert header["architecture"] == "qwen2moe"


def test_readable_quantization_passes_the_check(tmp_path):
    """Q4_1 (SmolLM2's) passes the header check; the run then goes on to lm-eval's loading."""
    from lm_coupling.harness.gguf_checkpoint import check_gguf

    _write_gguf(tmp_path / "model.Q4_1.gguf", "Q4_1")
    header = check_gguf({"pretrained": str(tmp_path), "gguf_file": "model.Q4_1.gguf"})
    assert header["quantization"] == "Q4_1" and header["architecture"] == "llama"
    assert header["tensor_types"] == {"F32": 1, "Q4_1": 1}


@pytest.mark.parametrize("route", ["gguf_file", "pretrained"])
def test_a_file_that_is_not_gguf_is_refused(tmp_path, route):
    """A safetensors-like file as gguf_file=, or any file as pretrained=, names the right form."""
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    if route == "gguf_file":
        args = f"pretrained={tmp_path},gguf_file=model.safetensors"
        expected = ("is not a GGUF file", "drop gguf_file= and give pretrained=<the folder")
    else:
        args = f"pretrained={tmp_path / 'model.safetensors'}"
        expected = ("is a file, not a model", "pretrained=<folder>,gguf_file=<file.gguf>")
    code, err, unchanged = _refused(tmp_path, args)
    assert code == 2 and unchanged, err[-2000:]
    assert all(words in err for words in expected) and "Traceback" not in err


def test_without_the_gguf_reader_the_extra_is_named(tmp_path):
    """With the gguf package unimportable, the run names lm-coupling[gguf] before loading."""
    _write_gguf(tmp_path / "model.Q4_1.gguf", "Q4_1")
    blocked = (
        "import sys; sys.modules['gguf'] = None; from lm_coupling.cli import main; "
        "sys.argv[0] = 'lm-coupling'; main()"
    )
    code, err, unchanged = _refused(
        tmp_path, f"pretrained={tmp_path},gguf_file=model.Q4_1.gguf",
        python=[sys.executable, "-c", blocked],
    )  # fmt: skip
    assert code == 2 and unchanged, err[-2000:]
    assert "pip install 'lm-coupling[gguf]'" in err and "Traceback" not in err


def test_data_folder_without_the_few_shot_split(tmp_path):
    """ARC-Easy files with a test split only: refused naming train.jsonl, before the model."""
    data = tmp_path / "data" / "arc_easy"
    data.mkdir(parents=True)
    row = {
        "id": "q1", "question": "Which is a liquid?", "answerKey": "A",
        "choices": {"text": ["water", "rock"], "label": ["A", "B"]},
    }  # fmt: skip
    (data / "test.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    model = tmp_path / "never-loaded"
    model.mkdir()
    (model / "config.json").write_text("{}", encoding="utf-8")
    code, err, unchanged = _refused(
        tmp_path, f"pretrained={model}",
        "--metadata", json.dumps({"lmc_data_dir": str(tmp_path / "data")}),
    )  # fmt: skip
    assert code == 2 and unchanged, err[-2000:]
    assert "lmc_arc_easy_offline" in err and f"{data / 'train.jsonl'}" in err
    assert "few-shot" in err and "found: test.jsonl" in err and "Traceback" not in err
