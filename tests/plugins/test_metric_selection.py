"""`--metrics` / `--metric_args` validation: names, options, values, needs."""

from __future__ import annotations

import pytest
from fixtures.catalogue import default_metrics

from lm_coupling import hookimpl
from lm_coupling.errors import ConfigurationError
from lm_coupling.plugins import MetricSpec
from lm_coupling.plugins.manager import get_registry, new_plugin_manager
from lm_coupling.selection import make_selection

BUILTIN = default_metrics()  # what the golden run's --metrics all recorded


@pytest.fixture(scope="module")
def registry():
    """The built-in metrics only (no installed third-party plugin)."""
    return get_registry(new_plugin_manager(load_entry_points=False))


class _OptIn:
    @hookimpl
    def lmc_declare_metrics(self):
        return [
            MetricSpec(
                "tokenwise_demo",
                "expensive",
                frozenset({"tokenwise_jacobian"}),
                sampled=True,
                opt_in=True,
            )
        ]


def test_all_selects_every_builtin(registry):
    assert make_selection("all", registry=registry).metrics == BUILTIN


def test_all_skips_opt_in_metrics():
    pm = new_plugin_manager(load_entry_points=False)
    pm.register(_OptIn(), name="opt_in_plugin")
    registry = get_registry(pm)
    assert "tokenwise_demo" not in make_selection("all", registry=registry).metrics
    assert make_selection("all", registry=registry).metrics == BUILTIN
    by_name = make_selection("tokenwise_demo,lss", registry=registry)
    assert by_name.metrics == ("lss", "tokenwise_demo")
    assert by_name.needs == frozenset({"hidden_states", "tokenwise_jacobian"})


def test_names_keep_registry_order_and_ignore_spaces(registry):
    selection = make_selection(" coupling , lss", registry=registry)
    assert selection.metrics == ("lss", "coupling")


def test_unknown_metric_suggests_and_lists(registry):
    with pytest.raises(ConfigurationError) as info:
        make_selection("lss,cuopling", registry=registry)
    message = str(info.value)
    assert "'cuopling'" in message
    assert "Did you mean 'coupling'" in message
    for name in BUILTIN:
        assert name in message


@pytest.mark.parametrize("text", ["", " , "])
def test_empty_metric_list(registry, text):
    with pytest.raises(ConfigurationError, match="available: lss, expodistance"):
        make_selection(text, registry=registry)


def test_unknown_option_lists_the_valid_ones(registry):
    with pytest.raises(ConfigurationError) as info:
        make_selection("lss,coupling", "nrom=l2", registry=registry)
    message = str(info.value)
    assert "'nrom'" in message
    assert "Did you mean 'norm'" in message
    for option in ("tokens", "windowed", "k", "norm", "elementwise_abs", "pairs"):
        assert option in message
    assert "alignment_k" not in message  # alignment_ratio is not selected


def test_option_of_an_unselected_metric(registry):
    with pytest.raises(ConfigurationError) as info:
        make_selection("lss", "k=5", registry=registry)
    message = str(info.value)
    assert "'k'" in message
    assert "tokens, windowed" in message


def test_option_without_value(registry):
    with pytest.raises(ConfigurationError, match="key=value pairs, found 'k'"):
        make_selection("coupling", "k", registry=registry)


@pytest.mark.parametrize(
    ("metrics", "args", "expected"),
    [
        ("coupling", "k=0", "k=0: expected an integer >= 1 or a fraction in (0, 1), found '0'"),
        ("coupling", "k=abc", "k=abc: expected an integer or a fraction in (0, 1)"),
        ("coupling", "k=1.5", "k=1.5: expected an integer >= 1 or a fraction"),
        ("coupling", "norm=l3", "norm=l3: expected one of l1, l2, offdiag"),
        ("coupling", "pairs=diag", "pairs=diag: expected one of offdiag, all, adjacent"),
        ("coupling", "coupling_docs=-1", "coupling_docs=-1: expected a non-negative number"),
        ("coupling", "coupling_docs=few", "expected a number of documents or 'all'"),
        ("lss", "windowed=maybe", "windowed=maybe: expected true or false, found 'maybe'"),
        ("lss", "tokens=first", "tokens=first: expected one of all, last"),
    ],
)
def test_bad_values_are_readable(registry, metrics, args, expected):
    with pytest.raises(ConfigurationError) as info:
        make_selection(metrics, args, registry=registry)
    assert expected in str(info.value)
    assert str(info.value).startswith("--metric_args ")


def test_defaults(registry):
    options = make_selection("lss,coupling", registry=registry).options
    assert options == {
        "tokens": "all",
        "windowed": True,
        "k": 10,
        "norm": "l1",
        "elementwise_abs": False,
        "pairs": "offdiag",
        "k_select": "fixed",
        "k_min": 2,
        "subspace_min_gap": 1.05,
        "coupling_docs": 25,
        "sample_seed": 0,
        "jacobian_method": "auto",
        # The engine's settings: None lets the engine choose (JacobianConfig's defaults).
        "jacobian_tol": None,
        "jacobian_max_iters": None,
        "jacobian_ill_gap": 1e-3,
        "jacobian_check": True,
        "jacobian_seed": 0,
        "jacobian_docs_per_batch": None,
        "jacobian_chunk_size": None,
        "jacobian_keep_bytes": None,
    }
    # A metric without options has no options at all.
    assert make_selection("fixation_depth", registry=registry).options == {}


@pytest.mark.parametrize(
    ("args", "key", "value"),
    [
        ("k=0.1", "k", 0.1),
        ("k=12", "k", 12),
        ("k=3.0", "k", 3),
        ("coupling_docs=all", "coupling_docs", None),
        ("coupling_docs=1", "coupling_docs", 1),
        ("elementwise_abs=Yes", "elementwise_abs", True),
        ("norm=offdiag", "norm", "offdiag"),
    ],
)
def test_parsed_values(registry, args, key, value):
    options = make_selection("coupling", args, registry=registry).options
    assert options[key] == value
    assert type(options[key]) is type(value)


def test_several_args_and_dict_form(registry):
    text = make_selection("lss,coupling", "k=0.1, tokens=last,windowed=false", registry=registry)
    mapping = make_selection(
        "lss,coupling", {"k": 0.1, "tokens": "last", "windowed": False}, registry=registry
    )
    assert text.options == mapping.options
    assert (text.options["k"], text.options["tokens"], text.options["windowed"]) == (
        0.1,
        "last",
        False,
    )


def test_needs_and_profiles_are_unions(registry):
    trajectory = make_selection("lss,expodistance", registry=registry)
    assert trajectory.needs == frozenset({"hidden_states"})
    assert trajectory.profiles == ("norm", "windowed_lss")

    mixed = make_selection("lss,equidistance,tv_to_target,coupling", registry=registry)
    assert mixed.needs == frozenset({"hidden_states", "lens", "jacobian"})
    assert mixed.profiles == (
        "norm",
        "windowed_lss",
        "tv_to_target",
        "coupling",
        "singular_values",
        "spectral_gap",
        "k_selected",
        "jacobian_iterations",
        "jacobian_residual",
        "jacobian_ill_defined",
    )
    assert make_selection("fixation_depth", registry=registry).profiles == ()
