"""MODELS of `lm-coupling sweep`: comma lists, brace ranges, YAML and CSV files, shards."""

from __future__ import annotations

import pytest

from lm_coupling.errors import ConfigurationError
from lm_coupling.sweep.command import parse_sweep_args
from lm_coupling.sweep.plan import parse_shard, shard_entries
from lm_coupling.sweep.spec import ModelEntry, expand_braces, parse_models, split_top_level


def test_pythia_revision_range_expands_to_every_thousandth_step():
    entries = parse_models("EleutherAI/pythia-160m@step{0,1000,...,143000}")
    assert len(entries) == 144
    assert entries[0] == ModelEntry("EleutherAI/pythia-160m", "step0")
    assert entries[-1].revision == "step143000"
    assert {e.name for e in entries} == {"EleutherAI/pythia-160m"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("step{0,1000,2000}", ["step0", "step1000", "step2000"]),
        ("step{0,3,...,6}", ["step0", "step3", "step6"]),
        ("step{3,2,...,1}", ["step3", "step2", "step1"]),
        ("{a,b}-{1,2}", ["a-1", "a-2", "b-1", "b-2"]),
        ("plain", ["plain"]),
        ("s{10,8,...,4}", ["s10", "s8", "s6", "s4"]),
    ],
)
def test_brace_expansion(text, expected):
    assert expand_braces(text) == expected


@pytest.mark.parametrize(
    "text",
    ["step{0,1000,...,1500}", "step{0,...,10}", "s{a,b,...,z}", "s{1,,2}", "s{a{b}}", "s{0..9}"],
)
def test_bad_brace_ranges_are_errors_naming_the_range(text):
    with pytest.raises(ConfigurationError, match="brace|braces"):
        expand_braces(text)


def test_comma_list_keeps_commas_inside_braces_and_splits_revisions():
    text = "gpt2, /runs/tiny/step{0,2} ,org/m@v1.0,/data/a@b/model"
    assert split_top_level(text) == [
        "gpt2",
        "/runs/tiny/step{0,2}",
        "org/m@v1.0",
        "/data/a@b/model",
    ]
    assert parse_models(text) == [
        ModelEntry("gpt2"),
        ModelEntry("/runs/tiny/step0"),
        ModelEntry("/runs/tiny/step2"),
        ModelEntry("org/m", "v1.0"),
        ModelEntry("/data/a@b/model"),  # '@' followed by a path is part of the path
    ]


def test_yaml_and_csv_files(tmp_path):
    yaml_file = tmp_path / "models.yaml"
    yaml_file.write_text(
        "models:\n  - gpt2\n  - {model: org/m, revision: 'step{0,1}'}\n"
        "  - {model: org/n, revision: [main, v2]}\n  - gpt2\n"
    )
    assert parse_models(str(yaml_file)) == [
        ModelEntry("gpt2"),
        ModelEntry("org/m", "step0"),
        ModelEntry("org/m", "step1"),
        ModelEntry("org/n", "main"),
        ModelEntry("org/n", "v2"),
    ]
    csv_file = tmp_path / "models.csv"
    csv_file.write_text('model,revision\ngpt2,\norg/m,"step{0,2}"\n')
    assert parse_models(str(csv_file)) == [
        ModelEntry("gpt2"),
        ModelEntry("org/m", "step0"),
        ModelEntry("org/m", "step2"),
    ]


def test_bad_models_files_are_errors(tmp_path):
    with pytest.raises(ConfigurationError, match="does not exist"):
        parse_models(str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: gpt2\n")
    with pytest.raises(ConfigurationError, match="list of models"):
        parse_models(str(bad))
    no_model = tmp_path / "bad.csv"
    no_model.write_text("model,revision\n,main\n")
    with pytest.raises(ConfigurationError, match="bad.csv:2"):
        parse_models(str(no_model))


def test_shards_partition_the_list_deterministically():
    entries = parse_models("m@r{0,1,...,9}")
    shards = [shard_entries(entries, i, 3) for i in range(3)]
    assert sorted((e for s in shards for e in s), key=entries.index) == entries
    assert [len(s) for s in shards] == [4, 3, 3]
    assert shards[1] == [entries[1], entries[4], entries[7]]
    assert shard_entries(entries, 1, 3) == shards[1]  # same answer in every job


@pytest.mark.parametrize("text", ["3/3", "1", "a/2", "-1/2", "1/0"])
def test_bad_shards(text):
    with pytest.raises(ConfigurationError, match="--shard"):
        parse_shard(text)


def test_sweep_arguments_split_between_sweep_and_lm_eval():
    args, rest = parse_sweep_args(
        ["gpt2", "--limit", "2", "--tasks", "hellaswag", "--output_path", "out"]
        + ["--metrics", "coupling", "--model_args", "dtype=float32", "--shard", "1/2"]
    )
    assert (args.models, args.tasks, args.output_path, args.shard) == (
        "gpt2",
        "hellaswag",
        "out",
        "1/2",
    )
    assert args.model_args == "dtype=float32"
    assert rest == ["--limit", "2", "--metrics", "coupling"]
    with pytest.raises(ConfigurationError, match="MODELS first"):
        parse_sweep_args(["--tasks", "hellaswag", "gpt2"])
    with pytest.raises(ConfigurationError, match="--model"):
        parse_sweep_args(["gpt2", "--tasks", "t", "--output_path", "o", "--model", "vllm"])
