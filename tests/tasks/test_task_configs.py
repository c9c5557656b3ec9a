"""The task YAMLs shipped in lm_coupling/tasks load through lm-eval and match the stock prompts."""

from __future__ import annotations

import inspect
from pathlib import Path

import lm_eval.tasks
import pytest
from fixtures.benchmarks import SHARED_HINT, shared_benchmarks_dir, write_offline_benchmarks
from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import TaskIndex
from lm_eval.tasks._yaml_loader import load_yaml

TASKS_DIR = Path(__file__).resolve().parents[2] / "lm_coupling" / "tasks"
STOCK_DIR = Path(lm_eval.tasks.__file__).parent
SAMPLE_MMLU = ("astronomy", "high_school_biology", "elementary_mathematics")
REAL_MMLU = ("anatomy", "world_religions")
# offline task -> stock YAML (relative to lm_eval/tasks) whose prompt it must reproduce
STOCK_OF = {
    "lmc_arc_easy_offline": "arc/arc_easy.yaml",
    "lmc_arc_challenge_offline": "arc/arc_challenge.yaml",
    "lmc_gsm8k_offline": "gsm8k/gsm8k.yaml",
    "lmc_hellaswag_offline": "hellaswag/hellaswag.yaml",
    "lmc_truthfulqa_mc1_offline": "truthfulqa/truthfulqa_mc1.yaml",
    "lmc_truthfulqa_mc2_offline": "truthfulqa/truthfulqa_mc2.yaml",
    "lmc_winogrande_offline": "winogrande/default.yaml",
}
# fields that decide requests and scores, compared literally with the stock config
SCORING_FIELDS = (
    "output_type", "metric_list", "filter_list", "generation_kwargs", "target_delimiter",
    "fewshot_delimiter", "training_split", "validation_split", "test_split", "fewshot_split",
    "repeats", "num_fewshot",
)  # fmt: skip


@pytest.fixture(scope="session")
def full_manager():
    """One TaskManager over the stock tasks plus ours (indexing takes seconds)."""
    return TaskManager(include_path=str(TASKS_DIR))


@pytest.fixture(scope="session")
def real_data_dir(tmp_path_factory):
    if shared_benchmarks_dir() is None:
        pytest.skip(f"the real benchmark items are absent: no {SHARED_HINT}")
    return Path(write_offline_benchmarks(tmp_path_factory.mktemp("offline"))["gsm8k"]).parent


@pytest.fixture(scope="session")
def real_manager(real_data_dir):
    """Our tasks only, pointed at the converted real items through lm-eval's metadata."""
    return TaskManager(
        include_path=str(TASKS_DIR),
        include_defaults=False,
        metadata={"lmc_data_dir": str(real_data_dir)},
    )


@pytest.fixture(params=["samples", "real"])
def manager_and_subjects(request, full_manager, monkeypatch):
    monkeypatch.delenv("LM_COUPLING_DATA_DIR", raising=False)
    if request.param == "samples":
        return full_manager, SAMPLE_MMLU
    return request.getfixturevalue("real_manager"), REAL_MMLU


def our_yaml_files():
    return sorted(TASKS_DIR.rglob("*.yaml"))


def test_every_yaml_parses_and_tasks_carry_a_version():
    files = our_yaml_files()
    assert len(files) > 60  # 57 MMLU subjects + the others
    for path in files:
        cfg = load_yaml(path, resolve_func=True)
        assert isinstance(cfg.get("metadata", {}).get("version"), float | int), path
        if "group" in cfg:
            assert path.name.startswith("_"), f"group {cfg['group']} in {path.name}"
        elif "task" in cfg:
            assert not path.name.startswith("_"), path
            assert cfg["task"].startswith("lmc_"), path
        else:
            assert path.name.endswith("_template.yaml"), f"{path} has neither task nor group"


def test_names_never_shadow_stock_tasks():
    stock = set(TaskIndex.build([STOCK_DIR]))
    ours = set(TaskIndex.build([TASKS_DIR]))
    assert "arc" in ours and "lmc_demo" in ours and "lmc_openllm_v1_offline" in ours
    assert not ours & stock, sorted(ours & stock)
    assert {"arc_easy", "arc_challenge", "mmlu", "gsm8k"} <= stock


def test_mmlu_subjects_match_stock():
    stock = {load_yaml(p, resolve_func=False)["dataset_name"]: load_yaml(p, resolve_func=False)
             for p in (STOCK_DIR / "mmlu" / "default").glob("mmlu_*.yaml")}  # fmt: skip
    ours = [load_yaml(p, resolve_func=False) for p in (TASKS_DIR / "mmlu").glob("lmc_*.yaml")]
    assert len(stock) == 57 and len(ours) == 57
    for cfg in ours:
        subject = cfg["dataset_kwargs"]["subject"]
        assert cfg["task"] == f"lmc_mmlu_offline_{subject}"
        assert cfg["description"] == stock[subject]["description"]
        assert cfg["tag"] == "lmc_" + stock[subject]["tag"].replace("mmlu_", "mmlu_offline_", 1)


def stock_twin(ours: ConfigurableTask, stock_yaml: Path) -> ConfigurableTask:
    """The stock task's own config, fed the same local documents instead of the hub."""
    cfg = load_yaml(stock_yaml, resolve_func=True)
    for key in ("tag", "group", "dataset_path", "dataset_name"):
        cfg.pop(key, None)
    cfg["custom_dataset"] = ours.config.custom_dataset
    cfg["dataset_kwargs"] = dict(ours.config.dataset_kwargs)
    cfg["metadata"] = dict(ours.config.metadata)
    return ConfigurableTask(config=cfg)


def assert_same_prompts(ours: ConfigurableTask, stock: ConfigurableTask, shots: int):
    for field in SCORING_FIELDS:
        mine, theirs = getattr(ours.config, field), getattr(stock.config, field)
        if field == "fewshot_split" and theirs is None and stock.config.test_split is not None:
            # Ours may name the split lm-eval's rule picks (training, else validation): the
            # same few-shot documents, drawn the same way while test_split is set (lm-eval
            # excludes the evaluated document only when the two splits are equal).
            theirs = stock.config.training_split or stock.config.validation_split
        assert mine == theirs, field
    ours.set_fewshot_seed(1234)
    stock.set_fewshot_seed(1234)
    docs_ours, docs_stock = list(ours.eval_docs), list(stock.eval_docs)
    assert docs_ours == docs_stock and len(docs_ours) >= 1
    for doc in docs_ours:
        assert ours.fewshot_context(doc, shots) == stock.fewshot_context(doc, shots)
        assert ours.doc_to_target(doc) == stock.doc_to_target(doc)
        if ours.config.doc_to_choice is not None:
            assert ours.doc_to_choice(doc) == stock.doc_to_choice(doc)


@pytest.mark.parametrize("name", sorted(STOCK_OF))
def test_offline_task_reproduces_stock_prompts(name, manager_and_subjects):
    manager, _ = manager_and_subjects
    ours = manager.load(name)["tasks"][name]
    version = load_yaml(TASKS_DIR / f"{name}.yaml", resolve_func=False)["metadata"]["version"]
    assert ours.config.metadata["version"] == version
    shots = 0 if "truthfulqa" in name else 2
    stock = stock_twin(ours, STOCK_DIR / STOCK_OF[name])
    assert_same_prompts(ours, stock, shots)
    # the same stock function (lm-eval loads the file twice, under two module names)
    for hook in ("process_docs", "process_results"):
        mine, theirs = getattr(ours.config, hook), getattr(stock.config, hook)
        assert (mine is None) == (theirs is None), hook
        if mine is not None:
            assert mine.__name__ == theirs.__name__
            assert Path(inspect.getsourcefile(mine)) == Path(inspect.getsourcefile(theirs))


def test_offline_mmlu_subjects_reproduce_stock_prompts(manager_and_subjects):
    manager, subjects = manager_and_subjects
    names = [f"lmc_mmlu_offline_{s}" for s in subjects]
    tasks = manager.load(names)["tasks"]
    for subject, name in zip(subjects, names, strict=True):
        ours = tasks[name]
        assert {d["subject"] for d in ours.eval_docs} == {subject}
        stock = stock_twin(ours, STOCK_DIR / "mmlu" / "default" / f"mmlu_{subject}.yaml")
        assert_same_prompts(ours, stock, shots=2)


def test_demo_group_covers_every_benchmark(full_manager, monkeypatch):
    monkeypatch.delenv("LM_COUPLING_DATA_DIR", raising=False)
    loaded = full_manager.load("lmc_demo")
    assert set(loaded["tasks"]) == {
        "lmc_arc_easy_offline", "lmc_arc_challenge_offline", "lmc_hellaswag_offline",
        "lmc_truthfulqa_mc2_offline", "lmc_winogrande_offline", "lmc_gsm8k_offline",
        *(f"lmc_mmlu_offline_{s}" for s in SAMPLE_MMLU),
    }  # fmt: skip
    for task in loaded["tasks"].values():
        docs = list(task.eval_docs)
        assert 4 <= len(docs) <= 20
        shots = task.config.num_fewshot
        task.set_fewshot_seed(0)
        assert shots <= 2 and len(task.sampler.sample(shots)) == shots
    assert loaded["tasks"]["lmc_gsm8k_offline"].config.generation_kwargs["max_gen_toks"] == 32


def test_env_var_selects_the_data_folder(real_data_dir, full_manager, monkeypatch):
    monkeypatch.setenv("LM_COUPLING_DATA_DIR", str(real_data_dir))
    task = full_manager.load("lmc_gsm8k_offline")["tasks"]["lmc_gsm8k_offline"]
    assert len(task.eval_docs) == 5  # write_offline_benchmarks' n_items, not the 8 samples


def test_missing_data_folder_names_the_fix(full_manager, monkeypatch, tmp_path):
    monkeypatch.setenv("LM_COUPLING_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="LM_COUPLING_DATA_DIR"):
        full_manager.load("lmc_arc_easy_offline")


LEADERBOARD = {
    "arc_challenge": (25, "acc_norm"),
    "hellaswag": (10, "acc_norm"),
    "mmlu": (5, "acc"),
    "truthfulqa_mc2": (0, "acc"),
    "winogrande": (5, "acc"),
    "gsm8k": (5, "exact_match"),
}


@pytest.mark.parametrize("offline", [False, True])
def test_leaderboard_group_lists_the_v1_setting(offline, full_manager):
    name = "lmc_openllm_v1_offline" if offline else "lmc_openllm_v1"
    path = TASKS_DIR / f"_{name}.yaml"
    cfg = load_yaml(path, resolve_func=False)
    assert cfg["group"] == name and "aggregate_metric_list" not in cfg

    def stock_name(member):
        ref = member.get("task") or member["group"]
        return ref.removeprefix("lmc_").removesuffix("_offline") if offline else ref

    members = {stock_name(m): m for m in cfg["task"]}
    assert set(members) == set(LEADERBOARD)
    scores = cfg["metadata"]["leaderboard_scores"]
    for bench, (shots, metric) in LEADERBOARD.items():
        member = members[bench]
        ref = member.get("task") or member["group"]
        assert member["num_fewshot"] == shots
        assert ref in full_manager.task_index
        assert scores[ref].split(",")[0] == metric
        if bench in ("arc_challenge", "hellaswag", "winogrande"):
            assert member["fewshot_split"] == "train"
        if "task" in member:  # the metric is one the task itself reports
            task_cfg = load_yaml(full_manager.task_index[ref].yaml_path, resolve_func=False)
            assert metric in [m["metric"] for m in task_cfg["metric_list"]]
    assert scores[members["gsm8k"].get("task")].endswith(",strict-match")
