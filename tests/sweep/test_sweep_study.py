"""Named studies: the shipped study files, and the plan's arithmetic and refusals."""

from __future__ import annotations

import json

import pytest

from lm_coupling.errors import ConfigurationError
from lm_coupling.sweep.calibrate import Calibration, Shape
from lm_coupling.sweep.command import parse_sweep_args
from lm_coupling.sweep.estimate import (
    RunSettings,
    build_plan,
    check_limit,
    model_plan,
    read_settings,
)
from lm_coupling.sweep.spec import ModelEntry
from lm_coupling.sweep.study import load_study, study_names

CAL = Calibration(2e-4, 3e-3, 0.5, 16, 1, 10, "all blocks")


def shape(n_layers=4, d_model=64):
    return Shape("gpt2", n_layers, d_model, 4, 100, None, "config")


def settings(limit=None, coupling_docs=25, coupled=True):
    return RunSettings("cpu", 1, limit, coupling_docs, coupled, 10, "float32")


def test_the_authors_study_keeps_the_causal_hub_models_and_says_why_the_rest_are_out():
    study = load_study("aubry2025")
    assert {"aubry2025", "pythia_emergence"} <= set(study_names())
    assert len(study.models) == 28 and len(study.excluded) == 17  # the 45 of models.json
    assert all(
        m.entry.name.count("/") <= 1 and not m.entry.name.startswith("/") for m in study.models
    )
    assert all(item["reason"] for item in study.excluded)
    t5 = [item for item in study.excluded if "t5-" in item["model"]]
    assert len(t5) == 2 and all("not a causal LM" in item["reason"] for item in t5)
    assert all(item["model"].startswith("/fs01/") for item in study.excluded)
    keys = {"model_type", "n_layers", "d_model", "n_heads", "vocab", "d_ff", "params"}
    assert all(set(m.shape) == keys for m in study.models)
    assert study.tasks == "lmc_openllm_v1" and "preset=iclr2025" in study.lm_eval_args


def test_the_open_llm_v1_tasks_give_62_leaves_and_1550_coupled_documents():
    study = load_study("aubry2025")
    plan = model_plan(ModelEntry("gpt2"), shape(), CAL, study, settings(), startup=10.0)
    cost = study.task_costs["lmc_openllm_v1"]
    assert plan.documents == 1172 + 10042 + 14042 + 817 + 1267 + 1319
    assert plan.coupled == 62 * 25  # 57 MMLU subjects and five single tasks, 25 each
    # time = startup + documents (requests tokens f + gen g) + coupled L j, closed form:
    forward = plan.documents * (cost.requests * cost.tokens * 2e-4 + cost.gen_tokens * 3e-3)
    assert plan.forward_s == pytest.approx(forward)
    assert plan.jacobian_s == pytest.approx(1550 * 4 * 0.5)
    assert plan.seconds == pytest.approx(10.0 + forward + 1550 * 4 * 0.5)
    limited = model_plan(ModelEntry("gpt2"), shape(), CAL, study, settings(limit=10), 10.0)
    assert (limited.documents, limited.coupled) == (620, 620)  # --limit applies per leaf
    off = model_plan(ModelEntry("gpt2"), shape(), CAL, study, settings(coupled=False), 10.0)
    assert off.coupled == 0 and off.jacobian_s == 0


def test_pythia_study_expands_sizes_times_checkpoints():
    study = load_study("pythia_emergence")
    assert len(study.models) == 5 * 13
    revisions = [m.entry.revision for m in study.models if m.entry.name.endswith("-160m")]
    assert revisions[0] == "step0" and revisions[-1] == "step143000" and len(revisions) == 13
    assert all(m.shape["model_type"] == "gpt_neox" for m in study.models)


def test_study_arguments_come_first_and_typed_ones_win():
    args, rest = parse_sweep_args(["--study", "aubry2025", "--plan", "--metric_args", "k=5"])
    assert args.tasks == "lmc_openllm_v1" and args.metrics == "coupling"
    assert args.model_args == "dtype=bfloat16" and args.output_path is None
    found = read_settings(rest, args.metrics, args.model_args)
    assert (found.k, found.coupling_docs, found.coupled, found.dtype) == (5, 25, True, "float32")
    preset = read_settings(["--metric_args", "preset=iclr2025", "--limit", "3"], "all", None)
    assert (preset.k, preset.limit) == (0.1, 3.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gpt2", "--tasks", "x", "--plan"], "need a named study"),
        (["gpt2", "--tasks", "x", "--output_path", "o", "--max-hours", "1"], "need a named"),
        (["--study", "nonesuch", "--plan"], "no such study"),
        (["--study", "aubry2025"], "needs --output_path"),
    ],
)
def test_bad_study_arguments_are_refused_with_the_reason(argv, message):
    with pytest.raises(ConfigurationError, match=message):
        parse_sweep_args(argv)


def test_a_study_file_without_the_tasks_costs_is_refused(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps({"tasks": "a,b", "task_costs": {"a": {"documents": 3}}, "models": []})
    )
    with pytest.raises(ConfigurationError, match="no entry for b"):
        load_study(str(path))


def test_the_limit_refuses_an_estimate_above_it():
    plan = model_plan(ModelEntry("m"), shape(), CAL, load_study("aubry2025"), settings(), 10.0)
    check_limit([plan], max_hours=plan.seconds / 3600 * 1.01)
    with pytest.raises(ConfigurationError, match="above --max-hours 0.5: nothing was run"):
        check_limit([plan, plan], max_hours=0.5)


def test_options_the_plan_cannot_read_are_refused():
    with pytest.raises(ConfigurationError, match="cannot plan with coupling_docs=many"):
        read_settings(["--metric_args", "coupling_docs=many"], "coupling", None)
    auto = read_settings(["--batch_size", "auto", "--device", "cpu"], "lss", "dtype=bfloat16")
    assert (auto.batch, auto.coupled, auto.dtype, auto.coupling_docs) == (1, False, "float32", 25)


def test_study_may_stand_anywhere_and_tasks_without_costs_are_not_planned():
    args, _ = parse_sweep_args(["--plan", "--tasks", "arc_easy", "--study=pythia_emergence"])
    assert args.study.name == "pythia_emergence" and args.tasks == "arc_easy"  # typed wins
    with pytest.raises(ConfigurationError, match="no task_costs for arc_easy"):
        build_plan(args.study, ["arc_easy"], args.study.entries, settings(), args.metrics)


def test_a_large_shape_is_planned_from_its_work_without_being_built():
    """Llama-2-70B's shape: the forward from its flops, the Jacobian from a d=256 block scaled."""
    from lm_coupling.sweep import calibrate as cal

    big = Shape("llama", 80, 8192, 64, 32000, 28672, "study file")
    flops, bandwidth = cal.device_rates("cpu", "float32")  # measured once, then reused
    block_seconds, width, timed_tokens = cal.block_jacobian(big, "cpu", "float32", 654, 10)
    assert (width, timed_tokens) == (cal.PROXY_D, cal.PROXY_TOKENS)  # capped
    result = cal.calibrate(big, "cpu", tokens=654, batch=1, k=10)
    block = 4 * 8192**2 + 3 * 8192 * 28672
    forward = (80 * (2 * block + 2 * 654 * 8192) + 2 * 32000 * 8192) / flops
    assert result.forward_per_token == pytest.approx(forward, rel=1e-12)
    weights = (80 * block + 32000 * 8192) * 4  # float32 bytes, read once per generated token
    assert result.decode_per_token == pytest.approx(max(forward, weights / bandwidth), rel=1e-12)

    def work(d, d_ff, t):
        return d * (2 * (4 * d**2 + 3 * d * d_ff) + 4 * t * d) + 4 * d**3

    ratio = work(8192, 28672, 654) / work(256, 1024, 128)
    assert result.jacobian_per_layer == pytest.approx(block_seconds * ratio, rel=1e-12)
    assert result.layers_built.startswith("not built: ")


def test_a_shape_up_to_block_d_is_timed_on_one_block_of_its_own_width():
    """SmolLM2's width class: one block at d itself, with a small vocabulary, at the prompt.

    The block is built from the model's config with one block and a vocabulary of
    ``BLOCK_VOCAB`` (the config's special ids beyond it dropped); the model's
    own config is left as it is.
    """
    import transformers

    from lm_coupling.sweep import calibrate as cal

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=320, intermediate_size=864, num_attention_heads=5,
        num_key_value_heads=5, num_hidden_layers=30, pad_token_id=49151, bos_token_id=1,
    )  # fmt: skip
    mid = Shape("llama", 30, 320, 5, 49152, 864, "config", config)
    result = cal.calibrate(mid, "cpu", tokens=40, batch=1, k=10)
    seconds, width, timed_tokens = cal.block_jacobian(mid, "cpu", "float32", 40, 10)  # kept
    assert (width, timed_tokens) == (320, 40)
    assert result.jacobian_per_layer == pytest.approx(seconds, rel=1e-12)
    assert "one block's Jacobian (d=320, random weights) at 40 tokens timed" in (
        result.layers_built
    )
    assert config.vocab_size == 49152 and config.pad_token_id == 49151  # the model's own kept
    small = cal._one_block_config(mid, 40)
    assert (small.vocab_size, small.num_hidden_layers) == (cal.BLOCK_VOCAB, 1)
    assert (small.pad_token_id, small.bos_token_id) == (None, 1)
