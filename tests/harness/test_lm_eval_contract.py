"""Contract tests: every lm-eval internal that harness/lm_eval_adapter.py relies on.

One test per use, against the installed lm-eval on a real tiny model and the
bundled offline tasks (no mocks); each failure message names the adapter use
whose assumption broke, so an lm-eval release that changes one is caught here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.tiny import build_tiny_model
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from lm_coupling.harness import lm_eval_adapter as adapter
from lm_coupling.harness.lm_eval_registry import registered_metrics
from lm_coupling.plugins.manager import get_registry

TASKS_DIR = Path(__file__).resolve().parents[2] / "lm_coupling" / "tasks"
TASK = "lmc_arc_easy_offline"
MAX_LENGTH = 24


def _broke(use: str, what: str) -> str:
    return f"lm-eval contract broken: {use} ({what}); update harness/lm_eval_adapter.py"


class Recording(adapter.HFLMWithHooks):
    """HFLM whose hooks record what lm-eval passes through them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[str, list] = {"encoded": [], "forward": [], "generate": [], "probe": []}
        self.searching = False

    def encoded_requests(self, requests):
        self.seen["encoded"].append(list(requests))
        return super().encoded_requests(requests)

    def forward_batch(self, inps, call):
        self.seen["probe" if self.searching else "forward"].append(inps.clone())
        return call()

    def generate_batch(self, context, generation_kwargs, call):
        self.seen["generate"].append((context.clone(), dict(generation_kwargs)))
        return call()

    def batch_size_search(self):
        import contextlib

        @contextlib.contextmanager
        def searching():
            self.searching = True
            try:
                yield
            finally:
                self.searching = False

        return searching()


@pytest.fixture(scope="module")
def lm(tokenizer):
    model = build_tiny_model("gpt2", len(tokenizer), max_len=64, seed=1)
    return Recording(
        pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=MAX_LENGTH, device="cpu"
    )


def _loglikelihood_requests(pairs):
    return [
        Instance("loglikelihood", {}, (context, continuation), idx=i, metadata=("t", i, 1))
        for i, (context, continuation) in enumerate(pairs)
    ]


PAIRS = [
    ("Question: what is the sun? Answer:", " a star"),
    ("The trophy doesn't fit into the brown suitcase because " * 3, " it is small"),
]


def test_loglikelihood_goes_through_encoded_requests_and_forward_batch(lm):
    for seen in lm.seen.values():
        seen.clear()
    scores = lm.loglikelihood(_loglikelihood_requests(PAIRS), disable_tqdm=True)
    assert len(lm.seen["encoded"]) == 1 and len(lm.seen["encoded"][0]) == len(PAIRS), _broke(
        "HFLMWithHooks._loglikelihood_tokens", "loglikelihood did not score the encoded requests"
    )
    assert lm.seen["forward"], _broke("HFLMWithHooks._model_call", "no forward batch")
    assert len(scores) == len(PAIRS)
    assert all(torch.isfinite(torch.tensor(score)) for score, _ in scores)


class Appending(Recording):
    """Runs each forward batch with its rows appended again (as duplicate prompts do)."""

    def forward_batch(self, inps, call):
        self.seen["forward"].append(inps.clone())
        full = call(torch.cat([inps, inps]))
        own = call()
        self.seen["appended"] = (full[inps.shape[0] :], own)
        return full[: inps.shape[0]]


def test_forward_batch_call_runs_hflms_forward_on_another_batch(tokenizer):
    """``call(batch)`` runs HFLM's forward on appended rows; lm-eval reads its own rows only."""
    model = build_tiny_model("gpt2", len(tokenizer), max_len=64, seed=1)
    lm = Appending(
        pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=MAX_LENGTH, device="cpu"
    )
    scores = lm.loglikelihood(_loglikelihood_requests(PAIRS), disable_tqdm=True)
    appended, own = lm.seen["appended"]
    torch.testing.assert_close(appended, own, rtol=1e-4, atol=1e-4)
    plain = Recording(
        pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=MAX_LENGTH, device="cpu"
    )
    expected = plain.loglikelihood(_loglikelihood_requests(PAIRS), disable_tqdm=True)
    for (score, greedy), (want, want_greedy) in zip(scores, expected, strict=True):
        assert greedy == want_greedy and abs(score - want) < 1e-4, _broke(
            "HFLMWithHooks._model_call", "the scores read rows other than lm-eval's own"
        )


def test_encode_pair_and_loglikelihood_input_are_what_hflm_feeds_the_model(lm):
    for seen in lm.seen.values():
        seen.clear()
    lm.loglikelihood(_loglikelihood_requests(PAIRS), disable_tqdm=True)
    rows = [row.tolist() for batch in lm.seen["forward"] for row in batch]
    for _, context_enc, continuation_enc in lm.seen["encoded"][0]:
        pair = adapter.encode_pair(lm, *_pair_of(context_enc, continuation_enc, lm))
        assert pair == (context_enc, continuation_enc), _broke(
            "encode_pair", "not HFLM.loglikelihood's encoding"
        )
        inp, last = adapter.loglikelihood_input(lm, context_enc, continuation_enc)
        assert len(inp) <= MAX_LENGTH
        assert any(row[: len(inp)] == inp for row in rows), _broke(
            "loglikelihood_input", "no forward row starts with the predicted input"
        )
        assert inp[last + 1 :] == continuation_enc[:-1], _broke(
            "loglikelihood_input", "the continuation does not follow the target position"
        )
    # The long request was truncated from the left: the rule was exercised.
    long_enc = max(lm.seen["encoded"][0], key=lambda r: len(r[1]))
    assert len(long_enc[1]) + len(long_enc[2]) > MAX_LENGTH + 1


def _pair_of(context_enc, continuation_enc, lm):
    for context, continuation in PAIRS:
        if adapter.encode_pair(lm, context, continuation)[0] == context_enc:
            return context, continuation
    raise AssertionError(_broke("encode_pair", "no request encodes to HFLM's tokens"))


def test_generation_goes_through_generate_batch_with_the_attention_mask(lm):
    for seen in lm.seen.values():
        seen.clear()
    request = Instance(
        "generate_until",
        {},
        ("Question: what is the sun? Answer:", {"until": ["\n"], "max_gen_toks": 3}),
        idx=0,
        metadata=("t", 0, 1),
    )
    out = lm.generate_until([request], disable_tqdm=True)
    assert len(out) == 1
    assert len(lm.seen["generate"]) == 1, _broke("HFLMWithHooks._model_generate", "no batch")
    context, kwargs = lm.seen["generate"][0]
    assert "attention_mask" in kwargs, _broke(
        "HFLMWithHooks._model_generate", f"generation kwargs {sorted(kwargs)}"
    )
    assert kwargs["attention_mask"].shape == context.shape


def test_batch_size_search_probes_go_through_forward_batch(tokenizer):
    model = build_tiny_model("gpt2", len(tokenizer), max_len=64, seed=1)
    lm = Recording(
        pretrained=model, tokenizer=tokenizer, batch_size="auto", max_batch_size=4,
        max_length=MAX_LENGTH, device="cpu",
    )  # fmt: skip
    lm.loglikelihood(_loglikelihood_requests(PAIRS), disable_tqdm=True)
    assert lm.seen["probe"], _broke(
        "HFLMWithHooks._detect_batch_size", "--batch_size auto probed no batch through it"
    )


def test_a_shared_task_index_loads_tasks_with_the_new_metadata():
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    shared = TaskManager.__new__(TaskManager)
    adapter.share_task_index(shared, manager, {"lmc_contract": 7})
    assert shared.all_tasks == manager.all_tasks, _broke("share_task_index", "index differs")
    task = shared.load(TASK)["tasks"][TASK]
    metadata = task.config.metadata or {}
    assert metadata.get("lmc_contract") == 7, _broke(
        "share_task_index", f"the task's metadata is {metadata}"
    )
    own = manager.load(TASK)["tasks"][TASK].config.metadata or {}
    assert "lmc_contract" not in own, _broke("share_task_index", "the shared manager changed")


def test_declared_task_metrics_are_what_the_task_aggregates():
    from lm_eval.api import registry

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    task = manager.load(TASK)["tasks"][TASK]
    mean = registry.get_aggregation("mean")
    adapter.declare_task_metric(task, "lmc_contract_metric", mean, False)
    assert task.aggregation().get("lmc_contract_metric") is mean, _broke(
        "declare_task_metric", "Task.aggregation() does not list it"
    )
    assert task.higher_is_better().get("lmc_contract_metric") is False, _broke(
        "declare_task_metric", "Task.higher_is_better() does not list it"
    )


@pytest.mark.parametrize("frozen", [False, True])
def test_run_metrics_are_registered_and_removed_also_in_a_frozen_registry(frozen):
    from lm_eval.api import registry

    specs = {name: get_registry().metrics[name] for name in ("lss",)}
    tables = [getattr(registry, name) for name in adapter.METRIC_TABLES]
    if "lss" in registry.metric_registry:
        pytest.skip("an earlier run left lss registered in this process")
    saved = [adapter.registry_is_frozen(t) for t in tables]
    if frozen:
        for table in tables:
            table.freeze()
    try:
        with registered_metrics(specs):
            assert "lss" in registry.metric_registry, _broke("thawed", "lss not registered")
            assert registry.get_metric_aggregation("lss") is registry.get_aggregation("mean")
            assert [adapter.registry_is_frozen(t) for t in tables] == [frozen] * 3, _broke(
                "thawed", "the registries' frozen state changed"
            )
        assert all("lss" not in t for t in tables), _broke("unregister", "lss left behind")
        assert [adapter.registry_is_frozen(t) for t in tables] == [frozen] * 3, _broke(
            "unregister", "the registries' frozen state changed"
        )
    finally:
        for table, was in zip(tables, saved, strict=True):
            if adapter.registry_is_frozen(table) and not was:  # this test froze it: reopen
                table._objs = dict(table._objs)


def test_entry_point_plugins_are_detected_as_the_installed_lm_eval_has_them():
    import lm_eval

    found = adapter.has_entry_point_plugins()
    assert isinstance(found, bool)
    if lm_eval.__version__ == "0.4.13":
        assert found is False, _broke("has_entry_point_plugins", "0.4.13 has no plugin groups")


def test_the_run_command_parser_and_its_patch_take_the_geometry_flags():
    from lm_coupling.harness.cli import add_geometry_arguments

    parser = adapter.run_command_parser(add_geometry_arguments)
    args = parser.parse_args(["run", "--tasks", "t", "--metrics", "lss"])
    assert args.metrics == "lss", _broke("run_command_parser", "no --metrics on run")
    # The patch of the literal `lm_eval` run command, in a fresh interpreter.
    code = (
        "from lm_coupling.harness.cli import patch_run_command; patch_run_command(); "
        "from lm_eval._cli.harness import HarnessCLI; "
        "print(HarnessCLI()._parser.parse_args(['run','--tasks','t','--metrics','lss']).metrics)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("lss"), _broke(
        "patch_run_command", out.stderr.strip()[-500:]
    )


@pytest.mark.parametrize(
    ("limit", "samples"), [(None, [1, 3, 4]), (0.5, None), (2, None), (None, None)]
)
def test_evaluated_documents_are_the_requests_and_the_samples_file_of_a_run(
    tokenizer, limit, samples
):
    from lm_eval import simple_evaluate

    class RecordingRequests(Recording):
        def loglikelihood(self, requests, disable_tqdm=False):
            self.seen_requests = list(requests)
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    model = build_tiny_model("gpt2", len(tokenizer), max_len=64, seed=1)
    lm = RecordingRequests(
        pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=MAX_LENGTH, device="cpu"
    )
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    task = manager.load(TASK)["tasks"][TASK]
    documents = adapter.evaluated_documents(task, limit, samples)
    results = simple_evaluate(
        model=lm, tasks=[TASK], task_manager=manager, limit=limit, log_samples=True,
        samples={TASK: samples} if samples else None, bootstrap_iters=0,
    )  # fmt: skip
    requested = sorted({r.doc_id for r in lm.seen_requests})
    assert requested == [request for request, _, _ in documents], _broke(
        "evaluated_documents", f"the requests carry doc_ids {requested}"
    )
    logged = {row["doc_id"]: row["doc"] for row in results["samples"][TASK]}
    assert list(logged) == [reported for _, reported, _ in documents], _broke(
        "evaluated_documents/reported_doc_id", f"the samples file names {list(logged)}"
    )
    for request, reported, doc in documents:
        assert adapter.reported_doc_id(samples, request) == reported
        assert logged[reported] == doc, _broke("evaluated_documents", f"document {reported}")
    if samples:
        assert [reported for _, reported, _ in documents] == samples
        assert [doc for _, _, doc in documents] == [task.eval_docs[i] for i in samples]


def test_git_commit_probe_is_the_git_hash_a_run_records(lm):
    import lm_eval.evaluator as evaluator
    from lm_eval import simple_evaluate
    from lm_eval.loggers.utils import get_git_commit_hash

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    with adapter.git_commit_probe(lambda: "lmc-contract-probe"):
        results = simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, limit=1)
    assert results["git_hash"] == "lmc-contract-probe", _broke(
        "git_commit_probe", f"the run recorded git_hash {results['git_hash']!r}"
    )
    assert evaluator.get_git_commit_hash is get_git_commit_hash, _broke(
        "git_commit_probe", "lm-eval's own probe was not restored"
    )


def test_commit_from_path_reads_the_commit_of_a_git_folder(tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / ".git" / "refs" / "heads").mkdir(parents=True)
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / ".git" / "refs" / "heads" / "main").write_text(sha + "\n")
    assert adapter.commit_from_path(str(tmp_path)) == sha, _broke("commit_from_path", "no commit")
    (tmp_path / "elsewhere").mkdir()
    assert adapter.commit_from_path(str(tmp_path / "elsewhere")) is None, _broke(
        "commit_from_path", "a commit outside a checkout"
    )


def test_the_metadata_hint_comes_from_the_task_logger():
    import logging

    from lm_coupling.harness.quiet import QuietFilter

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    task_log = logging.getLogger(adapter.TASK_LOGGER)
    task_log.addHandler(handler)
    # An earlier in-process lm-eval run of this worker may have set lm-eval's level to ERROR.
    lm_eval_log = logging.getLogger("lm_eval")
    level = lm_eval_log.level
    lm_eval_log.setLevel(logging.WARNING)
    try:
        TaskManager(include_path=str(TASKS_DIR), include_defaults=False).load(TASK)
    finally:
        task_log.removeHandler(handler)
        lm_eval_log.setLevel(level)
    hints = [r for r in records if r.getMessage().startswith(f"{TASK}: Custom kwargs")]
    assert hints, _broke("TASK_LOGGER", f"no --metadata hint for {TASK} through it")
    assert not QuietFilter().filter(hints[0]), _broke(
        "TASK_LOGGER", f"the hint's text changed: {hints[0].getMessage()[:80]!r}"
    )


def test_templates_compiled_once_render_what_lm_eval_renders_and_are_restored():
    from lm_eval import utils

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    task = manager.load(TASK)["tasks"][TASK]
    docs = list(task.test_docs())[:6]
    fresh = [(task.doc_to_target(d), task.doc_to_text(d), task.doc_to_choice(d)) for d in docs]
    compiled = []
    original = utils.env.from_string
    with adapter.templates_compiled_once():
        compile_ = utils.env.from_string
        assert compile_ is not original, _broke("templates_compiled_once", "not installed")
        reused = compile_("{{ a }}") is compile_("{{ a }}")
        assert reused, _broke("templates_compiled_once", "a template is compiled twice")
        for d in docs:
            compiled.append((task.doc_to_target(d), task.doc_to_text(d), task.doc_to_choice(d)))
    assert compiled == fresh, _broke("templates_compiled_once", "apply_template renders otherwise")
    assert "from_string" not in utils.env.__dict__, _broke(
        "templates_compiled_once", "lm-eval's environment was not restored"
    )
    assert utils.apply_template("{{ x }}!", {"x": 3}) == "3!"
