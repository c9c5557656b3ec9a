"""``--metric_args preset=NAME``: the papers' settings in one word, typed options win."""

from __future__ import annotations

import pytest

from lm_coupling.errors import ConfigurationError
from lm_coupling.presets import PRESETS
from lm_coupling.selection import make_selection


def test_iclr2025_preset_expands_to_the_headline_settings():
    options = make_selection("coupling", "preset=iclr2025").options
    assert (options["k"], options["norm"], options["pairs"]) == (0.1, "l1", "all")
    assert options["elementwise_abs"] is True  # the authors' released code takes |A|
    assert options["preset"] == "iclr2025"
    assert "preset_overrides" not in options


def test_arxiv_preset_sets_the_offdiag_normalisation_only():
    default = make_selection("coupling").options
    options = make_selection("coupling", "preset=arxiv").options
    assert options["norm"] == "offdiag" and options["preset"] == "arxiv"
    assert {k: v for k, v in options.items() if k not in ("norm", "preset")} == {
        k: v for k, v in default.items() if k != "norm"
    }


@pytest.mark.parametrize("text", ["k=20,preset=iclr2025", "preset=iclr2025,k=20"])
def test_options_typed_beside_a_preset_win_in_any_order(text):
    options = make_selection("coupling", text).options
    assert (options["k"], options["norm"], options["pairs"]) == (20, "l1", "all")
    assert options["preset_overrides"] == ["k"]


def test_a_preset_sets_only_the_selected_metrics_options():
    options = make_selection("lss", "preset=iclr2025").options
    assert options["preset"] == "iclr2025"
    assert not {"k", "norm", "pairs", "elementwise_abs"} & set(options)


def test_unknown_or_repeated_presets_are_errors_listing_the_presets():
    with pytest.raises(ConfigurationError, match=", ".join(PRESETS)):
        make_selection("coupling", "preset=iclr")
    with pytest.raises(ConfigurationError, match="one preset"):
        make_selection("coupling", "preset=iclr2025,preset=arxiv")


def test_preset_values_are_parsed_by_the_options_own_parsers():
    selection = make_selection(
        "coupling,prompt_entropy,curvature,dataset_entropy", "preset=iclr2025"
    )
    parse = {o.name: o.parse for spec in selection.specs.values() for o in spec.options}
    names = "coupling,prompt_entropy,curvature,dataset_entropy"
    for preset in PRESETS.values():
        options = make_selection(names, f"preset={preset.name}").options
        assert {k: options[k] for k in preset.values} == {
            k: parse[k](v) for k, v in preset.values.items()
        }
    assert isinstance(selection.options["k"], float)  # "0.1" parsed as a fraction of d_model
