"""Every lm-eval ``run`` option with ``--metrics``: the outcomes of docs/options.md, run for real.

Four launches of the real ``lm_eval`` command share the options that
combine (see each fixture), plus two cheap launches that stop before any
model loads. For each option that *works*, the run exits 0, every
document's geometry is captured inside lm-eval's own batches (``alone ==
0``), the values equal an independent measurement of the exact prompt
lm-eval scored (read back from the samples JSONL), and
``config.lm_coupling.lm_eval_options`` records the option.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.catalogue import sampled_metrics
from harness_cli import (
    MAX_LEN,
    TASKS_DIR,
    RunOutput,
    check_ok,
    prompt_of,
    require_startup_hook,
    run_cli,
    run_in_process,
)

from lm_coupling.errors import ConfigurationError
from lm_coupling.harness import run_options

REPO = Path(__file__).resolve().parents[2]
DOCS_PAGE = REPO / "docs" / "options.md"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ARC, GSM8K = "lmc_arc_easy_offline", "lmc_gsm8k_offline"
SAMPLES = {ARC: [1, 3, 4], GSM8K: [0, 2]}
COUPLING_DOCS = 2
SAMPLED = sampled_metrics()
FLOAT32_ABS = 1e-4  # batched vs alone in float32 (as tests/harness/test_harness_runs.py)
DTYPE_RTOL, DTYPE_ATOL = 1e-3, 1e-4  # half precision vs alone (docs/options.md)


# -- the checks and the page ------------------------------------------------------


def _run_parser():
    from lm_coupling.harness.cli import run_parser

    return run_parser()


def _parse(*argv: str):
    return _run_parser().parse_args(["run", "--tasks", "t", *argv])


def test_the_docs_page_names_every_flag():
    run = _run_parser()._subparsers._group_actions[0].choices["run"]
    flags = {s for a in run._actions for s in a.option_strings if s.startswith("--")}
    assert "--apply_chat_template" in flags  # the parser was read
    page = DOCS_PAGE.read_text(encoding="utf-8")
    for flag in flags - {"--help", "--metrics", "--metric_args"}:
        assert f"| `{flag}` |" in page, flag


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--predict_only"], "--predict_only cannot be combined with --metrics"),
        (["--model", "vllm"], "--model vllm cannot be combined"),
        (["--model_args", "pretrained=m,backend=seq2seq"], "decoder-only"),
        (["--model_args", "pretrained=m,peft=a,delta=b"], "peft=a and delta=b"),
        (["--model_args", "pretrained=m,tp_plan=auto"], "parallelize=True"),
        (["--model_args", "pretrained=m,load_in_8bit=True", "--device", "cpu"], "CUDA"),
        (["--model_args", "pretrained=m,autogptq=True", "--device", "cpu"], "CUDA"),
        (["--model_args", "pretrained=m,gptqmodel=True", "--device", "cpu"], "CUDA"),
    ],
)
def test_refusals_before_the_model_loads(argv, message):
    with pytest.raises(ConfigurationError, match="Instead: ") as caught:
        run_options.check_run_options(_parse(*argv))
    assert message in str(caught.value)


def test_a_quantized_checkpoint_is_refused_without_a_gpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"bits": 4}}))
    args = _parse("--model_args", f"pretrained={tmp_path}", "--device", "cpu")
    with pytest.raises(ConfigurationError, match="quantization_config"):
        run_options.check_run_options(args)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert run_options.check_run_options(args) == {}  # an unquantized checkpoint loads


def test_options_from_a_config_file_are_checked(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("predict_only: true\n")
    with pytest.raises(ConfigurationError, match="--predict_only"):
        run_options.check_run_options(_parse("--config", str(config)))
    config.write_text("num_fewshot: 3\nmodel_args: {pretrained: m, dtype: bfloat16}\n")
    used = run_options.check_run_options(_parse("--config", str(config), "--num_fewshot", "1"))
    assert used == {"config": str(config), "num_fewshot": 1, "dtype": "bfloat16"}


def test_recorded_options_are_those_set():
    args = _parse(
        "--model_args", "pretrained=m,peft=adapter,revision=step1", "--apply_chat_template",
        "--samples", json.dumps(SAMPLES), "--seed", "5", "--limit", "0",
    )  # fmt: skip
    used = run_options.check_run_options(args)
    assert used == {
        "apply_chat_template": True,
        "samples": SAMPLES,
        "seed": [5, 5, 5, 5],
        "limit": 0.0,
        "peft": "adapter",
        "revision": "step1",
    }
    json.dumps(used)  # JSON-safe
    hub = run_options.check_run_options(_parse("--hf_hub_log_args", "hub_results_org=o,token=t"))
    assert hub == {"hf_hub_log_args": {"hub_results_org": "o", "token": "<redacted>"}}


# -- the launches -------------------------------------------------------------------


def _save_chat_model(root: Path) -> Path:
    from fixtures.tiny import save_tiny_model, train_tokenizer

    tokenizer = train_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return save_tiny_model(
        root / "gpt2_chat", "gpt2", tokenizer=tokenizer, init_std=0.2, max_len=MAX_LEN, seed=1
    )


def _save_lora(base: Path, path: Path) -> Path:
    """A LoRA adapter with random (non-zero) A and B: it changes the function."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(  # GPT-2's Conv1D stores weights transposed: fan_in_fan_out
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True
    )
    config.init_lora_weights = False
    torch.manual_seed(3)
    adapted = get_peft_model(model, config)
    # No embedding layer is adapted; saying so spares peft's hub probe for the base's config,
    # which warns offline on older peft (0.10, the floor).
    adapted.save_pretrained(path, save_embedding_layers=False)
    return path


def _full_mmlu(data_dir: Path, out: Path) -> Path:
    """A copy of ``data_dir`` whose MMLU files hold every subject (rows relabelled)."""
    shutil.copytree(data_dir, out)
    subjects = sorted(
        p.stem.removeprefix("lmc_mmlu_offline_")
        for p in (TASKS_DIR / "mmlu").glob("lmc_mmlu_offline_*.yaml")
    )
    for split in ("dev", "test"):
        path = out / "mmlu" / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        have = {row["subject"] for row in rows}
        missing = [subject for subject in subjects if subject not in have]
        # Distinct prompt ends: lm-eval keeps the last 128 tokens, and two documents
        # with one model input share one batch row (the second is measured alone).
        extra = [
            {
                **rows[i % len(rows)],
                "subject": name,
                "choices": [f"{c} ({name})" for c in rows[i % len(rows)]["choices"]],
            }
            for i, name in enumerate(missing)
        ]
        path.write_text("\n".join(json.dumps(r) for r in rows + extra) + "\n")
    return out


@pytest.fixture(scope="session")
def options_setup(harness_setup) -> dict[str, Path]:
    """The harness models and items, plus a chat model, a LoRA adapter and delta weights."""
    from fixtures.tiny import save_tiny_model, train_tokenizer

    root = harness_setup.root / "options"
    chat = _save_chat_model(root)
    return {
        "chat": chat,
        "lora": _save_lora(chat, root / "lora"),
        "delta": save_tiny_model(
            root / "delta",
            "gpt2",
            tokenizer=train_tokenizer(),
            init_std=0.02,
            max_len=MAX_LEN,
            seed=2,
        ),  # fmt: skip
        "gpt2": harness_setup.models["gpt2"],
        "llama": harness_setup.models["llama"],
        "data": harness_setup.data_dir,
        "full_data": _full_mmlu(harness_setup.data_dir, root / "data_all_subjects"),
        "root": root,
    }


def _common(setup: dict[str, Path], data: str = "data") -> list[str]:
    return [
        "--include_path", str(TASKS_DIR),
        "--metadata", json.dumps({"lmc_data_dir": str(setup[data])}),
        "--log_samples",
    ]  # fmt: skip


def _launch(cwd: Path, args: list[str], env: dict[str, str] | None = None) -> RunOutput:
    require_startup_hook()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LM_HARNESS_CACHE_PATH", str(cwd / "lm_eval_cache"))
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        return run_cli("lm_eval", args, cwd)


def _read_named(run: RunOutput, stem: str) -> RunOutput:
    """Outputs of ``--output_path results/<stem>.json`` (lm-eval: ``<stem>_<date>.json``)."""
    found = sorted(run.output_dir.glob(f"{stem}_*.json"))
    if not found:
        pytest.fail(f"no {stem}_*.json in {run.output_dir}:\n{run.stderr[-4000:]}")
    run.timestamp = found[-1].stem.removeprefix(f"{stem}_")
    run.results = json.loads(found[-1].read_text(encoding="utf-8"))
    for file in run.output_dir.glob(f"samples_*_{run.timestamp}.jsonl"):
        task = file.name.removeprefix("samples_").removesuffix(f"_{run.timestamp}.jsonl")
        run.samples[task] = [json.loads(x) for x in file.read_text().splitlines() if x.strip()]
    for file in run.output_dir.glob(f"geometry_*_{run.timestamp}.json"):
        document = json.loads(file.read_text(encoding="utf-8"))
        run.geometry[document["task"]] = document
    return run


@pytest.fixture(scope="session")
def adapter_run(options_setup) -> RunOutput:
    """gpt2 with a LoRA adapter and a chat template: few-shot as multi-turn, a system
    instruction, 2-shot, seed, generation kwargs, chosen documents, cached requests,
    batch auto:2 capped at 2, write_out, show_config, W&B offline, results file name."""
    s = options_setup
    cwd = s["root"] / "run_adapter"
    args = [
        "--model", "hf", "--model_args", f"pretrained={s['chat']},peft={s['lora']}",
        "--tasks", f"{ARC},{GSM8K}", *_common(s),
        "--apply_chat_template", "--fewshot_as_multiturn", "--system_instruction",
        "Answer briefly.", "--num_fewshot", "2", "--seed", "7", "--gen_kwargs",
        "max_gen_toks=8", "--samples", json.dumps(SAMPLES), "--cache_requests",
        "--batch_size", "auto:2", "--max_batch_size", "2", "--write_out", "--show_config",
        "--wandb_args", "project=lmc,mode=offline", "--output_path", "results/adapter.json",
        "--metrics", "all", "--metric_args", f"coupling_docs={COUPLING_DOCS}",
    ]  # fmt: skip
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(cwd), "WANDB_SILENT": "true"}
    run = _launch(cwd, args, env)
    if run.returncode != 0:
        pytest.fail(f"CLI run failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    return _read_named(run, "adapter")


def test_the_recorded_sample_is_the_coupled_documents_under_samples(adapter_run):
    # lm-eval numbers a --samples document's requests by its position in the list
    # (0, 1, ...) and reports it by the listed index: the sample is drawn over the
    # listed documents and matched to their requests (lm_eval_adapter.evaluated_documents).
    for task in (ARC, GSM8K):
        assert adapter_run.geometry[task]["sample"]["population"] == len(SAMPLES[task])
        recorded = set(adapter_run.geometry[task]["sample"]["doc_ids"]["coupling_docs"])
        coupled = {row["doc_id"] for row in _first_rows(adapter_run, task) if "coupling" in row}
        assert coupled == recorded and len(recorded) == COUPLING_DOCS, (task, coupled, recorded)


@pytest.fixture(scope="session")
def dtype_run(options_setup) -> RunOutput:
    """``--model hf-auto``, llama in bfloat16 with revision= and trust_remote_code, a
    fractional --limit."""
    s = options_setup
    model_args = f"pretrained={s['llama']},dtype=bfloat16,revision=main,trust_remote_code=True"
    args = [
        "--model", "hf-auto", "--model_args", model_args, "--trust_remote_code",
        "--tasks", f"{ARC},{GSM8K}", *_common(s), "--limit", "0.6", "--batch_size", "4",
        "--gen_kwargs", "max_gen_toks=16",
        "--output_path", "results", "--metrics", "all",
        "--metric_args", f"coupling_docs={COUPLING_DOCS}",
    ]  # fmt: skip
    return check_ok(_launch(s["root"] / "run_dtype", args))


@pytest.fixture(scope="session")
def delta_run(options_setup) -> RunOutput:
    """gpt2 plus delta weights, in float16."""
    s = options_setup
    args = [
        "--model", "hf", "--model_args", f"pretrained={s['gpt2']},delta={s['delta']},dtype=float16",
        "--tasks", ARC, *_common(s), "--limit", "3", "--batch_size", "2",
        "--output_path", "results", "--metrics", "lss,expodistance,equidistance,logit_lens_entropy",
    ]  # fmt: skip
    return check_ok(_launch(s["root"] / "run_delta", args))


@pytest.fixture(scope="session")
def group_run(options_setup) -> RunOutput:
    """The Open LLM v1 group of groups (MMLU's 57 subjects inside), one document each."""
    s = options_setup
    args = [
        "--model", "hf", "--model_args", f"pretrained={s['llama']}",
        "--tasks", "lmc_openllm_v1_offline", *_common(s, "full_data"), "--limit", "1",
        "--num_fewshot", "1", "--gen_kwargs", "max_gen_toks=16", "--batch_size", "8",
        "--output_path", "results",
        "--metrics", "lss,logit_lens_entropy",
    ]  # fmt: skip
    return check_ok(_launch(s["root"] / "run_group", args))


# -- independent references -----------------------------------------------------------


def _reference_runner(model, metric_args: str | None = None):
    from lm_coupling.geometry import GeometryRunner
    from lm_coupling.selection import make_selection

    return GeometryRunner(model.eval(), make_selection("all", metric_args))


def _first_rows(run: RunOutput, task: str) -> list[dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for row in run.samples[task]:
        rows.setdefault(row["doc_id"], row)
    return [rows[k] for k in sorted(rows)]


def _assert_equals_reference(
    run: RunOutput, task: str, hflm, runner, abs_tol: float, rel_tol: float = 0.0,
    sampled_docs: int | None = None,
) -> int:  # fmt: skip
    """Every row's geometry equals the runner's measurement of the prompt lm-eval scored."""
    rows = _first_rows(run, task)
    assert rows
    metrics = run.results["config"]["lm_coupling"]["metrics"]
    # The coupling sample is seeded and random (harness/sample.py); the file names it.
    # A run without sampled metrics draws no sample and records none.
    recorded = run.geometry[task].get("sample", {}).get("doc_ids", {})
    sample = set(recorded.get("coupling_docs", ()))
    if sampled_docs is not None:
        assert len(sample) == min(sampled_docs, len(rows))
    for row in rows:
        tokens, gold = prompt_of(hflm, row)
        in_sample = row["doc_id"] in sample
        reference = runner.measure_prompt(torch.tensor(tokens), gold, sampled=in_sample)
        for name in metrics:
            if name in SAMPLED and not in_sample:
                continue
            expected = reference.values[name]
            if math.isfinite(expected):
                assert row[name] == pytest.approx(expected, abs=abs_tol, rel=rel_tol), (
                    task, row["doc_id"], name,
                )  # fmt: skip
            else:
                assert name not in row, (task, row["doc_id"], name)
        for name in SAMPLED:
            assert (name in row) == in_sample or name not in metrics
    capture = run.geometry[task]["capture"]
    assert capture["alone"] == 0 and capture["failed"] == 0
    assert capture["in_batch"] == len(rows)
    return len(rows)


def _lm_eval_options(run: RunOutput) -> dict[str, Any]:
    return run.results["config"]["lm_coupling"]["lm_eval_options"]


# -- the tests of the launches ----------------------------------------------------------


@pytest.mark.slow
def test_adapter_chat_template_and_samples(adapter_run, options_setup, reference_hflm):
    import transformers
    from peft import PeftModel

    s = options_setup
    base = transformers.AutoModelForCausalLM.from_pretrained(s["chat"])
    merged = PeftModel.from_pretrained(base, s["lora"]).merge_and_unload()
    plain = transformers.AutoModelForCausalLM.from_pretrained(s["chat"])
    changed = [
        not torch.equal(a, b)
        for a, b in zip(merged.state_dict().values(), plain.state_dict().values(), strict=True)
    ]
    assert any(changed)  # the adapter changes the function
    runner = _reference_runner(merged, f"coupling_docs={COUPLING_DOCS}")
    hflm = reference_hflm(s["chat"])
    for task in (ARC, GSM8K):
        rows = _first_rows(adapter_run, task)
        assert [row["doc_id"] for row in rows] == SAMPLES[task]  # exactly those documents
        assert all(row["arguments"]["gen_args_0"]["arg_0"].startswith("<|system|>Answer briefly.")
                   for row in rows)  # fmt: skip
        assert all(row["arguments"]["gen_args_0"]["arg_0"].count("<|user|>") == 3 for row in rows)
        _assert_equals_reference(adapter_run, task, hflm, runner, FLOAT32_ABS, 0, COUPLING_DOCS)
        assert adapter_run.geometry[task]["coupling"]["n_sampled"] == COUPLING_DOCS
    gsm8k = _first_rows(adapter_run, GSM8K)[0]["arguments"]["gen_args_0"]["arg_1"]
    assert gsm8k["max_gen_toks"] == 8
    used = _lm_eval_options(adapter_run)
    assert used["peft"] == str(s["lora"])
    assert used["samples"] == SAMPLES
    for flag, value in {
        "apply_chat_template": True, "fewshot_as_multiturn": True,
        "system_instruction": "Answer briefly.", "num_fewshot": 2, "seed": [7, 7, 7, 7],
        "gen_kwargs": {"max_gen_toks": 8}, "batch_size": "auto:2", "max_batch_size": 2,
        "write_out": True, "show_config": True,
    }.items():  # fmt: skip
        assert used[flag] == value, flag
    assert used["cache_requests"]["cache_requests"] is True
    assert list((adapter_run.output_dir.parent / "lm_eval_cache").glob("requests-*"))
    assert '"lm_eval_options"' in adapter_run.stdout  # --show_config prints the results
    assert "(end of target on previous line)" in adapter_run.stderr  # --write_out


@pytest.mark.slow
def test_geometry_is_logged_to_wandb_offline(adapter_run):
    tables = list(
        (adapter_run.output_dir.parent / "wandb").glob(
            "offline-run-*/files/media/table/evaluation/eval_results_*.table.json"
        )
    )
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    column = {name: i for i, name in enumerate(table["columns"])}
    logged = {
        (row[column["Tasks"]], row[column["Metric"]]): float(row[column["Value"]])
        for row in table["data"]
        if row[column["Filter"]] in ("none", "strict-match")
    }
    for task in (ARC, GSM8K):
        key = "strict-match" if task == GSM8K else "none"
        for name in ("lss", "logit_lens_entropy", "coupling"):
            expected = adapter_run.results["results"][task][f"{name},{key}"]
            assert logged[task, name] == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_hf_auto_and_dtype(dtype_run, options_setup, reference_hflm):
    import transformers

    s = options_setup
    assert dtype_run.results["config"]["model"] == "hf-auto"
    model = transformers.AutoModelForCausalLM.from_pretrained(s["llama"], dtype=torch.bfloat16)
    runner = _reference_runner(model, f"coupling_docs={COUPLING_DOCS}")
    hflm = reference_hflm(s["llama"])
    for task, n_docs in ((ARC, 3), (GSM8K, 3)):  # 0.6 of 5 documents
        checked = _assert_equals_reference(
            dtype_run, task, hflm, runner, DTYPE_ATOL, DTYPE_RTOL,
            COUPLING_DOCS,
        )  # fmt: skip
        assert checked == n_docs
        assert dtype_run.geometry[task]["model"]["dtype"] == "bfloat16"
        assert dtype_run.geometry[task]["model"]["revision"] == "main"
    used = _lm_eval_options(dtype_run)
    assert used["limit"] == 0.6
    assert (used["dtype"], used["revision"], used["trust_remote_code"]) == (
        "bfloat16", "main", True,
    )  # fmt: skip


@pytest.mark.slow
def test_delta_float16(delta_run, options_setup, reference_hflm):
    import transformers

    s = options_setup
    model = transformers.AutoModelForCausalLM.from_pretrained(s["gpt2"], dtype=torch.float16)
    delta = transformers.AutoModelForCausalLM.from_pretrained(s["delta"], dtype=torch.float16)
    deltas = delta.state_dict()
    for name, param in model.state_dict().items():
        param.data += deltas[name]  # lm-eval's definition of delta weights
    runner = _reference_runner(model)
    checked = _assert_equals_reference(
        delta_run, ARC, reference_hflm(s["gpt2"]), runner, DTYPE_ATOL,
        DTYPE_RTOL,
    )  # fmt: skip
    assert checked == 3
    assert delta_run.geometry[ARC]["model"]["dtype"] == "float16"
    assert _lm_eval_options(delta_run)["delta"] == str(s["delta"])


@pytest.mark.slow
def test_group_of_groups_one_file_per_subtask(group_run):
    from lm_coupling.harness.run_summary import leaf_tasks
    from lm_coupling.report.loading import load_results

    leaves = set(leaf_tasks(group_run.results))
    mmlu = {t for t in leaves if t.startswith("lmc_mmlu_offline_")}
    assert len(mmlu) == 57 and len(leaves) == 62  # 57 subjects and 5 benchmarks
    assert set(group_run.geometry) == leaves
    for task in leaves:
        capture = group_run.geometry[task]["capture"]
        assert (capture["in_batch"], capture["alone"]) == (1, 0), task
    loaded = load_results(group_run.output_dir)
    assert {g["task"] for g in loaded.geometry} == leaves
    values = loaded.values[loaded.values["kind"] == "geometry"]
    assert set(values["task"]) == leaves
    groups = dict(zip(values["task"], values["group"], strict=True))
    categories = {"stem", "other", "social_sciences", "humanities"}
    assert {groups[t] for t in mmlu} == {f"lmc_mmlu_offline_{c}" for c in categories}
    assert groups["lmc_gsm8k_offline"] == "lmc_openllm_v1_offline"


@pytest.mark.slow
def test_refused_option_stops_the_run_before_the_model_loads(
    options_setup, tmp_path, capsys, monkeypatch
):
    """The message, in-process through the command line (the literal lm_eval's refusal is
    end to end in test_harness_errors.py)."""
    s = options_setup
    args = ["--model", "hf", "--model_args", f"pretrained={s['gpt2']}", "--tasks", ARC,
            *_common(s), "--output_path", "results", "--predict_only",
            "--metrics", "lss"]  # fmt: skip
    run = run_in_process(args, tmp_path, capsys, monkeypatch)
    assert run.returncode == 2
    assert "lm-coupling: error: --predict_only cannot be combined with --metrics" in run.stderr
    assert "Instead: drop --predict_only" in run.stderr
    assert "Building contexts" not in run.stderr and not (tmp_path / "results").exists()


@pytest.mark.slow
def test_lm_eval_rejections(options_setup, tmp_path):
    s = options_setup
    base = ["--model", "hf", "--model_args", f"pretrained={s['gpt2']}", "--tasks", ARC,
            *_common(s), "--output_path", "results", "--metrics", "lss"]  # fmt: skip
    run = _launch(tmp_path, [*base, "--bootstrap_iters", "0"])
    assert run.returncode == 2 and "unrecognized arguments: --bootstrap_iters 0" in run.stderr


@pytest.mark.gpu
@pytest.mark.slow
def test_quantized_loading_on_gpu(options_setup, reference_hflm):
    pytest.importorskip("bitsandbytes", reason="4-bit loading needs bitsandbytes")
    s = options_setup
    cwd = s["root"] / "run_4bit"
    args = [
        "--model", "hf", "--model_args", f"pretrained={s['llama']},load_in_4bit=True",
        "--tasks", ARC, *_common(s), "--limit", "3", "--batch_size", "2", "--device", "cuda",
        "--output_path", "results", "--metrics", "lss,expodistance,logit_lens_entropy",
    ]  # fmt: skip
    run = check_ok(_launch(cwd, args))
    assert _lm_eval_options(run)["load_in_4bit"] is True
    capture = run.geometry[ARC]["capture"]
    assert (capture["in_batch"], capture["alone"]) == (3, 0)
    for row in _first_rows(run, ARC):
        assert all(math.isfinite(row[name]) for name in ("lss", "expodistance"))
