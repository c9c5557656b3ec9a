"""The library core: one implementation behind every route, no state between runs.

- The three routes (``lm_coupling.evaluate``, ``lm-coupling run`` and the
  literal ``lm_eval ... --metrics``) write identical results and geometry files.
- Two evaluations one after the other in one process each give the values the
  model gives alone; two at once are refused with a clear error.
- Errors are exceptions (before anything loads where they can be known then).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fixtures.outputs import differences, written_files
from harness_cli import check_ok, offline_env, plugin_registered, require_startup_hook, run_cli

import lm_coupling
from lm_coupling import hookimpl

pytestmark = pytest.mark.slow

TASKS = "lmc_arc_easy_offline,lmc_gsm8k_offline"
METRIC_ARGS = "coupling_docs=1"


def _cli_args(setup, output: Path) -> list[str]:
    return [
        "--model", "hf",
        "--model_args", f"pretrained={setup.models['gpt2']}",
        "--tasks", TASKS,
        "--batch_size", "2",
        "--device", "cpu",
        "--limit", "2",
        "--num_fewshot", "0",
        "--metrics", "all",
        "--metric_args", METRIC_ARGS,
        "--gen_kwargs", "max_gen_toks=16",
        "--metadata", json.dumps({"lmc_data_dir": str(setup.data_dir)}),
        "--output_path", str(output),
    ]  # fmt: skip


def _python_kwargs(setup, output: Path) -> dict:
    return {
        "model_args": {"pretrained": str(setup.models["gpt2"])},
        "tasks": TASKS,
        "batch_size": 2,
        "device": "cpu",
        "limit": 2,
        "num_fewshot": 0,
        "metrics": "all",
        "metric_args": METRIC_ARGS,
        "gen_kwargs": {"max_gen_toks": 16},
        "metadata": {"lmc_data_dir": str(setup.data_dir)},
        "output_path": str(output),
    }


@pytest.fixture(scope="module")
def three_routes(harness_setup, tmp_path_factory):
    root = tmp_path_factory.mktemp("routes")
    lm_coupling.evaluate(**_python_kwargs(harness_setup, root / "python" / "results"))
    require_startup_hook()
    for program in ("lm-coupling", "lm_eval"):
        cwd = root / program
        run = run_cli(program, _cli_args(harness_setup, cwd / "results"), cwd)
        check_ok(run)
    return {
        route: written_files(root / route / "results")
        for route in ("python", "lm-coupling", "lm_eval")
    }


@pytest.mark.parametrize("route", ["lm-coupling", "lm_eval"])
def test_the_three_routes_write_identical_files(three_routes, route):
    python = three_routes["python"]
    assert set(python) == {
        "results",
        "geometry_lmc_arc_easy_offline",
        "geometry_lmc_gsm8k_offline",
    }
    assert set(three_routes[route]) == set(python)
    for name, content in python.items():
        problems = differences(content, three_routes[route][name], rel=1e-9)
        assert not problems, f"{route} {name}:\n" + "\n".join(problems)


# -- no state between runs ------------------------------------------------------------------


def _values(results: dict) -> dict[str, float]:
    """Every geometry value (and accuracy) of a run, by ``task/metric,filter``."""
    return {
        f"{task}/{key}": value
        for task, metrics in results["results"].items()
        for key, value in metrics.items()
        if isinstance(value, float)
    }


@pytest.fixture(scope="module")
def shared_index():
    from lm_eval.tasks import TaskManager

    from lm_coupling.harness.run import TASKS_DIR

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def _in_process(setup, model: str, shared_index) -> dict:
    return lm_coupling.evaluate(
        model_args={"pretrained": str(setup.models[model])},
        tasks="lmc_arc_easy_offline",
        metrics="lss,logit_lens_entropy,coupling",
        metric_args="coupling_docs=2",
        batch_size=2,
        device="cpu",
        limit=3,
        num_fewshot=0,
        metadata={"lmc_data_dir": str(setup.data_dir)},
        task_manager=shared_index,
    )


ALONE = """
import json, sys
import lm_coupling
results = lm_coupling.evaluate(
    model_args={{"pretrained": {model!r}}}, tasks="lmc_arc_easy_offline",
    metrics="lss,logit_lens_entropy,coupling", metric_args="coupling_docs=2", batch_size=2,
    device="cpu", limit=3, num_fewshot=0, metadata={{"lmc_data_dir": {data!r}}},
)
print("RESULTS " + json.dumps(results["results"]))
"""


def test_two_models_one_after_the_other_give_their_values_alone(harness_setup, shared_index):
    first = _in_process(harness_setup, "gpt2", shared_index)  # the first run of the process
    second = _in_process(harness_setup, "llama", shared_index)  # after another model's run
    again = _in_process(harness_setup, "gpt2", shared_index)  # after llama's run
    assert _values(again) == pytest.approx(_values(first), rel=1e-6, nan_ok=True)
    code = ALONE.format(model=str(harness_setup.models["llama"]), data=str(harness_setup.data_dir))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=offline_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULTS ")]
    alone = _values({"results": json.loads(line.removeprefix("RESULTS "))})
    assert _values(second) == pytest.approx(alone, rel=1e-6, nan_ok=True)
    assert _values(second)["lmc_arc_easy_offline/coupling,none"] != pytest.approx(
        _values(first)["lmc_arc_easy_offline/coupling,none"]
    )  # two different models: the comparison above could fail


class Gate:
    """Holds the first evaluation inside its first captured batch until released."""

    def __init__(self):
        self.inside = threading.Event()
        self.release = threading.Event()

    @hookimpl
    def lmc_compute_batch(self, states):
        self.inside.set()
        self.release.wait(timeout=120)


def test_a_second_evaluation_at_once_is_refused(harness_setup, shared_index):
    gate, outcome = Gate(), {}

    def first_run():
        try:
            outcome["first"] = _in_process(harness_setup, "gpt2", shared_index)
        except Exception as exc:  # reported below
            outcome["first"] = exc

    with plugin_registered(gate, "test.gate"):
        thread = threading.Thread(target=first_run)
        thread.start()
        try:
            assert gate.inside.wait(timeout=120), "the first evaluation never reached a batch"
            with pytest.raises(lm_coupling.ConcurrentRunError, match="one after the other"):
                _in_process(harness_setup, "llama", shared_index)
        finally:
            gate.release.set()
            thread.join(timeout=300)
    assert isinstance(outcome["first"], dict), outcome["first"]
    assert "lss,none" in outcome["first"]["results"]["lmc_arc_easy_offline"]


# -- errors are exceptions --------------------------------------------------------------------


def test_a_missing_model_path_is_named_before_tasks_are_indexed(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(lm_coupling.ModelNotFoundError, match=f"no model at {missing}"):
        lm_coupling.evaluate(model_args={"pretrained": str(missing)}, tasks="lmc_arc_easy_offline")
    assert issubclass(lm_coupling.ModelNotFoundError, lm_coupling.LmCouplingError)


def test_the_command_line_turns_the_error_into_exit_code_2(tmp_path):
    missing = tmp_path / "nowhere"
    done = subprocess.run(
        [sys.executable, "-m", "lm_coupling", "run", "--model_args", f"pretrained={missing}",
         "--tasks", "lmc_arc_easy_offline", "--metrics", "all"],
        capture_output=True, text=True, env=offline_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"lm-coupling: error: no model at {missing}" in done.stderr
    assert "Traceback" not in done.stderr


def test_unknown_options_raise_before_anything_loads():
    with pytest.raises(lm_coupling.ConfigurationError, match="Did you mean 'coupling'"):
        lm_coupling.evaluate(model_args={"pretrained": "x"}, metrics="couplng")
    with pytest.raises(lm_coupling.ConfigurationError, match="not both"):
        lm_coupling.evaluate(model=object(), model_args={"pretrained": "x"}, tokenizer=object())


def test_without_an_output_path_nothing_is_written_and_all_is_returned(
    harness_setup, shared_index, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    results = lm_coupling.evaluate(
        model_args={"pretrained": str(harness_setup.models["gpt2"])},
        tasks="lmc_arc_easy_offline",
        metrics="lss,coupling",
        metric_args="coupling_docs=1",
        limit=2,
        num_fewshot=0,
        log_samples=True,
        metadata={"lmc_data_dir": str(harness_setup.data_dir)},
        task_manager=shared_index,
    )
    assert list(tmp_path.iterdir()) == []
    rows = results["samples"]["lmc_arc_easy_offline"]
    assert len(rows) == 2 and all("lss" in row for row in rows)
    geometry = results["geometry"]["lmc_arc_easy_offline"]
    assert geometry["n_measured"] == {"lss": 2, "coupling": 1}
    assert geometry["coupling"]["n_sampled"] == 1
    # Where the time went, per document and per layer (issue: "visible progress").
    timings = geometry["timings"]
    assert timings["n_documents_per_part"]["forward_capture"] == 2
    assert timings["n_documents_per_part"]["jacobian"] == 1  # the coupling sample
    seconds = timings["seconds_per_document"]
    assert all(seconds[p] > 0 for p in ("forward_capture", "metrics", "jacobian"))
    assert seconds["jacobian_products"] + seconds["factorisation"] <= seconds["jacobian"]
    n_layers = results["config"]["lm_coupling"]["model_shape"]["n_layers"]
    assert len(timings["per_layer"]["factorisation_per_layer"]) == n_layers
