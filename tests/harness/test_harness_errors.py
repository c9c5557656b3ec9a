"""Bad input to ``lm_eval ... --metrics``: fail fast, name the problem and the choices."""

from __future__ import annotations

import json
import math
import re

import pytest
from harness_cli import RunOutput, check_ok, require_startup_hook, result_key, run_cli

pytestmark = pytest.mark.slow

DATA_LOADING = "Building contexts"  # lm-eval's log line once documents are read


def _failed(run: RunOutput) -> str:
    assert run.returncode != 0, run.stdout[-2000:]
    assert DATA_LOADING not in run.stderr
    assert not run.results
    return run.stderr


def test_unknown_metric_suggests_the_right_one(harness_setup, tmp_path):
    require_startup_hook()
    run = run_cli("lm_eval", [*harness_setup.args(), "--metrics", "cuopling"], tmp_path)
    stderr = _failed(run)
    assert "unknown metric 'cuopling'" in stderr
    assert "Did you mean 'coupling'?" in stderr
    assert re.search(r"Available metrics: lss, .*alignment_ratio", stderr)


def test_unknown_metric_option_lists_valid_ones(harness_setup, tmp_path):
    args = [*harness_setup.args(), "--metrics", "lss", "--metric_args", "windowd=false"]
    stderr = _failed(run_cli("lm-coupling", args, tmp_path))
    assert "unknown --metric_args option 'windowd'" in stderr
    assert "Did you mean 'windowed'?" in stderr
    assert "Options of the selected metrics: tokens, windowed" in stderr


def test_non_hf_model_names_supported_ones(harness_setup, tmp_path):
    require_startup_hook()
    args = [*harness_setup.args(), "--metrics", "lss"]
    args[args.index("hf")] = "dummy"
    stderr = _failed(run_cli("lm_eval", args, tmp_path))
    assert "--model 'dummy' is not supported" in stderr
    assert "Use one of: hf, hf-auto, huggingface" in stderr


def test_unsupported_architecture_fails_before_data(harness_setup, tmp_path):
    import transformers

    from lm_coupling.demo.tiny import train_tokenizer

    tokenizer = train_tokenizer()
    config = transformers.T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=0,
    )  # fmt: skip
    path = tmp_path / "t5"
    transformers.T5ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    args = [*harness_setup.args(), "--metrics", "lss"]
    args[args.index("--model_args") + 1] = f"pretrained={path}"
    stderr = _failed(run_cli("lm-coupling", args, tmp_path))
    assert "model_type='t5'" in stderr
    assert "Looked for a decoder-only model" in stderr
    assert "register_override" in stderr


def test_limit_one_document(harness_setup, tmp_path):
    require_startup_hook()
    args = [*harness_setup.args("gpt2", 4), "--metrics", "all", "--limit", "1"]
    run = check_ok(run_cli("lm_eval", args, tmp_path))
    assert run.geometry
    for task, document in run.geometry.items():
        assert document["n_documents"] == 1
        assert document["coupling"]["n_sampled"] == 1
        assert document["profiles"]["norm"]["n"] == [1] * 4
        values = run.results["results"][task]
        assert math.isfinite(values[result_key(task, "lss")])
        assert values[result_key(task, "lss_stderr")] == "N/A"
        (row,) = run.docs(task).values()
        assert row["lss"] == values[result_key(task, "lss")]


EMPTY_TASK = """task: lmc_test_empty
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: 0
doc_to_choice: ["yes", "no"]
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def _last_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _raising_frame(stderr: str) -> str:
    frames = [line for line in stderr.splitlines() if line.strip().startswith('File "')]
    return frames[-1] if frames else ""


def test_task_without_documents_behaves_like_stock(harness_setup, tmp_path):
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    path = json.dumps(str(tmp_path / "empty.jsonl"))
    (tasks_dir / "lmc_test_empty.yaml").write_text(EMPTY_TASK.format(path=path))
    args = harness_setup.args("gpt2", 4, "lmc_test_empty")
    args[args.index("--include_path") + 1] = str(tasks_dir)
    stock = run_cli("lm_eval", args, tmp_path / "stock")
    geometry = run_cli("lm-coupling", [*args, "--metrics", "all"], tmp_path / "geometry")
    assert (geometry.returncode == 0) == (stock.returncode == 0), geometry.stderr[-3000:]
    assert "lm-coupling: error" not in geometry.stderr
    if stock.returncode != 0:
        # lm-eval's own error, raised where stock raises it, not in lm-coupling.
        assert _last_error_line(geometry.stderr) == _last_error_line(stock.stderr)
        assert _raising_frame(geometry.stderr) == _raising_frame(stock.stderr)
        assert "lm_coupling" not in _raising_frame(geometry.stderr)
    else:
        assert not geometry.geometry
