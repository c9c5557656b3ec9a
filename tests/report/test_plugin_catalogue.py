"""A third-party metric is reported exactly as a built-in one: from the run's catalogue.

A small plugin object, registered with the process-wide plugin manager as
docs/plugins.md shows, declares ``relative_step``: per block l = 1..L the
token mean of ``||x^l - x^{l-1}|| / (||x^l|| + ||x^{l-1}||)``, which the
triangle inequality bounds to [0, 1], as a profile over blocks with
``bounds=(0, 1)``. Two real runs (`lm_coupling.evaluate`, models of 3 and 5
blocks) record it in ``config.lm_coupling.catalogue``; the report numbers it
1..L in ``geometry_long.csv``, draws it over blocks 1..L on a fixed [0, 1]
axis in each model's profile figure. The same results
files without their catalogue (the previous release's format) are read with
the installed plugins' catalogue, and the report says so.
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pandas as pd
import pytest
from fixtures.tiny import save_tiny_model
from layout import layout_problems
from matplotlib.image import imread

import lm_coupling
from lm_coupling import hookimpl
from lm_coupling.catalogue import CONFIG_KEY, Catalogue, recorded_catalogue
from lm_coupling.plugins.manager import get_plugin_manager
from lm_coupling.plugins.specs import UNIT_INTERVAL, MetricSpec, ProfileSpec
from lm_coupling.report import build_report
from lm_coupling.report.figures import catalogue_or_installed, profiles_figure
from lm_coupling.report.loading import CatalogueWarning, load_results

pytestmark = pytest.mark.slow

NAME = "relative_step"
LABEL = "relative step ||x^l - x^(l-1)|| / (||x^l|| + ||x^(l-1)||)"
DEPTHS = (3, 5)


class RelativeStepReducer:
    """Streams ``||x^l - x^{l-1}|| / (||x^l|| + ||x^{l-1}||)``, token-averaged, per block."""

    def __init__(self, batch):
        self.mask = batch.token_mask  # [B, T]
        self.previous = None
        self.blocks = []

    def update(self, view):
        import torch

        hidden = view.hidden  # [B, T, d]
        if self.previous is not None:
            step = (hidden - self.previous).norm(dim=-1)  # [B, T]
            ratio = step / (hidden.norm(dim=-1) + self.previous.norm(dim=-1))
            mask = self.mask.to(ratio.device)
            summed = torch.where(mask, ratio, torch.zeros_like(ratio)).sum(-1)
            self.blocks.append(summed / mask.sum(-1).clamp(min=1))  # [B]
        self.previous = hidden

    def finalize(self):
        import torch

        return torch.stack(self.blocks, dim=1)  # [B, L]


class RelativeStep:
    """The third-party plugin: a bounded profile over blocks, from streamed hidden states."""

    @hookimpl
    def lmc_declare_metrics(self):
        return [
            MetricSpec(
                NAME,
                "mean over blocks of the relative step length (in [0, 1])",
                frozenset({"hidden_states"}),
                profiles=(ProfileSpec(NAME, "blocks", LABEL, UNIT_INTERVAL),),
                label="relative step",
                bounds=UNIT_INTERVAL,
            )
        ]

    @hookimpl
    def lmc_layer_reducer(self, selected, batch):
        return RelativeStepReducer(batch) if NAME in selected else None

    @hookimpl
    def lmc_compute_batch(self, selected, reduced):
        if NAME not in selected or reduced is None:
            return None
        per_block = reduced  # [B, L]
        return {"values": {NAME: per_block.mean(dim=1)}, "profiles": {NAME: per_block}}


@pytest.fixture(scope="module")
def plugin():
    """``RelativeStep`` registered with the process-wide manager for this module's tests."""
    pm = get_plugin_manager()
    instance = RelativeStep()
    pm.register(instance, name="relative_step_plugin")
    yield instance
    pm.unregister(instance)


@pytest.fixture(scope="module")
def runs(plugin, tokenizer, tmp_path_factory):
    """Two real runs of ``lss`` and ``relative_step``, models of 3 and 5 blocks."""
    root = tmp_path_factory.mktemp("plugin_runs")
    for n_layers in DEPTHS:
        model = save_tiny_model(
            root / "models" / f"tiny-L{n_layers}",
            "gpt2",
            tokenizer=tokenizer,
            n_layers=n_layers,
            d_model=32,
            seed=n_layers,
            init_std=0.2,
        )
        lm_coupling.evaluate(
            model_args={"pretrained": str(model)},
            tasks=["lmc_arc_easy_offline"],
            metrics=f"lss,{NAME}",
            batch_size=2,
            device="cpu",
            limit=3,
            output_path=str(root / "results"),
        )
    return root / "results"


def _results(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.rglob("results_*.json"))]


def _geometry(folder) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.rglob("geometry_*.json"))]


def test_the_run_records_the_plugin_in_its_catalogue(runs):
    for results in _results(runs):
        catalogue = recorded_catalogue(results["config"])
        assert list(catalogue.metrics) == ["lss", NAME]
        entry = catalogue.metrics[NAME]
        assert entry.plugin == "relative_step_plugin" and entry.label == "relative step"
        assert entry.bounds == (0.0, 1.0) and catalogue.is_unit(NAME)
        profile = catalogue.profile(NAME)
        assert (profile.axis, profile.label, profile.bounds) == ("blocks", LABEL, (0.0, 1.0))
        assert catalogue.first_layer(NAME) == 1 and catalogue.first_layer("norm") == 0
        raw = results["config"]["lm_coupling"][CONFIG_KEY]["profiles"][NAME]
        assert raw["axis"] == "blocks" and raw["bounds"] == [0.0, 1.0]


def test_values_are_bounded_and_the_scalar_is_the_mean_over_blocks(runs):
    by_depth = {}
    for geo in _geometry(runs):
        mean = np.asarray(geo["profiles"][NAME]["mean"], dtype=float)
        by_depth[geo["model"]["n_layers"]] = mean
        assert len(mean) == geo["model"]["n_layers"]  # one value per block
        assert np.all((mean > 0) & (mean <= 1))
    assert sorted(by_depth) == list(DEPTHS)
    for results in _results(runs):
        (entry,) = results["results"].values()
        n_layers = results["config"]["lm_coupling"]["model_shape"]["n_layers"]
        # Per document the scalar is the mean of its profile; so are their means.
        assert entry[f"{NAME},none"] == pytest.approx(by_depth[n_layers].mean(), rel=1e-5)


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    return build_report(runs, tmp_path_factory.mktemp("report"))


def test_geometry_long_numbers_the_block_profile_one_to_l(report):
    long = report.geometry_long
    for n_layers in DEPTHS:
        rows = long[(long["metric"] == NAME) & long["layer"].notna()]
        rows = rows[rows["model"].str.endswith(f"tiny-L{n_layers}")]
        assert rows["layer"].astype(int).tolist() == list(range(1, n_layers + 1))
        norm = long[(long["metric"] == "norm") & long["model"].str.endswith(f"tiny-L{n_layers}")]
        assert norm["layer"].astype(int).tolist() == list(range(0, n_layers + 1))
    csv = pd.read_csv(report.out_dir / "geometry_long.csv")
    assert csv[csv["metric"] == NAME]["layer"].min() == 1


def _panel(figure, title_start):
    (ax,) = [ax for ax in figure.axes if ax.get_title().startswith(title_start)]
    return ax


def test_profile_figure_draws_it_over_blocks_on_a_unit_axis(report, runs):
    names = {p.name for p in report.figures}
    loaded = load_results(runs)
    for geo in loaded.geometry:
        n_layers = geo["model"]["n_layers"]
        figure = profiles_figure(geo["profiles"], n_layers, "t", loaded.catalogue)
        assert layout_problems(figure) == []
        ax = _panel(figure, "relative step")
        (line,) = ax.get_lines()
        assert line.get_xdata().tolist() == list(range(1, n_layers + 1))
        low, high = ax.get_ylim()
        assert low <= 0 and high >= 1 and high < 1.1  # the fixed [0, 1] axis
        assert ax.get_xlabel() == "block l"
        assert min(ax.get_xticks()) >= 1
        norm = _panel(figure, "norm")
        assert norm.get_lines()[0].get_xdata().tolist() == list(range(0, n_layers + 1))
    pngs = sorted(n for n in names if n.startswith("profiles_") and n.endswith(".png"))
    assert len(pngs) == 2  # one per model
    for name in pngs:
        assert imread(report.out_dir / "figures" / name).shape[0] > 100


def _strip_catalogue(folder, dest):
    """A copy of the runs as the previous release wrote them: no catalogue in the config."""
    shutil.copytree(folder, dest)
    for path in dest.rglob("results_*.json"):
        data = json.loads(path.read_text())
        del data["config"]["lm_coupling"][CONFIG_KEY]
        path.write_text(json.dumps(data))
    return dest


def test_old_results_use_the_installed_catalogue_and_say_so(runs, report, tmp_path):
    old = _strip_catalogue(runs, tmp_path / "old")
    with pytest.warns(CatalogueWarning, match="record no catalogue") as caught:
        again = build_report(old, tmp_path / "old_report")
    assert "installed plugins" in str(caught[0].message)
    assert any("record no catalogue" in note for note in again.notes)
    assert "record no catalogue" in again.summary.read_text()
    assert again.geometry_long[["metric", "layer", "value"]].equals(
        report.geometry_long[["metric", "layer", "value"]]
    )


def test_old_results_of_an_uninstalled_plugin_fall_back_to_states(runs, plugin, tmp_path):
    old = _strip_catalogue(runs, tmp_path / "old")
    pm = get_plugin_manager()
    pm.unregister(plugin)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CatalogueWarning)
            loaded = load_results(old)
    finally:
        pm.register(plugin, name="relative_step_plugin")
    assert NAME not in loaded.catalogue.metrics
    # Undeclared: drawn as a profile over states, as the files alone cannot say otherwise.
    assert loaded.catalogue.first_layer(NAME) == 0
    geometry = loaded.values[loaded.values["kind"] == "geometry"]
    assert {NAME, "lss"} <= set(geometry["metric"])  # still a geometry metric (declared)


def test_without_a_catalogue_a_figure_uses_the_installed_plugins(plugin):
    catalogue = catalogue_or_installed(None)
    assert catalogue.source == "installed plugins"
    assert catalogue.profile(NAME).axis == "blocks"
    assert isinstance(catalogue, Catalogue)
