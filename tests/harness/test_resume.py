"""An interrupted run, rerun with the same command, ends with the numbers of an uninterrupted one.

lm-eval's ``--use_cache`` stores each request's answer as it is computed; a
rerun hands the model only the requests the cache cannot answer, so a
document's answer choices may arrive split. The real ``lm_eval`` process is
interrupted with SIGINT part-way through its log-likelihood requests (a test
plugin, installed as a distribution with an entry point, slows each captured
batch so that "part-way" can be hit), then rerun: every geometry value equals
the uninterrupted run's, and no document failed, on multiple-choice,
WinoGrande-style (choices are contexts) and generation tasks.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest
from fixtures.catalogue import default_metrics
from harness_cli import (
    BIN,
    check_ok,
    offline_env,
    read_outputs,
    require_startup_hook,
    run_cli,
    sigint_as_at_a_terminal,
)

pytestmark = pytest.mark.slow

TASKS = "lmc_arc_easy_offline,lmc_winogrande_offline,lmc_gsm8k_offline"
PROGRESS = re.compile(r"Running loglikelihood requests:\s+(\d+)%")
GEOMETRY = default_metrics()


def _slow_plugin(root: Path) -> Path:
    """A distribution whose lm_coupling plugin sleeps in every captured batch."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "lmc_slow_batches.py").write_text(
        textwrap.dedent(
            '''
            """Test plugin: every captured batch takes 0.3 s longer."""
            import time

            from lm_coupling import hookimpl


            @hookimpl
            def lmc_compute_batch(selected, states):
                time.sleep(0.3)
            '''
        ),
        encoding="utf-8",
    )
    info = root / "lmc_slow_batches-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmc-slow-batches\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lm_coupling]\nslow = lmc_slow_batches\n")
    return root


def _args(setup, cache: Path | None) -> list[str]:
    args = [
        "--model", "hf",
        "--model_args", f"pretrained={setup.models['gpt2']}",
        "--tasks", TASKS,
        "--metadata", json.dumps({"lmc_data_dir": str(setup.data_dir)}),
        "--batch_size", "2",
        "--limit", "5",
        "--num_fewshot", "0",
        "--gen_kwargs", "max_gen_toks=8",
        "--metrics", "all",
        "--metric_args", "coupling_docs=3",
        "--output_path", "results",
    ]  # fmt: skip
    return [*args, "--use_cache", str(cache)] if cache is not None else args


def _interrupt_part_way(command: list[str], cwd: Path, env: dict, at_percent: int = 30) -> int:
    """Start ``command``; send SIGINT once lm-eval's log-likelihood bar passes ``at_percent``."""
    cwd.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_at_a_terminal,
    )
    seen: list[int] = []

    def watch() -> None:
        buffer = ""
        while True:
            chunk = process.stderr.read(256)
            if not chunk:
                return
            buffer = (buffer + chunk)[-2000:]
            found = [int(p) for p in PROGRESS.findall(buffer)]
            if found and max(found) >= at_percent and not seen:
                seen.append(max(found))
                process.send_signal(signal.SIGINT)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = process.wait(timeout=900)
    watcher.join(timeout=10)
    process.stderr.close()
    assert seen, "the run ended before its requests reached the interruption point"
    assert seen[0] < 100
    return code


def _geometry_values(run) -> dict[str, float]:
    return {
        f"{task}/{key}": value
        for task, metrics in run.results["results"].items()
        for key, value in metrics.items()
        if key.split(",")[0] in GEOMETRY and isinstance(value, float)
    }


@pytest.fixture(scope="module")
def resumed(harness_setup, tmp_path_factory):
    require_startup_hook()
    root = tmp_path_factory.mktemp("resume")
    env = offline_env()
    plugin_dir = _slow_plugin(root / "plugin")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir), env.get("PYTHONPATH")]))
    straight = check_ok(run_cli("lm_eval", _args(harness_setup, None), root / "straight"))
    cache = root / "interrupted" / "cache" / "lm"
    command = [str(BIN / "lm_eval"), *_args(harness_setup, cache)]
    code = _interrupt_part_way(command, root / "interrupted", env)
    assert code != 0  # interrupted, not finished
    done = subprocess.run(
        command, cwd=root / "interrupted", env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from harness_cli import RunOutput

    rerun = read_outputs(
        RunOutput(done.returncode, done.stdout, done.stderr, root / "interrupted" / "results")
    )
    return straight, rerun


def test_the_resumed_run_equals_the_uninterrupted_one(resumed):
    straight, rerun = resumed
    expected, found = _geometry_values(straight), _geometry_values(rerun)
    assert len(expected) >= 3 * len(GEOMETRY)
    assert found.keys() == expected.keys()
    worst = max(abs(found[k] - expected[k]) / max(abs(expected[k]), 1e-12) for k in expected)
    print(
        f"resumed vs uninterrupted: {len(expected)} values, largest relative difference {worst:.2e}"
    )
    assert worst < 1e-4, {k: (found[k], expected[k]) for k in expected if found[k] != expected[k]}
    for task in ("lmc_arc_easy_offline", "lmc_winogrande_offline", "lmc_gsm8k_offline"):
        accuracy = [k for k in straight.results["results"][task] if k.startswith(("acc,", "exact"))]
        for key in accuracy:
            assert rerun.results["results"][task][key] == straight.results["results"][task][key]


def test_no_document_failed_and_every_profile_matches(resumed):
    straight, rerun = resumed
    for task, document in rerun.geometry.items():
        assert document["capture"]["failed"] == 0, (task, document["failures"])
        reference = straight.geometry[task]
        assert document["n_measured"] == reference["n_measured"]
        for name, profile in reference["profiles"].items():
            for a, b in zip(profile["mean"], document["profiles"][name]["mean"], strict=True):
                a, b = (x if not isinstance(x, list) else x[0] for x in (a, b))
                if a is None or (isinstance(a, float) and math.isnan(a)):
                    continue
                assert b == pytest.approx(a, rel=1e-4, abs=1e-6), (task, name)
    assert sum(d["capture"]["cached"] for d in rerun.geometry.values()) > 0  # it did resume


def test_the_geometry_bar_of_a_resumed_run_ends_at_its_total(harness_setup, tmp_path, monkeypatch):
    """Resumed with ``--use_cache``, lm-coupling's own progress bar ends at its total (issue 27).

    The bar counts the sampled (Jacobian) documents measured inside lm-eval's
    request loop; a document whose measured request the cache answers never
    reaches the model there, so it must not be in the bar's total either (the
    bar once stopped at 55/60). The real ``lm_eval`` is interrupted with
    SIGINT; the same run, resumed through `lm_coupling.evaluate` with the same
    cache, records each bar's count and total when the bar closes.
    """
    import lm_coupling
    from lm_coupling.harness import model

    require_startup_hook()
    env = offline_env()
    plugin_dir = _slow_plugin(tmp_path / "plugin")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir), env.get("PYTHONPATH")]))
    cache = tmp_path / "interrupted" / "cache" / "lm"
    args = _args(harness_setup, cache)
    args[args.index("coupling_docs=3")] = "coupling_docs=5"  # every document is sampled
    code = _interrupt_part_way([str(BIN / "lm_eval"), *args], tmp_path / "interrupted", env, 50)
    assert code != 0  # interrupted, not finished

    drawn = []
    stock = model.geometry_progress

    def recording(*args, **kwargs):
        bar = stock(*args, **kwargs)
        if not bar.disable:  # a line is drawn (closing it disables it)
            drawn.append(bar)
        return bar

    monkeypatch.setattr(model, "geometry_progress", recording)
    results = lm_coupling.evaluate(
        model_args={"pretrained": str(harness_setup.models["gpt2"])},
        tasks=TASKS.split(","),
        metrics="all",
        metric_args="coupling_docs=5",
        metadata={"lmc_data_dir": str(harness_setup.data_dir)},
        batch_size=2,
        limit=5,
        num_fewshot=0,
        gen_kwargs="max_gen_toks=8",
        use_cache=str(cache),
        output_path=str(tmp_path / "resumed"),
    )
    capture = results["config"]["lm_coupling"]["capture"]
    cached = sum(counts["cached"] for counts in capture.values())
    assert cached > 0, capture  # it did resume: some documents came from the cache
    # Each drawn bar as it stood when the loop ended (closed, it keeps its count).
    bars = [(bar.desc, bar.n, bar.total) for bar in drawn]
    assert bars, "no geometry progress bar was drawn"
    for label, count, total in bars:
        assert count == total, (label, count, total)
    sampled = sum(
        counts["coupling"] for counts in results["config"]["lm_coupling"]["n_measured"].values()
    )
    # Some sampled documents were answered from the cache, so the bars planned fewer.
    assert sum(total for _, _, total in bars) < sampled, (bars, sampled)
