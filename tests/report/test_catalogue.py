"""The catalogue of metrics: MetricSpec's profile records, and their JSON round trip."""

from __future__ import annotations

import json

import pytest
from fixtures.catalogue import default_metrics, golden_catalogue

from lm_coupling.catalogue import Catalogue, recorded_catalogue
from lm_coupling.plugins.manager import get_registry, new_plugin_manager
from lm_coupling.plugins.specs import UNIT_INTERVAL, MetricSpec, ProfileSpec

NEEDS = frozenset({"trajectory"})


def test_a_plain_profile_name_is_over_states_and_a_matrix_name_is_a_matrix():
    spec = MetricSpec("m", "d", NEEDS, profiles=("p", "q"), matrices=("q",))
    assert spec.profiles == ("p", "q")
    assert [(p.name, p.axis, p.label) for p in spec.profile_specs] == [
        ("p", "states", "p"),
        ("q", "matrix", "q"),
    ]
    assert spec.profile("p").first_layer == 0 and spec.label == "m"


def test_profile_records_set_axis_matrices_and_inherit_from_their_metric():
    spec = MetricSpec(
        "m",
        "d",
        NEEDS,
        profiles=("m", ProfileSpec("grid", "matrix")),
        bounds=(0, 1),
        label="my metric",
        profile_specs=(ProfileSpec("extra", "blocks", "extra one"),),
    )
    assert spec.profiles == ("m", "grid", "extra") and spec.matrices == ("grid",)
    own = spec.profile("m")
    assert (own.axis, own.label, own.bounds) == ("states", "my metric", UNIT_INTERVAL)
    assert spec.profile("extra").first_layer == 1
    again = MetricSpec(**{k: getattr(spec, k) for k in spec.__dataclass_fields__})
    assert again == spec  # normalising twice changes nothing (the manager's replace())


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ProfileSpec("p", "layers"), "axis must be one of states, blocks, matrix"),
        (lambda: ProfileSpec("p", bounds=(1, 0)), "finite low < high"),
        (lambda: MetricSpec("m", "d", NEEDS, bounds="unit"), "bounds must be a"),
        (
            lambda: MetricSpec(
                "m", "d", NEEDS, profiles=("p",), matrices=("p",), profile_specs=(ProfileSpec("p"),)
            ),
            "give it axis='matrix'",
        ),
        (
            lambda: MetricSpec(
                "m",
                "d",
                NEEDS,
                profiles=(ProfileSpec("p"),),
                profile_specs=(ProfileSpec("p", "blocks"),),
            ),
            "describes profile 'p' twice",
        ),
    ],
)
def test_bad_declarations_say_what_to_do(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_two_metrics_sharing_a_profile_must_declare_it_alike():
    a = MetricSpec("a", "d", NEEDS, profile_specs=(ProfileSpec("p", "blocks"),))
    b = MetricSpec("b", "d", NEEDS, profile_specs=(ProfileSpec("p", "states"),))
    with pytest.raises(ValueError, match="declare one ProfileSpec for it and share it"):
        Catalogue.from_specs([a, b])


def test_json_round_trip_keeps_order_even_with_sorted_keys():
    specs = get_registry(new_plugin_manager(load_entry_points=False)).metrics
    catalogue = Catalogue.from_specs(specs.values())
    text = json.dumps(catalogue.to_json(), sort_keys=True)
    config = {"lm_coupling": {"metrics": list(specs), "catalogue": json.loads(text)}}
    back = recorded_catalogue(config)
    assert back.metrics == catalogue.metrics and back.profiles == catalogue.profiles
    assert list(back.metrics) == list(catalogue.metrics)
    assert list(back.profiles) == list(catalogue.profiles)


def test_the_golden_run_recorded_the_builtin_catalogue():
    catalogue = golden_catalogue()
    registry = get_registry(new_plugin_manager(load_entry_points=False))
    assert default_metrics() == tuple(n for n, s in registry.metrics.items() if not s.opt_in)
    expected = Catalogue.from_specs(registry.metrics[n] for n in default_metrics())
    assert catalogue.metrics == expected.metrics and catalogue.profiles == expected.profiles
    # The report's readings, for one bounded metric, one block profile, one K-named column.
    bounded = [n for n in catalogue.metrics if catalogue.is_unit(n)]
    assert bounded and all(catalogue.metrics[n].bounds == (0.0, 1.0) for n in bounded)
    blocks = [n for n, p in catalogue.profiles.items() if p.axis == "blocks"]
    assert blocks and all(catalogue.first_layer(n) == 1 for n in blocks)
    with_k = [n for n in catalogue.metrics if catalogue.k_option(n)]
    for name in with_k:
        assert catalogue.base_metric(f"{name}_k10") == name and catalogue.is_metric(f"{name}_k10")
    assert catalogue.boundary_profiles()  # the lens profiles the boundary is read from


def test_unreadable_catalogue_is_a_clear_error():
    config = {"lm_coupling": {"catalogue": {"profiles": {"p": {"axis": "depth"}}}}}
    with pytest.raises(ValueError, match="unreadable catalogue.*axes are states, blocks, matrix"):
        recorded_catalogue(config)
    assert recorded_catalogue({"lm_coupling": {"metrics": ["lss"]}}) is None


def test_task_level_is_recorded_only_when_true_and_read_back():
    task = MetricSpec("per_task", "one value per task", frozenset({"hidden_states"}),
                      task_level=True)  # fmt: skip
    plain = MetricSpec("per_doc", "one value per document", frozenset({"hidden_states"}))
    data = Catalogue.from_specs([task, plain]).to_json()
    assert data["metrics"]["per_task"]["task_level"] is True
    assert "task_level" not in data["metrics"]["per_doc"]  # earlier files stay as they are
    back = Catalogue.from_json(json.loads(json.dumps(data)))
    assert [n for n, e in back.metrics.items() if e.task_level] == ["per_task"]
