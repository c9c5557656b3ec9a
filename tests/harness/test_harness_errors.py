"""Bad input to ``lm_eval ... --metrics``: fail fast, name the problem and the choices.

One end-to-end process test per exit path: the literal ``lm_eval`` refusing a flag
(unknown metric), ``lm_eval`` with ``--metric_args`` alone (the start-up hook), a
refusal at model load (bidirectional model) and at data load (hub task offline);
``lm-coupling run``'s refusal before the task index is end to end in
``test_run_inputs.py``. The other messages are checked in-process through the same
command line (`run_in_process`).
"""

from __future__ import annotations

import json
import math
import re

import pytest
from harness_cli import (
    RunOutput,
    check_ok,
    require_startup_hook,
    result_key,
    run_cli,
    run_in_process,
)

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


def test_unknown_metric_option_lists_valid_ones(harness_setup, tmp_path, capsys, monkeypatch):
    args = [*harness_setup.args(), "--metrics", "lss", "--metric_args", "windowd=false"]
    stderr = _failed(run_in_process(args, tmp_path, capsys, monkeypatch))
    assert "unknown --metric_args option 'windowd'" in stderr
    assert "Did you mean 'windowed'?" in stderr
    assert "Options of the selected metrics: tokens, windowed" in stderr


def test_non_hf_model_names_supported_ones(harness_setup, tmp_path, capsys, monkeypatch):
    args = [*harness_setup.args(), "--metrics", "lss"]
    args[args.index("hf")] = "dummy"
    stderr = _failed(run_in_process(args, tmp_path, capsys, monkeypatch))
    assert "--model dummy cannot be combined with --metrics" in stderr
    assert "--model hf` (or hf-auto, huggingface" in stderr


def test_unsupported_architecture_fails_before_data(harness_setup, tmp_path, capsys, monkeypatch):
    import transformers
    from fixtures.tiny import train_tokenizer

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
    stderr = _failed(run_in_process(args, tmp_path, capsys, monkeypatch))
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


@pytest.mark.parametrize("program", ["lm_eval", "lm-coupling"])
def test_metric_args_without_metrics(program, harness_setup, tmp_path, capsys, monkeypatch):
    args = [*harness_setup.args(), "--metric_args", "k=3"]
    if program == "lm_eval":
        require_startup_hook()  # the hook also answers --metric_args alone: end to end
        run = run_cli(program, args, tmp_path)
    else:
        run = run_in_process(args, tmp_path, capsys, monkeypatch)
    stderr = _failed(run)
    assert "--metric_args was given but --metrics is missing" in stderr


def test_bad_options_all_listed_before_the_model_loads(
    harness_setup, tmp_path, capsys, monkeypatch
):
    args = [*harness_setup.args(), "--metrics", "lss,coupling"]
    args += ["--metric_args", "coupling_docs=0,nrom=l1,alignment_k=5"]
    stderr = _failed(run_in_process(args, tmp_path, capsys, monkeypatch))
    assert "3 problems with --metric_args" in stderr
    assert "coupling_docs=0 leaves coupling with no documents" in stderr
    assert "unknown --metric_args option 'nrom'. Did you mean 'norm'?" in stderr
    assert "option 'alignment_k' belongs to alignment_ratio, which is not selected" in stderr
    assert "Loading" not in stderr  # no model was loaded


def test_bidirectional_model_fails_at_load(harness_setup, tmp_path):
    import transformers
    from fixtures.tiny import train_tokenizer

    tokenizer = train_tokenizer()
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, initializer_range=0.2,
    )  # fmt: skip
    path = tmp_path / "bert"
    transformers.BertLMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    args = [*harness_setup.args(), "--metrics", "lss"]
    args[args.index("--model_args") + 1] = f"pretrained={path}"
    stderr = _failed(run_cli("lm-coupling", args, tmp_path))
    assert "BertLMHeadModel (model_type='bert') is not a causal decoder" in stderr
    assert "none of its metrics can run on this model" in stderr


def test_hub_task_offline_names_the_offline_variants(harness_setup, tmp_path):
    args = [*harness_setup.args(tasks="arc_easy"), "--metrics", "lss", "--limit", "1"]
    run = run_cli("lm-coupling", args, tmp_path)
    assert run.returncode != 0 and not run.results
    assert "lm-coupling: error: the data of" in run.stderr
    assert "Couldn't reach 'allenai/ai2_arc'" in run.stderr
    assert "lmc_arc_easy_offline" in run.stderr and "lmc_mmlu_offline" in run.stderr
    assert "$LM_COUPLING_DATA_DIR" in run.stderr


def test_run_accounts_for_every_task(metrics_run_bs1):
    run = metrics_run_bs1
    config = run.results["config"]
    assert config["model"] == "hf"
    assert config["lm_coupling"]["model_class"] == "hf-coupling"
    lines = [line for line in run.stderr.splitlines() if line.startswith("lm-coupling: ")]
    for task, document in run.geometry.items():
        n = document["n_documents"]
        (line,) = [line for line in lines if line.startswith(f"lm-coupling: {task}: ")]
        assert f"lss {n}/{n}" in line
        assert f"coupling {document['coupling']['n_sampled']}/{n} (sampled)" in line
        assert f"geometry_{task}_{run.timestamp}.json" in line
    assert not [line for line in lines if "ERROR" in line]
    assert "could not update the leaderboard" not in run.stderr
    assert (run.output_dir / "leaderboard.csv").is_file()


def test_leaderboard_without_geometry_rows(metrics_run_bs1, tmp_path):
    """A results folder whose runs carry no geometry value still gives a leaderboard."""
    from lm_coupling.report import write_leaderboard

    results = json.loads(json.dumps(metrics_run_bs1.results))
    geometry = set(results["config"]["lm_coupling"]["metrics"])
    for values in results["results"].values():
        for key in [k for k in values if k.split(",")[0].removesuffix("_stderr") in geometry]:
            del values[key]
    folder = tmp_path / "results" / "model"
    folder.mkdir(parents=True)
    (folder / f"results_{metrics_run_bs1.timestamp}.json").write_text(json.dumps(results))
    path = write_leaderboard(tmp_path / "results")
    assert path.is_file() and "arc" in path.read_text()
