"""The overhead bench's verdicts are read from the rounds' confidence interval."""

from __future__ import annotations

import gc
import logging
import math
import statistics
from types import SimpleNamespace

import pytest

T_975 = {1: 12.706204736174705, 4: 2.7764451051977987}
"""Student t quantiles at 0.975 (1 and 4 degrees of freedom), from the tables."""

BUNDLED_ROUNDS = [1.090, 1.071, 1.089, 1.097, 1.088]  # session 12, bundled model
GPT2_ROUNDS = [1.016, 1.064, 1.021, 1.012, 1.068]  # session 13, GPT-2-small shape


@pytest.fixture
def overhead(bench_module):
    return bench_module("overhead")


def test_interval_of_two_rounds_is_the_t_interval(overhead):
    mean, low, high = overhead.round_interval([1.0, 1.1])
    half = T_975[1] * (0.1 / math.sqrt(2)) / math.sqrt(2)
    assert mean == pytest.approx(1.05)
    assert (low, high) == pytest.approx((1.05 - half, 1.05 + half))


def test_rounds_wholly_above_the_target_miss_it(overhead):
    line = overhead.verdict_line(1.088, BUNDLED_ROUNDS)
    mean = statistics.fmean(BUNDLED_ROUNDS)
    half = T_975[4] * statistics.stdev(BUNDLED_ROUNDS) / math.sqrt(5)
    assert mean - half > 1.05
    assert line == (
        f"traj_lens MISSES the 1.05x per-document CPU target (1.088x; rounds' mean "
        f"{mean:.3f}, 95% interval {mean - half:.3f}-{mean + half:.3f} over 5 rounds)"
    )


def test_rounds_wholly_below_the_target_meet_it(overhead):
    line = overhead.verdict_line(1.02, [1.01, 1.03, 1.02])
    assert line.startswith("traj_lens meets the 1.05x per-document CPU target (1.020x; ")
    assert line.endswith("over 3 rounds)")


def test_an_interval_across_the_target_is_undecided_and_says_how_many_rounds(overhead):
    line = overhead.verdict_line(1.021, GPT2_ROUNDS)
    assert line.startswith("traj_lens is undecided against the 1.05x per-document CPU target")
    needed = overhead.rounds_to_settle(GPT2_ROUNDS)
    assert f"which contains the target; about {needed} rounds would settle it)" in line
    # At that many rounds of the same spread, the t interval just clears the target;
    # the normal quantile (1.96) alone would have settled for fewer rounds.
    from scipy import stats

    mean, spread = statistics.fmean(GPT2_ROUNDS), statistics.stdev(GPT2_ROUNDS)
    gap = abs(mean - 1.05)
    assert stats.t.ppf(0.975, needed - 1) * spread / math.sqrt(needed) <= gap
    assert stats.t.ppf(0.975, needed - 2) * spread / math.sqrt(needed - 1) > gap
    assert 1.959964 * spread / math.sqrt(needed - 1) <= gap


def test_one_round_gives_the_median_verdict_alone(overhead):
    assert overhead.verdict_line(1.02, [1.02]) == (
        "traj_lens meets the 1.05x per-document CPU target (1.020x)"
    )
    assert overhead.verdict_line(1.09, [1.09]) == (
        "traj_lens MISSES the 1.05x per-document CPU target (1.090x)"
    )
    with pytest.raises(ValueError, match="at least two rounds"):
        overhead.round_interval([1.02])


def test_marginal_rounds_alternate_which_configuration_runs_first(bench_module):
    marginal = bench_module("marginal")
    names = ["plain", "traj_lens"]
    orders = [marginal.run_order(names, r) for r in range(4)]
    assert orders == [names, names[::-1], names, names[::-1]]
    firsts = [order[0] for order in orders]
    assert firsts.count("plain") == firsts.count("traj_lens")  # an even number of rounds


def test_paired_without_marginal_is_refused(overhead, capsys):
    with pytest.raises(SystemExit) as exit_info:
        overhead.parse_args(["--paired"])
    assert exit_info.value.code == 2
    assert "add --marginal" in capsys.readouterr().err
    assert overhead.parse_args(["--marginal", "10,20", "--paired"]).paired


def test_in_process_needs_marginal_and_excludes_paired(overhead, capsys):
    for argv, said in (
        (["--in-process"], "add --marginal"),
        (["--marginal", "10,20", "--in-process", "--paired"], "one at a time"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            overhead.parse_args(argv)
        assert exit_info.value.code == 2
        assert said in capsys.readouterr().err
    assert overhead.parse_args(["--marginal", "10,20", "--in-process"]).in_process


def test_in_process_rounds_run_every_configuration_at_both_sizes(
    tmp_path, monkeypatch, bench_module
):
    """Real in-process runs on the bundled model: CPU measured, no per-run peak memory."""
    monkeypatch.setenv("LM_COUPLING_DATA_DIR", str(tmp_path / "data"))  # restored afterwards
    marginal = bench_module("marginal")
    metrics = bench_module("lmeval_runs").TRAJ_LENS

    from lm_coupling.demo.assets import bundled_model_path

    configs = {"plain": (None, None), "traj_lens": (metrics, None)}
    lm_eval_log = logging.getLogger("lm_eval")
    level = lm_eval_log.level  # the bench runs lm-eval at verbosity ERROR: restored after
    try:
        out = marginal.marginal(str(bundled_model_path()), (2, 4), configs, "8", "cpu",
                                tmp_path / "data", repeats=1, in_process=True)  # fmt: skip
    finally:
        lm_eval_log.setLevel(level)
    for name in configs:
        for n in (2, 4):
            (result,) = out[name][n]
            assert result["cpu_s"] > 0 and math.isnan(result["peak_mb"])
            assert 0 <= result["gc_s"] < result["wall_s"] and result["gc_full"] >= 0
    assert [out["traj_lens"][n][0]["n_geometry"] for n in (2, 4)] == [2, 4]
    assert all(out["plain"][n][0]["n_geometry"] == 0 for n in (2, 4))
    lines = bench_module("overhead").collector_lines(out, (2, 4), list(configs))
    for name in configs:
        counts = f"{out[name][2][0]['gc_full']} -> {out[name][4][0]['gc_full']}"
        assert f"  {name}: " in lines and f"full collections {counts}" in lines
    assert "cpu ratio without the collector's time: traj_lens " in lines
    with pytest.raises(ValueError, match="one at a time"):
        marginal.marginal("unused", (2, 4), configs, "8", "cpu", tmp_path / "data",
                          paired=True, in_process=True)  # fmt: skip


def test_collector_time_counts_full_collections_inside_it_only(bench_module):
    CollectorTime = bench_module("lmeval_runs").CollectorTime

    with CollectorTime() as clock:
        gc.collect(0)  # a young collection: timed, not a full one
        assert clock.full == 0 and clock.seconds > 0
        gc.collect()
    assert clock.full == 1
    seconds = clock.seconds
    gc.collect()  # after the context: not counted
    assert (clock.full, clock.seconds) == (1, seconds)


def test_default_mode_reads_wall_and_peak_memory_verdicts_from_the_rounds(overhead, capsys):
    # Session 20's default-mode rounds: one fresh process's peak moved by 100-200 MiB
    # between runs of the same code, so the memory verdict needs the rounds, not one run.
    args = SimpleNamespace(
        shape={"d_model": 768}, device="cpu", tasks="t", limit=None, batch_size=8, repeats=3
    )
    times = {
        "plain": [(13.0, 24.0), (13.4, 24.4), (13.2, 24.1)],
        "traj_lens": [(13.5, 25.0), (13.9, 25.2), (13.7, 25.1)],
    }
    memory = {"plain": [1375.0, 1408.0, 1390.0], "traj_lens": [1601.0, 1501.0, 1450.0]}
    overhead.report(args, times, memory)
    out = capsys.readouterr().out
    wall_rounds = [13.5 / 13.0, 13.9 / 13.4, 13.7 / 13.2]
    peak_rounds = [1601 / 1375, 1501 / 1408, 1450 / 1390]
    assert (
        "traj_lens wall ratio of each round: " + ", ".join(f"{r:.3f}" for r in wall_rounds) in out
    )
    assert (
        "traj_lens peak memory ratio of each round: " + ", ".join(f"{r:.3f}" for r in peak_rounds)
        in out
    )
    assert overhead.verdict_line(13.7 / 13.2, wall_rounds, target="wall-time") in out
    assert overhead.verdict_line(1501 / 1390, peak_rounds, target="peak-memory") in out
    # Wall rounds 1.036-1.038: meets; peak rounds 1.043-1.164: the interval holds 1.05.
    assert "traj_lens meets the 1.05x wall-time target (1.038x; " in out
    assert "traj_lens is undecided against the 1.05x peak-memory target (1.080x; " in out
