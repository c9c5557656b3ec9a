"""`--metric_args` mistakes: every one listed, the owning metric named, empty samples refused."""

from __future__ import annotations

import pytest

from lm_coupling.errors import ConfigurationError
from lm_coupling.plugins.manager import get_registry, new_plugin_manager
from lm_coupling.selection import make_selection


@pytest.fixture(scope="module")
def registry():
    """The built-in metrics only (no installed third-party plugin)."""
    return get_registry(new_plugin_manager(load_entry_points=False))


def _error(registry, metrics, args) -> str:
    with pytest.raises(ConfigurationError) as info:
        make_selection(metrics, args, registry=registry)
    return str(info.value)


def test_every_bad_option_is_listed(registry):
    message = _error(registry, "lss,coupling", "nrom=l2,k=-3,windowed=maybe,pairs=diag")
    assert message.startswith("4 problems with --metric_args:")
    assert "unknown --metric_args option 'nrom'" in message
    assert "--metric_args k=-3:" in message
    assert "--metric_args windowed=maybe: expected true or false" in message
    assert "--metric_args pairs=diag: expected one of offdiag, all, adjacent" in message
    assert len(message.splitlines()) == 5


def test_option_of_an_unselected_metric_names_its_metric(registry):
    message = _error(registry, "lss", "k=5")
    assert "option 'k' belongs to coupling and coupling_swapped, which are not selected" in message
    assert "add one to --metrics" in message
    assert "Options of the selected metrics: tokens, windowed" in message
    shared = _error(registry, "lss", "alignment_k=3")
    assert "option 'alignment_k' belongs to alignment_ratio, which is not selected" in shared
    several = _error(registry, "lss", "coupling_docs=3")
    assert _owners(several) == _sample_option_owners(registry)


@pytest.mark.parametrize("metrics", ["coupling", "alignment_ratio", "lss,coupling", "all"])
def test_zero_coupling_documents_is_refused(registry, metrics):
    message = _error(registry, metrics, "coupling_docs=0")
    assert "coupling_docs=0 leaves" in message
    assert "give a number >= 1 (or 'all')" in message


def test_zero_documents_without_a_sampled_metric_is_not_an_option(registry):
    message = _error(registry, "lss", "coupling_docs=0")
    assert _owners(message) == _sample_option_owners(registry)


def _sample_option_owners(registry) -> set[str]:
    """The metrics measured on the coupling sample: those declaring ``coupling_docs``."""
    owners = {
        name
        for name, spec in registry.metrics.items()
        if spec.sampled and any(option.name == "coupling_docs" for option in spec.options)
    }
    # the block coupling, its swapped form, the alignment ratio, the authors' six columns
    assert {"coupling", "coupling_swapped", "alignment_ratio"} < owners
    assert {n for n in owners if n.startswith("iclr2025_miscoupling_k")} == {
        f"iclr2025_miscoupling_k{k}_{norm}" for k in (10, 30, 50) for norm in ("trace", "norm")
    }
    return owners


def _owners(message: str) -> set[str]:
    """The metrics an unselected option's message names (``belongs to A, B and C, which``)."""
    names = message.split("belongs to ", 1)[1].split(", which", 1)[0]
    return set(names.replace(" and ", ", ").split(", "))


def test_one_coupling_document_is_accepted(registry):
    assert (
        make_selection("coupling", "coupling_docs=1", registry=registry).options["coupling_docs"]
        == 1
    )


@pytest.mark.parametrize("metrics", [None, "", "  "])
def test_metric_args_without_metrics(registry, metrics):
    message = _error(registry, metrics, "k=3")
    assert "--metric_args was given but --metrics is missing" in message
