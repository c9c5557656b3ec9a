"""The plugin contract in-process: needs checked at registration, lenses, requests, isolation."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch

from lm_coupling import hookimpl
from lm_coupling.errors import ConfigurationError, GeometryWarning, PluginError
from lm_coupling.geometry import GeometryRunner
from lm_coupling.plugins import JacobianRequest, MetricSpec
from lm_coupling.plugins.manager import get_registry, new_plugin_manager
from lm_coupling.selection import make_selection

PROMPT = "The sun is a star. Water boils at"


def _pm(**plugins):
    pm = new_plugin_manager(load_entry_points=False)
    for name, plugin in plugins.items():
        pm.register(plugin, name=name)
    return pm


def _runner(model, metrics: str, pm, metric_args=None):
    return GeometryRunner(model, make_selection(metrics, metric_args, get_registry(pm)), pm)


class _Declares:
    def __init__(self, *specs, reducer=False):
        self.specs = specs
        if reducer:
            self.lmc_layer_reducer = hookimpl(lambda: None)  # no reducer in any batch

    @hookimpl
    def lmc_declare_metrics(self):
        return list(self.specs)


# -- needs -------------------------------------------------------------------------------


def test_an_unknown_need_is_refused_naming_the_plugin():
    spec = MetricSpec("mine", "reads the residual stream", frozenset({"trajectory"}))
    with pytest.raises(PluginError) as info:
        get_registry(_pm(my_plugin=_Declares(spec)))
    message = str(info.value)
    assert "'mine'" in message and "'my_plugin'" in message and "['trajectory']" in message
    assert "hidden_states" in message and "attentions" in message


@pytest.mark.parametrize(
    ("needs", "sampled", "reducer", "says"),
    [
        ({"hidden_states"}, False, False, "implement lmc_layer_reducer"),
        ({"attentions"}, True, True, "declare it with sampled=False"),
        ({"jacobian"}, False, False, "declare it with sampled=True"),
    ],
)
def test_needs_that_cannot_be_served_are_refused(needs, sampled, reducer, says):
    spec = MetricSpec("mine", "a metric", frozenset(needs), sampled=sampled)
    with pytest.raises(PluginError, match=says) as info:
        get_registry(_pm(my_plugin=_Declares(spec, reducer=reducer)))
    assert "'my_plugin'" in str(info.value)


# -- isolation -----------------------------------------------------------------------------


class _Faulty:
    """One streamed metric whose answer is broken in the way ``mode`` says."""

    def __init__(self, mode):
        self.mode = mode

    @hookimpl
    def lmc_declare_metrics(self):
        return [MetricSpec("faulty", "broken", frozenset({"hidden_states"}), profiles=("fp",))]

    @hookimpl
    def lmc_layer_reducer(self, batch):
        if self.mode == "start":
            raise KeyError("cannot start")
        return _Raises() if self.mode == "update" else None

    @hookimpl
    def lmc_compute_batch(self, states):
        size = states.size
        if self.mode == "raise":
            raise RuntimeError("compute boom")
        if self.mode == "one" and 11 in {ref.doc_id for row in states.documents for ref in row}:
            raise RuntimeError("document 11 boom")
        if self.mode == "length":
            return {"values": {"faulty": torch.ones(size + 2)}}
        if self.mode == "profile":
            return {"values": {"faulty": torch.ones(size)}, "profiles": {"fp": torch.ones(2)}}
        if self.mode == "other":
            return {"values": {"faulty": torch.ones(size), "lss": torch.zeros(size)}}
        profile = torch.ones(size, states.n_layers + 1)  # states 0..L
        return {"values": {"faulty": torch.ones(size)}, "profiles": {"fp": profile}}


class _Raises:
    def update(self, view):
        if view.layer == 1:
            raise ValueError("update boom")

    def finalize(self):
        return None


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("start", "cannot start"),
        ("update", "update boom"),
        ("raise", "compute boom"),
        ("length", "values of 'faulty' has 3 rows for 1 documents"),  # retried row by row
        ("profile", "profile 'fp' has 2 rows for 1 documents"),
        ("other", None),
    ],
)
def test_a_failing_plugin_makes_only_its_own_metrics_nan(mode, cause, tiny_model, tokenizer):
    model = tiny_model("gpt2")
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    clean = _runner(model, "lss,logit_lens_entropy", _pm())
    runner = _runner(model, "lss,logit_lens_entropy,faulty", _pm(faulty_plugin=_Faulty(mode)))
    batch = ids.repeat(3, 1)
    documents = [[("task", 10 + row)] for row in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with (
            torch.no_grad(),
            runner.capture(
                torch.full((3,), len(ids) - 1),
                torch.zeros(3, dtype=torch.long),
                torch.full((3,), -1),
                documents,
            ) as handle,
        ):
            model(batch)
        docs = runner.compute(handle)
    reference = clean.measure_prompt(ids)
    messages = [str(w.message) for w in caught if issubclass(w.category, GeometryWarning)]
    for doc in docs:
        for name in ("lss", "logit_lens_entropy"):  # the built-ins keep their values
            assert doc.values[name] == pytest.approx(reference.values[name], rel=1e-6)
        if cause is None:  # a value for a metric it does not own is ignored, with a warning
            assert doc.values["faulty"] == 1.0 and doc.failures == []
            continue
        assert math.isnan(doc.values["faulty"]) and "fp" not in doc.profiles
        (failure,) = doc.failures
        assert failure["plugin"] == "faulty_plugin" and failure["metrics"] == ["faulty"]
        assert cause in failure["error"]
    if cause is None:
        assert any("'lss', which it does not own" in m for m in messages)
        return
    (message,) = [m for m in messages if "faulty_plugin" in m]  # one warning per plugin and cause
    assert cause in message and "faulty" in message
    assert "task 'task' documents 10, 11, 12" in message


def test_a_failure_on_one_document_of_a_batch_is_that_document_s(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    runner = _runner(model, "lss,faulty", _pm(faulty_plugin=_Faulty("one")))
    last, first = torch.full((3,), len(ids) - 1), torch.zeros(3, dtype=torch.long)
    documents = [[("task", 10 + row)] for row in range(3)]
    with pytest.warns(GeometryWarning, match="task 'task' document 11: RuntimeError"):
        with torch.no_grad(), runner.capture(last, first, torch.full((3,), -1), documents) as h:
            model(ids.repeat(3, 1))
        docs = runner.compute(h)
    assert [d.values["faulty"] for d in docs][::2] == [1.0, 1.0]  # retried row by row
    assert math.isnan(docs[1].values["faulty"]) and docs[1].failures[0]["plugin"] == "faulty_plugin"
    assert [d.failures for d in docs][::2] == [[], []]
    assert all(math.isfinite(d.values["lss"]) for d in docs)
    assert docs[0].profiles["fp"].shape == (runner.parts.n_layers + 1,)


def test_an_observer_that_raises_changes_no_value(tiny_model, tokenizer):
    class Observer:
        @hookimpl
        def lmc_compute_batch(self, selected):
            assert selected == ()
            raise RuntimeError("observer boom")

    model = tiny_model("gpt2")
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    reference = _runner(model, "lss", _pm()).measure_prompt(ids)
    with pytest.warns(GeometryWarning, match="observer boom.*declares no metric"):
        doc = _runner(model, "lss", _pm(observer=Observer())).measure_prompt(ids)
    assert doc.values == reference.values


# -- lenses -------------------------------------------------------------------------------


class _LensPlugin:
    """Supplies the lens ``2 x`` (the logit lens of twice the state)."""

    def __init__(self, name="doubled"):
        self.name = name

    @hookimpl
    def lmc_lens(self, parts):
        plugin = self

        class Doubled:
            name = plugin.name

            def logits(self, layer, hidden):
                return parts.unembed_fp32(parts.final_norm_fp32(2 * hidden))

        return Doubled()


class _DoubledEntropy(_LensPlugin):
    """Supplies the lens ``doubled`` and a short-form metric reading it beside the logit lens."""

    @hookimpl
    def lmc_declare_metrics(self):
        spec = MetricSpec("doubled_entropy", "entropy of the doubled lens", frozenset({"lens"}))
        return [replace(spec, lens=self.name, profiles=("doubled_entropy",))]

    @hookimpl
    def lmc_layer_reducer(self, batch):
        return _KeepLens(batch)

    @hookimpl
    def lmc_compute_batch(self, reduced):
        from lm_coupling.metrics.lens import lens_summary

        entropy = lens_summary(reduced, torch.full((reduced.shape[0],), -1))[0]
        values, profiles = {"doubled_entropy": entropy.mean(1)}, {"doubled_entropy": entropy}
        return {"values": values, "profiles": profiles}


class _KeepLens:
    def __init__(self, batch):
        assert batch.lens == "doubled"
        self.logits = None

    def update(self, view):
        pass

    def update_lens(self, logits):
        self.logits = logits

    def finalize(self):
        return self.logits


def test_a_plugin_lens_is_read_beside_the_logit_lens(tiny_model, tokenizer):
    from lm_coupling.metrics.lens import lens_summary
    from lm_coupling.model.architecture import block_output_hidden

    model = tiny_model("gpt2")
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    metrics = "logit_lens_entropy,doubled_entropy"
    runner = _runner(model, metrics, _pm(lens_plugin=_DoubledEntropy()))
    assert sorted(runner.lenses) == ["doubled", "logit"]
    doc = runner.measure_prompt(ids)
    logit = _runner(model, "logit_lens_entropy", _pm()).measure_prompt(ids)
    assert doc.values["logit_lens_entropy"] == logit.values["logit_lens_entropy"]  # untouched
    kept = {}
    last = runner.parts.blocks[-1]
    hook = last.register_forward_hook(lambda m, a, o: kept.update(x=block_output_hidden(o)))
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    hook.remove()
    states = [*out.hidden_states[: runner.parts.n_layers], kept["x"]]
    rows = torch.stack([s[0, -1] for s in states])[None]  # [1, L+1, d]
    logits = runner.parts.unembed_fp32(runner.parts.final_norm_fp32(2 * rows))
    entropy = lens_summary(logits, torch.tensor([-1]))[0]
    assert doc.profiles["doubled_entropy"] == pytest.approx(entropy[0].double().numpy(), abs=1e-6)
    assert doc.values["doubled_entropy"] != pytest.approx(logit.values["logit_lens_entropy"])


def test_lenses_of_one_name_and_a_missing_lens_are_refused(tiny_model):
    pm = _pm(one=_LensPlugin("same"), two=_LensPlugin("same"))
    with pytest.raises(ConfigurationError, match="'two' supplies a lens named 'same'"):
        _runner(tiny_model("gpt2"), "logit_lens_entropy", pm)

    class ReadsAbsentLens(_DoubledEntropy):
        @hookimpl
        def lmc_lens(self):
            return None

    with pytest.raises(ConfigurationError, match="reads the lens 'doubled', which no plugin"):
        _runner(tiny_model("gpt2"), "doubled_entropy", _pm(reader=ReadsAbsentLens()))


# -- engine requests ----------------------------------------------------------------------


class _Dense:
    @hookimpl
    def lmc_declare_metrics(self):
        return [
            MetricSpec(
                "dense_norm", "Frobenius norm of J^l, mean", frozenset({"jacobian"}), sampled=True
            )
        ]

    @hookimpl
    def lmc_jacobian_request(self, selected):
        return (
            JacobianRequest(k=1, dense=True, pair_reduction=_trace)
            if "dense_norm" in selected
            else None
        )

    @hookimpl
    def lmc_compute_batch(self, states):
        self.seen = states
        return {
            "values": {
                "dense_norm": torch.stack(
                    [f.dense.norm(dim=(-2, -1)).mean() for f in states.jacobians]
                )
            }
        }


def _trace(left, products):
    """A pair reduction of its own: ``tr(left_m^T J^l right_m)``, ``[B, M]``."""
    return (left * products).sum(dim=(-2, -1))


def test_dense_jacobians_and_a_plugin_pair_reduction(tiny_model):
    from lm_coupling.jacobian.engine import naive_block_jacobians

    model = tiny_model("gpt2", dtype=torch.float64)
    plugin = _Dense()
    runner = _runner(model, "dense_norm", _pm(dense=plugin))
    ids = torch.arange(3, 12)
    (doc,) = runner.compute_sampled_batch([ids], documents=[[("t", 4)]])
    assert plugin.seen.documents == ((("t", 4),),)
    factors = plugin.seen.jacobians[0]
    J = naive_block_jacobians(model, runner.parts, ids)
    assert factors.dense.shape == J.shape == (3, 32, 32)
    torch.testing.assert_close(factors.dense, J, rtol=1e-8, atol=1e-10)
    assert doc.values["dense_norm"] == pytest.approx(float(J.norm(dim=(-2, -1)).mean()), rel=1e-8)
    # A[l, m] = tr(U_m^T J^l V_m), the reduction the plugin handed over.
    U, V = factors.U, factors.V
    want = torch.einsum("mdk,lde,mek->lm", U, J, V)
    torch.testing.assert_close(factors.A, want, rtol=1e-8, atol=1e-10)


def test_two_pair_reductions_are_refused(tiny_model):
    pm = _pm(dense=_Dense())
    runner = _runner(tiny_model("gpt2"), "dense_norm,coupling", pm)
    with pytest.raises(ConfigurationError, match="different pair reductions"):
        runner.jacobian_request()


# -- deferred metrics and required metrics ---------------------------------------------------


class _Deferred:
    """A deferred metric: each document's value is its summary minus the task's mean summary."""

    def __init__(self, fail=False):
        self.fail = fail

    @hookimpl
    def lmc_layer_reducer(self):
        return None  # the summaries are given by the test

    @hookimpl
    def lmc_declare_metrics(self):
        return [
            MetricSpec(
                "centred", "summary minus the task mean", frozenset({"hidden_states"}),
                profiles=("centred",), deferred=True, requires=("lss",),
            )
        ]  # fmt: skip

    @hookimpl
    def lmc_complete_task(self, selected, documents, doc_ids):
        if self.fail:
            raise RuntimeError("complete boom")
        s = torch.tensor([float(doc.summaries.pop("s")) for doc in documents])
        centred = s - s.mean()
        return {"values": {"centred": centred}, "profiles": {"centred": centred[:, None] * 2}}


@pytest.mark.parametrize("fail", [False, True])
def test_a_deferred_metric_is_computed_from_the_whole_task(fail):
    from lm_coupling.geometry import DocumentGeometry
    from lm_coupling.plugins.calls import PluginCalls
    from lm_coupling.states import DocumentRef

    pm = _pm(deferred_plugin=_Deferred(fail))
    selection = make_selection("centred", None, get_registry(pm))
    assert selection.metrics == ("lss", "centred")  # brought in by MetricSpec.requires
    docs = [DocumentGeometry(summaries={"s": float(v)}) for v in (1.0, 2.0, 6.0)]
    refs = [DocumentRef("task", i) for i in (4, 5, 6)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PluginCalls(pm, selection).complete_task(["centred"], docs, refs, {}, parts=None)
    if not fail:
        assert [d.values["centred"] for d in docs] == [-2.0, -1.0, 3.0]
        assert [float(d.profiles["centred"][0]) for d in docs] == [-4.0, -2.0, 6.0]
        assert all("s" not in d.summaries for d in docs)  # the plugin dropped its summaries
        assert not [w for w in caught if issubclass(w.category, GeometryWarning)]
        return
    assert all(math.isnan(d.values["centred"]) for d in docs)
    assert all(d.failures[0]["plugin"] == "deferred_plugin" for d in docs)
    (message,) = [str(w.message) for w in caught if issubclass(w.category, GeometryWarning)]
    assert "complete boom" in message and "documents 4, 5, 6" in message


# -- the short form ----------------------------------------------------------------------


def _short_route_module():
    import types

    from lm_coupling import metric

    module = types.ModuleType("short_route")

    @metric("attention of query n on position 0", profile="blocks")
    def sink(attentions):
        mass = attentions[..., 0].mean(dim=-1)  # [B, L]: mean over heads
        return mass.mean(dim=1), mass

    @metric("P(target) through the logit lens of x^L")
    def last_target(logits, targets):
        p = logits[:, -1].softmax(dim=-1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
        return torch.where(targets >= 0, p, torch.nan)

    @metric("raises on purpose")
    def broken(states):
        raise RuntimeError("broken on purpose")

    module.sink, module.last_target, module.broken = sink, last_target, broken
    return module


def test_short_route_functions_equal_the_model_s_own_attentions_and_logits(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    target = 7
    pm = _pm()
    pm.register(_short_route_module(), name="short_route")
    runner = _runner(model, "sink,last_target,broken,lss", pm)
    with pytest.warns(GeometryWarning, match="broken raised RuntimeError"):
        doc = runner.measure_prompt(ids, target_token=target)
    with torch.no_grad():
        out = model(ids[None], output_attentions=True)
    mass = torch.stack([a[0, :, -1, 0].mean() for a in out.attentions]).double()
    assert doc.profiles["sink"] == pytest.approx(mass.numpy(), abs=1e-6)
    assert doc.values["sink"] == pytest.approx(float(mass.mean()), abs=1e-6)
    want = float(out.logits[0, -1].softmax(dim=-1)[target])
    assert doc.values["last_target"] == pytest.approx(want, rel=1e-5)
    assert math.isnan(doc.values["broken"]) and math.isfinite(doc.values["lss"])
    assert [f["metrics"] for f in doc.failures] == [["broken"]]  # its failure alone


def test_a_short_route_module_with_the_hooks_it_is_served_by_is_refused():
    module = _short_route_module()
    module.lmc_compute_batch = hookimpl(lambda states: None)
    with pytest.raises(PluginError, match="put the short-form metrics in a module of their own"):
        _pm().register(module, name="mixed")
    with pytest.raises(ValueError, match="takes hidden; a metric of the states at n takes"):
        from lm_coupling import metric

        metric("bad")(lambda hidden: hidden)


class _SampledFaulty:
    """A sampled metric of the engine's per-document terms that fails on document 11."""

    @hookimpl
    def lmc_declare_metrics(self):
        return [
            MetricSpec("term_norm", "norm of a term", frozenset({"authors_jacobian"}), sampled=True)
        ]

    @hookimpl
    def lmc_compute_batch(self, selected, states):
        if any(ref.doc_id == 11 for row in states.documents for ref in row):
            raise RuntimeError("bad term")
        return {"values": {"term_norm": torch.stack([J.norm() for J in states.authors_jacobians])}}


def test_a_sampled_batch_is_retried_row_by_row_with_each_row_s_own_terms():
    from lm_coupling.geometry import DocumentGeometry
    from lm_coupling.plugins.calls import PluginCalls
    from lm_coupling.states import DocumentRef, GeometryStates

    pm = _pm(sampled_plugin=_SampledFaulty())
    selection = make_selection("term_norm", None, get_registry(pm))
    terms = [torch.full((2, 3, 3), float(v)) for v in (1.0, 2.0, 3.0)]
    documents = tuple((DocumentRef("task", i),) for i in (10, 11, 12))
    states = GeometryStates(2, 3, 5, size=3, documents=documents, authors_jacobians=terms)
    docs = [DocumentGeometry() for _ in terms]
    with pytest.warns(GeometryWarning, match="document 11: RuntimeError"):
        PluginCalls(pm, selection).compute(("term_norm",), states, docs, {}, {}, {}, {})
    assert docs[0].values["term_norm"] == pytest.approx(float(terms[0].norm()))
    assert docs[2].values["term_norm"] == pytest.approx(float(terms[2].norm()))
    assert math.isnan(docs[1].values["term_norm"]) and docs[0].failures == docs[2].failures == []
