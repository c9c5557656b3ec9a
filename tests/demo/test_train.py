"""The demo family: generated corpus and tasks, training, checkpoints, bundled model."""

from __future__ import annotations

import json
import random

import pytest
import torch
from chance import chance_threshold
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm_coupling.demo.assets import bundled_model_path, bundled_tasks_data_path
from lm_coupling.demo.corpus import (
    EVAL_SPLITS,
    build_corpus,
    make_demo_data,
    reshuffled_mmlu_row,
    write_eval_tasks,
)
from lm_coupling.demo.items import BENCHMARKS, answered_text
from lm_coupling.demo.scoring import loglikelihoods, mc_accuracy, read_split
from lm_coupling.demo.train import REDUCED, checkpoint_steps, train_family

HUB_FIELDS = {
    "arc_easy": {"id", "question", "choices", "answerKey"},
    "arc_challenge": {"id", "question", "choices", "answerKey"},
    "gsm8k": {"question", "answer"},
    "hellaswag": {
        "ind",
        "activity_label",
        "ctx_a",
        "ctx_b",
        "ctx",
        "endings",
        "source_id",
        "split",
        "split_type",
        "label",
    },
    "mmlu": {"question", "subject", "choices", "answer"},
    "truthfulqa": {"question", "mc1_targets", "mc2_targets"},
    "winogrande": {"sentence", "option1", "option2", "answer"},
}


def test_checkpoint_steps_are_log_spaced_from_zero_to_total():
    steps = checkpoint_steps(1000, 5)
    assert steps == [0, 1, 10, 100, 1000]
    assert checkpoint_steps(1, 8) == [0, 1]
    with pytest.raises(ValueError, match="total >= 1"):
        checkpoint_steps(0)


def test_generation_is_seeded():
    first, again, other = make_demo_data(0), make_demo_data(0), make_demo_data(1)
    assert build_corpus(first, 0) == build_corpus(again, 0)
    assert first.eval_splits == again.eval_splits
    assert build_corpus(first, 0) != build_corpus(other, 1)


def test_no_evaluation_row_is_in_the_training_text():
    data = make_demo_data(0)
    text = "\n".join(build_corpus(data, 0))
    for benchmark in BENCHMARKS:
        held = [row for rows in data.eval_splits[benchmark].values() for row in rows]
        assert held, benchmark
        # Winogrande sentences and HellaSwag steps restate training facts and stories by
        # design; the items in their benchmark's format with the answer must be unseen.
        if benchmark in ("winogrande", "hellaswag"):
            continue
        assert not [row for row in held if answered_text(benchmark, row) in text], benchmark


def test_mmlu_training_rows_change_letter_between_renderings():
    """The letter of a training question must be read from its options, not memorised."""
    data = make_demo_data(0)
    row = data.train_rows["mmlu"][0]
    rng = random.Random(0)
    letters = set()
    for _ in range(40):
        shuffled = reshuffled_mmlu_row(row, rng)
        assert sorted(shuffled["choices"]) == sorted(row["choices"])
        assert shuffled["choices"][shuffled["answer"]] == row["choices"][row["answer"]]
        letters.add(shuffled["answer"])
    assert letters == {0, 1, 2, 3}
    blocks = [block for doc in build_corpus(data, 0) for block in doc.split("\n\n")]
    answers = {block for block in blocks if block.startswith(row["question"] + "\nA. ")}
    assert len({answer[-1] for answer in answers}) >= 2, answers


def test_letter_drills_ask_only_for_a_named_option():
    blocks = [block for doc in build_corpus(make_demo_data(0), 0) for block in doc.split("\n\n")]
    drills = [block for block in blocks if block.startswith("Which option is ")]
    assert len(drills) >= 600
    for drill in drills:
        question, *options, answer = drill.split("\n")
        named = question.removeprefix("Which option is ").removesuffix("?")
        letter = answer.removeprefix("Answer: ")
        assert [o[:3] for o in options] == ["A. ", "B. ", "C. ", "D. "]
        assert options["ABCD".index(letter)] == f"{letter}. {named}"


def test_written_tasks_have_hub_fields_and_offline_layout(tmp_path):
    folders = write_eval_tasks(tmp_path, seed=0, n_test=6, n_validation=2)
    assert set(folders) == set(BENCHMARKS)
    for benchmark, fields in HUB_FIELDS.items():
        for split in EVAL_SPLITS[benchmark]:
            rows = read_split(tmp_path, benchmark, split)
            assert rows and all(set(row) == fields for row in rows), (benchmark, split)
    for row in read_split(tmp_path, "arc_easy"):
        assert row["answerKey"] in row["choices"]["label"]
    assert {r["subject"] for r in read_split(tmp_path, "mmlu", "dev")} == {
        "astronomy",
        "high_school_biology",
        "elementary_mathematics",
    }
    # The offline task YAMLs' loader reads the folder as written.
    from lm_coupling.tasks.offline_data import load_offline

    loaded = load_offline("arc_challenge", lmc_data_dir=str(tmp_path))
    assert set(loaded) == {"train", "validation", "test"}
    assert len(load_offline("mmlu", subject="astronomy", lmc_data_dir=str(tmp_path))["test"]) == 2


def _weights(path):
    model = AutoModelForCausalLM.from_pretrained(path)
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def test_reduced_training_runs_end_to_end_and_is_reproducible(tmp_path):
    kwargs = dict(
        sizes=("tiny",), steps=3, seed=0, reduced=True, batch_size=2, seq_len=32, n_checkpoints=3
    )
    paths = train_family(tmp_path / "a", **kwargs)
    assert [p.name for p in paths] == ["step0", "step1", "step3"]
    model = AutoModelForCausalLM.from_pretrained(paths[-1], local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(paths[-1], local_files_only=True)
    assert model.config.n_embd == REDUCED["d_model"]
    assert model.config.n_layer == REDUCED["n_layers"]
    ids = tokenizer("Question: What color is it?\nAnswer:", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()
    log = [
        json.loads(line) for line in (tmp_path / "a/tiny/train_log.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in log] == [1, 2, 3]
    start, end = _weights(paths[0]), _weights(paths[-1])
    assert any(not torch.equal(start[k], end[k]) for k in start)
    again = train_family(tmp_path / "b", **kwargs)
    for mine, theirs in zip(paths, again, strict=True):
        first, second = _weights(mine), _weights(theirs)
        assert all(torch.equal(first[k], second[k]) for k in first)


def test_loglikelihoods_are_padding_invariant_and_match_a_direct_sum(tiny_model, tokenizer):
    model = tiny_model("gpt2", dtype=torch.float64)
    pairs = [("Question: What is it?\nAnswer:", " a red fox"), ("Short ", "one")]
    batched = loglikelihoods(model, tokenizer, pairs)
    for (context, continuation), value in zip(pairs, batched, strict=True):
        context_ids = tokenizer(context.rstrip(), add_special_tokens=False)["input_ids"]
        whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0], -1)
        direct = sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context_ids), len(whole)))
        torch.testing.assert_close(value, direct, rtol=1e-9, atol=1e-9)


def test_bundled_model_beats_chance_on_arc_offline():
    model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path(), local_files_only=True)
    tasks = bundled_tasks_data_path()
    rows = {b: read_split(tasks, b) for b in ("arc_easy", "arc_challenge")}
    n = sum(map(len, rows.values()))
    hits = sum(round(mc_accuracy(model.eval(), tokenizer, b, r) * len(r)) for b, r in rows.items())
    # Four options: chance is 1/4; a one-sided binomial test at alpha = 0.001 sets the margin.
    assert hits >= chance_threshold(n, 0.25), (hits, n)
