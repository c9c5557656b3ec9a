"""End-to-end report tests on real lm_eval results files (geometry added: see make_results.py)."""

from __future__ import annotations

import argparse
import json
import struct

import numpy as np
import pandas as pd
import pytest
import statsmodels.api as sm
from make_results import GEOMETRY, TASK, make_results_dir, model_rows, write_row
from scipy import stats
from statsmodels.stats.multitest import multipletests

from lm_coupling.report import ReportInputError, ReportWarning, build_report
from lm_coupling.report.benchmarks import BOUNDARY_COLUMN
from lm_coupling.report.cli import add_report_arguments, run_report
from lm_coupling.report.controls import CONTROL_COLUMNS
from lm_coupling.report.figures import DPI, FIGSIZE
from lm_coupling.report.loading import CatalogueWarning, k_setting_name
from lm_coupling.report.stats import CORRELATION_COLUMNS, N_BOOT

# The leaderboard's geometry columns: make_results' metrics, named after K=4 where they have one.
GEOMETRY_COLS = [*(k_setting_name(m, {"k": 4}) for m in GEOMETRY), BOUNDARY_COLUMN]
# The session fixture runs the real lm_eval CLI three times (about 20-60 s on 2 cores).
pytestmark = pytest.mark.slow


def _with_companions(metric):
    extra = ["__k_used"] if metric not in (*GEOMETRY, BOUNDARY_COLUMN) else []
    return [metric, f"{metric}__tasks", f"{metric}__n", *[metric + e for e in extra]]


LEADERBOARD_COLS = [
    "model",
    "revision",
    "dtype",
    "step",
    "n_params",
    "n_layers",
    "d_model",
    "arc",
    "hellaswag",
    "n_benchmarks",
    "average",
    *[c for m in GEOMETRY_COLS for c in _with_companions(m)],
    "settings",
    "limited",
    "metric_options",
    "mixed_settings",
]


@pytest.fixture(scope="module")
def report(real_runs, tmp_path_factory):
    root = make_results_dir(tmp_path_factory.mktemp("results"), real_runs)
    return build_report(root, seed=3, figure_formats="png,svg")


def test_csv_schemas(report):
    out = report.out_dir
    assert list(pd.read_csv(out / "leaderboard.csv").columns) == LEADERBOARD_COLS
    assert list(pd.read_csv(out / "geometry_long.csv").columns) == [
        "model",
        "revision",
        "dtype",
        "task",
        "metric",
        "layer",
        "value",
        "stderr",
        "n",
    ]
    assert list(pd.read_csv(out / "correlations.csv").columns) == CORRELATION_COLUMNS
    assert list(pd.read_csv(out / "controls.csv").columns) == CONTROL_COLUMNS
    board = pd.read_csv(out / "leaderboard.csv")
    assert len(board) == 9 and board["step"].dropna().tolist() == [2000, 1000, 3000]
    # Two of the six benchmarks: no average (a mean over a different subset compares nothing).
    assert board["average"].isna().all() and (board["n_benchmarks"] <= 2).all()
    # The first three models ran ARC only: every geometry value is over ARC, for every model.
    assert set(board["coupling_k4__tasks"]) == {TASK}
    assert (board["coupling_k4__n"] == 4).all() and (board["lss__n"] == 24).all()
    assert (board["coupling_k4__k_used"].astype(str) == "4").all()
    assert report.primary_target == "arc"
    # Declared in the Open LLM v1 setting (make_results): ARC 25-shot, HellaSwag 10-shot.
    assert board.loc[0, "settings"].startswith("10-shot: lmc_hellaswag_offline; 25-shot: ")
    assert board["limited"].isna().all() and board["mixed_settings"].isna().all()
    assert set(board["metric_options"]) == {"k=4"}
    text = (out / "leaderboard.csv").read_text().splitlines()
    header, first = text[0].split(","), text[1].split(",")
    for column in ("n_params", "n_layers", "d_model", "n_benchmarks", "lss__n", "step"):
        value = first[header.index(column)]
        assert value == "" or value.isdigit(), (column, value)  # 4, never 4.0
    long = pd.read_csv(out / "geometry_long.csv")
    scalars = long[long["layer"].isna()].set_index("metric")
    assert (scalars.loc["coupling_k4", "n"] == 4).all() and (scalars.loc["lss", "n"] == 24).all()
    wlss = long[long["metric"] == "windowed_lss"]
    assert wlss["layer"].min() == 1


def _boot(x, y, seed):
    rng = np.random.default_rng(seed)
    slopes = []
    for _ in range(N_BOOT):
        i = rng.integers(0, len(x), len(x))
        if np.ptp(x[i]) > 0:
            slopes.append(np.polyfit(x[i], y[i], 1)[0])
    return np.percentile(slopes, [2.5, 97.5])


def _independent(board):
    """One row per model: tiny-a's main (its last revision), not its step1000, checkpoint-2000
    and step_3000 rows (make_results.CLONES): checkpoints are not independent models."""
    tiny_a = board["model"].str.endswith("tiny-a")
    out = board[~tiny_a | (board["revision"] == "main")].reset_index(drop=True)
    assert len(board) == 9 and len(out) == 6
    return out


def test_correlations_recomputed_from_leaderboard(report):
    board = _independent(pd.read_csv(report.out_dir / "leaderboard.csv"))
    corr = pd.read_csv(report.out_dir / "correlations.csv").fillna({"reason": ""})
    assert corr["primary"].sum() == 1
    assert corr.loc[corr["primary"], ["metric", "target"]].values.tolist() == [
        ["coupling_k4", "arc"]
    ]
    assert set(corr["task_set"]) == {TASK}
    for row in corr.to_dict("records"):
        data = board[[row["metric"], row["target"]]].dropna().to_numpy()
        x, y = data[:, 0], data[:, 1]
        assert row["n"] == len(x)
        if row["reason"]:
            continue
        fit = sm.OLS(y, sm.add_constant(x)).fit(cov_type="HC3")
        np.testing.assert_allclose(
            [row["slope"], row["intercept"], row["r2"], row["p_hc3"]],
            [fit.params[1], fit.params[0], fit.rsquared, fit.pvalues[1]],
            rtol=1e-6,
        )
        np.testing.assert_allclose([row["ci_low"], row["ci_high"]], fit.conf_int()[1], rtol=1e-6)
        rho, rho_p = stats.spearmanr(x, y)
        tau, tau_p = stats.kendalltau(x, y)
        np.testing.assert_allclose(
            [row["spearman_rho"], row["spearman_p"], row["kendall_tau"], row["kendall_p"]],
            [rho, rho_p, tau, tau_p],
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            [row["boot_ci_low"], row["boot_ci_high"]], _boot(x, y, 3), rtol=1e-6
        )
    ok = corr["p_hc3"].notna()
    assert (corr.loc[corr["n"] < 5, "p_hc3"].isna()).all()
    np.testing.assert_allclose(
        corr.loc[ok, "p_holm"], multipletests(corr.loc[ok, "p_hc3"], method="holm")[1], rtol=1e-9
    )


def test_controls_recomputed_from_leaderboard(report):
    board = _independent(pd.read_csv(report.out_dir / "leaderboard.csv"))
    ctrl = pd.read_csv(report.out_dir / "controls.csv").fillna({"reason": ""})
    z = np.column_stack([np.log10(board["n_params"]), board["n_layers"], board["d_model"]])
    y = board["arc"].to_numpy()
    size = ctrl[ctrl["analysis"] == "control"].set_index("metric")
    fit = sm.OLS(y, sm.add_constant(z[:, 0])).fit(cov_type="HC3")
    assert size.loc["log_n_params", "slope"] == pytest.approx(fit.params[1], rel=1e-6)
    assert size.loc["log_n_params", "p_hc3"] == pytest.approx(fit.pvalues[1], rel=1e-6)
    n, k = len(y), 3
    for metric in GEOMETRY_COLS:
        x = board[metric].to_numpy()
        rows = ctrl[ctrl["metric"] == metric].set_index("analysis")
        zc = sm.add_constant(z)
        rx, ry = sm.OLS(x, zc).fit().resid, sm.OLS(y, zc).fit().resid
        r = stats.pearsonr(rx, ry)[0]
        t = r * np.sqrt((n - 2 - k) / (1 - r**2))
        assert rows.loc["partial", "partial_r"] == pytest.approx(r, rel=1e-6)
        assert rows.loc["partial", "partial_p"] == pytest.approx(
            2 * stats.t.sf(abs(t), n - 2 - k), rel=1e-6
        )
        rss_r = sm.OLS(y, zc).fit().ssr
        full = sm.OLS(y, np.column_stack([zc, x])).fit()
        f = (rss_r - full.ssr) / (full.ssr / full.df_resid)
        assert rows.loc["nested", "f_stat"] == pytest.approx(f, rel=1e-6)
        assert rows.loc["nested", "f_p"] == pytest.approx(stats.f.sf(f, 1, full.df_resid), rel=1e-6)
        b, log_a = np.polyfit(x, np.log(y), 1)
        pred = np.exp(log_a + b * x)
        exp_r2 = 1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()
        assert rows.loc["exponential", "exp_b"] == pytest.approx(b, rel=1e-6)
        assert rows.loc["exponential", "exp_r2"] == pytest.approx(exp_r2, rel=1e-6)
        assert rows.loc["exponential", "linear_r2"] == pytest.approx(
            stats.pearsonr(x, y)[0] ** 2, rel=1e-6
        )


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_figures_are_valid_images(report):
    names = {p.name for p in report.figures}
    for stem in ("fig1a_coupling_k4_vs_arc", "emergence"):
        assert {f"{stem}.png", f"{stem}.svg"} <= names
    assert any(n.startswith("profiles_") for n in names)
    assert any(n.startswith("coupling_") for n in names)
    fig1a = report.out_dir / "figures" / "fig1a_coupling_k4_vs_arc.png"
    assert _png_size(fig1a) == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
    for path in report.figures:
        if path.suffix == ".png":
            _png_size(path)
        else:
            assert "<svg" in path.read_text()[:2000]
    summary = report.summary.read_text()
    assert "figures/fig1a_coupling_k4_vs_arc.png" in summary and "correlations.csv" in summary
    assert "lmc_hellaswag_offline" in summary  # left out of the geometry mean: said so


def test_summary_numbers_come_from_csv(report):
    corr = pd.read_csv(report.out_dir / "correlations.csv")
    row = corr[corr["primary"]].iloc[0]
    assert f"R^2 = {row['r2']:.3f}" in report.summary.read_text()


def test_newest_run_wins_and_provenance(real_runs, tmp_path):
    rows = model_rows(real_runs, 3)
    old = dict(rows[0], acc_norm=0.11, q=0.1)
    write_row(tmp_path, old["run"], old, "2024-01-01T00-00-00.000000")
    new = dict(rows[0], acc_norm=0.77)
    write_row(tmp_path, new["run"], new, "2024-06-01T00-00-00.000000", geometry=None)
    for i, row in enumerate(rows[1:]):
        write_row(tmp_path, row["run"], row, f"2024-03-0{i + 1}T00-00-00.000000")
    result = build_report(tmp_path)
    board = result.leaderboard.set_index("model")
    first = board.loc["models/tiny-a"]  # the last two folder names of the local path
    assert first["arc"] == pytest.approx(0.77)  # the newer run's score
    old_geo = json.loads(next(tmp_path.rglob("results_2024-01-01*.json")).read_text())
    assert first["coupling_k4"] == pytest.approx(old_geo["results"][TASK]["coupling,none"])
    prov = result.provenance[result.provenance["model_path"] == rows[0]["model"]]
    assert set(prov["model"]) == {"models/tiny-a"}
    assert set(prov["status"]) == {"used"} and len(prov) == 4  # 2 files x 2 tasks
    newer = prov[prov["file"].str.contains("2024-06-01") & (prov["task"] == TASK)].iloc[0]
    assert "acc_norm" in newer["metrics"] and "coupling" not in newer["metrics"]


def test_scores_csv_join(real_runs, tmp_path):
    make_results_dir(tmp_path / "runs", real_runs, n_models=3)
    scores = tmp_path / "scores.csv"
    pd.DataFrame(dict(model=["tiny-b"], arc=[0.9], mmlu=[0.4])).to_csv(scores, index=False)
    result = build_report(tmp_path / "runs", out_dir=tmp_path / "out", scores_csv=scores)
    row = result.leaderboard[result.leaderboard["model"].str.endswith("tiny-b")].iloc[0]
    assert row["arc"] == 0.9 and row["mmlu"] == 0.4
    src = result.score_sources
    assert set(src.loc[src["model"] == row["model"], "source"]) == {str(scores)}
    assert "--scores" in result.summary.read_text()


def test_fewer_than_minimum_models_descriptive_only(real_runs, tmp_path):
    make_results_dir(tmp_path, real_runs, n_models=4)
    result = build_report(tmp_path)
    corr = pd.read_csv(result.out_dir / "correlations.csv")
    assert corr[["p_hc3", "p_holm", "slope", "r2", "spearman_p"]].isna().all().all()
    assert corr["reason"].str.startswith("fewer than 5 models").all()
    assert "4 model row(s): at least 5" in result.summary.read_text()
    assert "p = " not in result.summary.read_text()


def test_constant_and_missing_metric(real_runs, tmp_path):
    # Six independent models: make_results' checkpoints of tiny-a count as one model, so
    # they are left out here (with them, six rows would be three models and nothing fits).
    rows = [row for row in model_rows(real_runs, 9) if row["revision"] == "main"]
    assert len(rows) == 6
    for i, row in enumerate(rows):
        geometry = ["coupling", "lss"] if i else ["coupling"]
        write_row(tmp_path, row["run"], row, f"2024-03-0{i + 1}T00-00-00.000000", geometry)
    for path in tmp_path.rglob("results_*.json"):
        data = json.loads(path.read_text())
        for entry in data["results"].values():
            entry["coupling,none"] = 0.5
        path.write_text(json.dumps(data))
    corr = build_report(tmp_path).correlations.set_index(["metric", "target"])
    assert "constant" in corr.loc[("coupling_k4", "arc"), "reason"]
    assert corr.loc[("lss", "arc"), "n"] == 5 and corr.loc[("lss", "arc"), "reason"] == ""


def test_malformed_and_partial_files_are_skipped(real_runs, tmp_path):
    make_results_dir(tmp_path, real_runs, n_models=3)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results_2024-01-01T00-00-00.json").write_text("{not json")
    (tmp_path / "broken" / "results_2024-01-02T00-00-00.json").write_text('{"config": {}}')
    with pytest.warns(ReportWarning) as record:
        result = build_report(tmp_path)
    messages = " ".join(str(w.message) for w in record)
    assert "results_2024-01-01T00-00-00.json" in messages
    assert "results_2024-01-02T00-00-00.json" in messages
    assert len(result.leaderboard) == 3


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ReportInputError, match="no lm-eval results"):
        build_report(tmp_path)


def test_cli_runner(real_runs, tmp_path, capsys):
    make_results_dir(tmp_path / "runs", real_runs, n_models=3, samples=False)
    parser = add_report_arguments(argparse.ArgumentParser())
    args = parser.parse_args([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert run_report(args) == 0
    assert "3 model row(s)" in capsys.readouterr().out


def _retask(folder, old, new):
    """Rename a task inside one written row (results, samples and geometry files)."""
    for path in list(folder.iterdir()):
        text = path.read_text().replace(old, new)
        path.unlink()
        path.with_name(path.name.replace(old, new)).write_text(text)


def test_models_on_different_tasks_warn_and_get_per_task_columns(real_runs, tmp_path):
    rows = model_rows(real_runs, 2)
    first = write_row(tmp_path, rows[0]["run"], rows[0], "2024-03-01T00-00-00.000000")
    second = write_row(tmp_path, rows[1]["run"], rows[1], "2024-03-02T00-00-00.000000")
    _retask(first, TASK, "my_task_one")
    _retask(second, TASK, "my_task_two")
    result = build_report(tmp_path)
    board = result.leaderboard
    assert {"score:my_task_one:acc", "score:my_task_two:acc"} <= set(board.columns)
    assert board["score:my_task_one:acc"].notna().sum() == 1
    assert set(board["coupling_k4__tasks"]) == {"my_task_one", "my_task_two"}
    summary = result.summary.read_text()
    assert "WARNING: models were measured on different task sets for coupling_k4" in summary
    assert "WARNING: models were run on different tasks" in summary
    assert summary.index("## Warnings") < summary.index("## Leaderboard")
    corr = pd.read_csv(result.out_dir / "correlations.csv")
    assert {"score:my_task_one:acc", "score:my_task_two:acc"} <= set(corr["target"])
    assert corr["p_hc3"].isna().all()


def test_k_settings_are_separate_columns_and_names_are_short(real_runs, tmp_path):
    rows = model_rows(real_runs, 3)
    for i, row in enumerate(rows):
        write_row(tmp_path, row["run"], row, f"2024-03-0{i + 1}T00-00-00.000000")
        tenth = dict(row, options={"k": 0.1})
        write_row(tmp_path / "tenth", row["run"], tenth, f"2024-04-0{i + 1}T00-00-00.000000")
    result = build_report(tmp_path)
    board = result.leaderboard.set_index("model")
    assert {"coupling_k4", "coupling_k0.1"} <= set(board.columns)  # neither overwrote the other
    assert board["coupling_k0.1__k_used"].astype(str).tolist() == ["3", "4", "6"]
    assert board["coupling_k4__k_used"].astype(str).tolist() == ["4", "4", "4"]  # its own run's K
    assert board.index.tolist() == ["models/tiny-a", "models/tiny-b", "models/tiny-c"]
    paths = set(result.provenance["model_path"])
    assert paths == {row["model"] for row in rows}


def test_results_of_the_previous_release_read_with_the_installed_catalogue(real_runs, tmp_path):
    """Results files without ``config.lm_coupling.catalogue`` give the same report, and say so."""
    new = build_report(make_results_dir(tmp_path / "new", real_runs, n_models=5), seed=3)
    old_dir = make_results_dir(tmp_path / "old", real_runs, n_models=5, catalogue=False)
    for path in old_dir.rglob("results_*.json"):
        assert "catalogue" not in json.loads(path.read_text())["config"]["lm_coupling"]
    with pytest.warns(CatalogueWarning, match="5 results file") as caught:
        old = build_report(old_dir, seed=3)
    assert "taken from the installed plugins" in str(caught[0].message)
    assert "record no catalogue" in old.summary.read_text()
    pd.testing.assert_frame_equal(old.leaderboard, new.leaderboard)
    columns = ["metric", "layer", "value", "n"]
    pd.testing.assert_frame_equal(old.geometry_long[columns], new.geometry_long[columns])
    assert sorted(p.name for p in old.figures) == sorted(p.name for p in new.figures)


def test_per_model_figures_on_request(real_runs, tmp_path):
    make_results_dir(tmp_path / "runs", real_runs, n_models=3, samples=False)
    names = {p.name for p in build_report(tmp_path / "runs").figures}  # 3 rows: all drawn
    assert len([n for n in names if n.startswith("coupling_models")]) == 3
    assert len([n for n in names if n.startswith("profiles_models")]) == 3
    result = build_report(tmp_path / "runs", out_dir=tmp_path / "none", per_model_figures="none")
    assert not [p for p in result.figures if p.name.startswith(("profiles_", "coupling_"))]
    assert "--per-model-figures all" in result.summary.read_text()
    with pytest.raises(ReportInputError, match="per-model figures 'some'"):
        build_report(tmp_path / "runs", per_model_figures="some")


@pytest.mark.parametrize("n_models", [1, 2])
def test_one_or_two_models_draw_no_scatter_panels(real_runs, tmp_path, capsys, n_models):
    """``lm-coupling report`` on one or two models: no one- or two-point fig1a panels, said so."""
    from lm_coupling.cli import main
    from lm_coupling.report.build import MIN_SCATTER_MODELS

    make_results_dir(tmp_path / "runs", real_runs, n_models=n_models)
    main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    figures = {p.name for p in (tmp_path / "out" / "figures").iterdir()}
    assert not [name for name in figures if name.startswith("fig1a_")], figures
    assert any(name.startswith("profiles_") for name in figures)  # the other figures are drawn
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"No fig1a scatter panels: {n_models} independent model(s)" in summary
    assert f"from {MIN_SCATTER_MODELS} models on" in summary
