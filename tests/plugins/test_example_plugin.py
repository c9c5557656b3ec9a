"""The third-party example package, installed with pip and run through the real ``lm_eval``.

``examples/lmc-plugin-example`` is pip-installed (``--no-deps
--no-build-isolation``) into a folder of its own that the tests put on the
path: a real installed distribution whose entry point lm-coupling discovers,
without touching the shared environment. Beside it, a deliberately faulty
plugin (a one-module distribution written here) raises on one document,
returns the wrong number of values on another and a profile of the wrong
length on a third.

One ``lm_eval --metrics anisotropy,attention_entropy,block_spectral_norm,lss,faulty``
run on the bundled model (eager attention) is shared by the tests, with a
stock run for the benchmark's scores. Every value of the example's metrics
and of ``lss`` equals an independent computation from the model's own hidden
states and attentions and from autograd Jacobians (1e-5), the faulty plugin's
failures are its own (named in warnings and in the geometry file), and the
benchmark's scores are those of the stock run.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.plugin_sites import plugin_env, write_plugin

from lm_coupling.demo.assets import bundled_model_path, bundled_tasks_data_path
from lm_coupling.harness.run import TASKS_DIR
from lm_coupling.metrics.trajectory import line_shape_score
from lm_coupling.plugins.manager import new_plugin_manager

TASK = "lmc_arc_easy_offline"
LIMIT = 5
SPECTRAL_DOCS = 2
METRICS = ("anisotropy", "attention_entropy", "block_spectral_norm", "lss", "faulty")
BIN = Path(sys.executable).parent
TOL = 1e-5

FAULTY_SOURCE = '''
"""A plugin that fails on purpose: raises on document 1, the wrong number of values on
document 2, and a profile one entry too long on document 3."""

from lm_coupling import hookimpl
from lm_coupling.plugins import MetricSpec


@hookimpl
def lmc_declare_metrics():
    return [MetricSpec("faulty", "1 where it does not fail", frozenset({"hidden_states"}),
                       profiles=("faulty",))]


class Nothing:
    def update(self, view):
        pass

    def finalize(self):
        return None


@hookimpl
def lmc_layer_reducer(selected, batch):
    return Nothing()


@hookimpl
def lmc_compute_batch(selected, states):
    import torch

    ids = {ref.doc_id for row in states.documents for ref in row}
    if 1 in ids:
        raise RuntimeError("deliberate failure of the faulty plugin")
    size = states.size
    if 2 in ids:
        return {"values": {"faulty": torch.ones(size + 1)}}
    width = states.n_layers + (2 if 3 in ids else 1)
    profile = torch.zeros(size, width)
    return {"values": {"faulty": torch.ones(size)}, "profiles": {"faulty": profile}}
'''


@pytest.fixture(scope="session")
def faulty_site(tmp_path_factory) -> Path:
    """A folder holding the faulty plugin (a one-module distribution)."""
    site = tmp_path_factory.mktemp("faulty")
    write_plugin(site, "lmc_faulty_plugin", "lmc_faulty", FAULTY_SOURCE)
    return site


def _env(site: Path, faulty: Path | None = None) -> dict[str, str]:
    return plugin_env(site, *([faulty] if faulty else []))


def _lm_eval(site: Path, out: Path, extra: list[str], faulty: Path) -> subprocess.CompletedProcess:
    model_args = f"pretrained={bundled_model_path()},dtype=float32,attn_implementation=eager"
    command = [str(BIN / "lm_eval"), "--model", "hf", "--model_args", model_args]
    command += ["--tasks", TASK, "--limit", str(LIMIT), "--batch_size", "1", "--device", "cpu"]
    command += ["--output_path", str(out), "--log_samples"]
    command += ["--metadata", json.dumps({"lmc_data_dir": str(bundled_tasks_data_path())})]
    done = subprocess.run(
        [*command, *extra], env=_env(site, faulty), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture(scope="session")
def runs(example_site, faulty_site, tmp_path_factory) -> dict:
    """The geometry run and a stock run; their results, samples, geometry file and stderr."""
    out = {}
    for name, extra in {
        "geometry": [
            "--metrics",
            ",".join(METRICS),
            "--metric_args",
            f"spectral_docs={SPECTRAL_DOCS}",
        ],
        "stock": ["--include_path", str(TASKS_DIR)],  # lm-coupling's offline tasks, stock lm-eval
    }.items():
        folder = tmp_path_factory.mktemp(f"example_{name}")
        done = _lm_eval(example_site, folder, extra, faulty_site)
        (results,) = folder.rglob("results_*.json")
        (samples,) = folder.rglob(f"samples_{TASK}_*.jsonl")
        rows = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
        geometry = list(folder.rglob(f"geometry_{TASK}_*.json"))
        out[name] = {
            "folder": folder,
            "stderr": done.stderr,
            "results": json.loads(results.read_text(encoding="utf-8")),
            "samples": {row["doc_id"]: row for row in rows},
            "geometry": json.loads(geometry[0].read_text(encoding="utf-8")) if geometry else None,
        }
    return out


# -- the independent computation ------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """lm-eval's own tokenisation and the model with eager attention, in float32."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(
        pretrained=str(bundled_model_path()),
        batch_size=1,
        device="cpu",
        dtype="float32",
        attn_implementation="eager",
    )
    assert lm.model.config._attn_implementation == "eager"
    return lm


def _prompt(lm, row) -> torch.Tensor:
    """The document's measured prompt: its gold request's context, encoded as HFLM does."""
    request = row["arguments"][f"gen_args_{int(row['target'])}"]
    context_enc, continuation_enc = lm._encode_pair(request["arg_0"], request["arg_1"])
    return torch.tensor(context_enc)


def _states_and_attentions(model, ids: torch.Tensor):
    """x^0..x^L ``[L+1, T, d]`` (x^L before the final norm, from the last block) and attentions."""
    blocks = model.transformer.h
    kept = {}
    hook = blocks[-1].register_forward_hook(
        lambda m, a, out: kept.update(x=out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            out = model(
                ids[None], output_hidden_states=True, output_attentions=True, use_cache=False
            )
    finally:
        hook.remove()
    states = torch.stack([*out.hidden_states[: len(blocks)], kept["x"]])[:, 0]
    return states.double(), [a[0].double() for a in out.attentions]


def _anisotropy(states: torch.Tensor) -> float:
    """Mean over states of the mean cosine over ordered pairs of tokens 1..n (a Gram matrix)."""
    per_state = []
    for x in states[:, 1:]:
        unit = x / x.norm(dim=-1, keepdim=True)
        gram = unit @ unit.T
        m = gram.shape[0]
        per_state.append((gram.sum() - gram.diagonal().sum()) / (m * (m - 1)))
    return float(torch.stack(per_state).mean())


def _attention_entropy(attentions: list[torch.Tensor]) -> float:
    per_block = []
    for a in attentions:  # [H, T, T]
        p = a[:, -1]  # the last token's attention, every head
        per_block.append(-(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1).mean())
    return float(torch.stack(per_block).mean())


def _block_jacobian(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """``d(block_l(X)_n - x_n) / d x_n``, other positions fixed, by autograd on the block itself."""
    block = model.transformer.h[layer]
    seen = {}
    hook = block.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(ids[None], use_cache=False)
    finally:
        hook.remove()
    hidden = seen["args"][0].detach()
    n = hidden.shape[1] - 1

    def residual_branch(x):
        varied = torch.cat([hidden[:, :n], x[None, None]], dim=1)
        out = block(varied, *seen["args"][1:], **seen["kwargs"])
        return (out[0] if isinstance(out, tuple) else out)[0, n] - x

    return torch.autograd.functional.jacobian(residual_branch, hidden[0, n].clone())


def _block_spectral_norm(model, ids: torch.Tensor) -> float:
    norms = [
        torch.linalg.svdvals(_block_jacobian(model, ids, layer).double())[0]
        for layer in range(len(model.transformer.h))
    ]
    return float(torch.stack(norms).mean())


def _lss(states: torch.Tensor) -> float:
    return float(line_shape_score(states.transpose(0, 1)[1:]).mean())


def _spectral_sample(runs: dict) -> set[int]:
    """The documents of ``block_spectral_norm``'s sample, as the geometry file records them."""
    return set(runs["geometry"]["geometry"]["sample"]["doc_ids"]["spectral_docs"])


@pytest.fixture(scope="module")
def expected(runs, reference) -> dict[int, dict[str, float]]:
    """Per document, every metric computed independently of lm-coupling's capture."""
    model = reference.model
    sample = _spectral_sample(runs)
    out = {}
    for doc_id, row in runs["geometry"]["samples"].items():
        ids = _prompt(reference, row)
        states, attentions = _states_and_attentions(model, ids)
        out[doc_id] = {
            "anisotropy": _anisotropy(states),
            "attention_entropy": _attention_entropy(attentions),
            "lss": _lss(states),
            "n_layers": len(attentions),
        }
        if doc_id in sample:
            out[doc_id]["block_spectral_norm"] = _block_spectral_norm(model, ids)
    return out


# -- the tests ------------------------------------------------------------------------


def test_the_installed_entry_point_is_discovered(example_site, faulty_site, monkeypatch):
    monkeypatch.syspath_prepend(str(example_site))
    monkeypatch.syspath_prepend(str(faulty_site))
    pm = new_plugin_manager(load_entry_points=True)
    assert pm.has_plugin("lmc_plugin_example") and pm.has_plugin("lmc_faulty")
    from lm_coupling.plugins.manager import get_registry

    registry = get_registry(pm)
    assert registry.metrics["anisotropy"].plugin == "lmc_plugin_example"
    assert registry.distributions()["lmc_plugin_example"] == "lmc-plugin-example 0.1.0"


def test_listing_the_metrics_loads_no_torch(example_site):
    code = (
        "import sys\n"
        "from lm_coupling.cli import main\n"
        "main(['metrics'])\n"
        "print('TORCH LOADED' if 'torch' in sys.modules else 'NO TORCH')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(example_site), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "anisotropy" in done.stdout and "block_spectral_norm" in done.stdout
    assert "plugin lmc_plugin_example" in done.stdout
    assert done.stdout.strip().endswith("NO TORCH")


@pytest.mark.slow
def test_values_equal_an_independent_computation(runs, expected):
    samples = runs["geometry"]["samples"]
    assert sorted(samples) == list(range(LIMIT))
    sample = _spectral_sample(runs)
    assert len(sample) == SPECTRAL_DOCS
    for doc_id, row in samples.items():
        want = expected[doc_id]
        for name in ("anisotropy", "attention_entropy", "lss"):
            assert row[name] == pytest.approx(want[name], rel=TOL, abs=TOL), (doc_id, name)
        if doc_id in sample:
            got = row["block_spectral_norm"]
            assert got == pytest.approx(want["block_spectral_norm"], rel=TOL, abs=TOL), doc_id
        else:
            assert "block_spectral_norm" not in row  # outside its document sample
    results = runs["geometry"]["results"]["results"][TASK]
    for name in ("anisotropy", "attention_entropy", "lss"):
        mean = sum(e[name] for e in expected.values()) / len(expected)
        assert results[f"{name},none"] == pytest.approx(mean, rel=TOL, abs=TOL)


@pytest.mark.slow
def test_profiles_are_in_the_geometry_file_and_geometry_long(runs, expected):
    from lm_coupling.report.build import build_report

    geometry = runs["geometry"]["geometry"]
    L = expected[0]["n_layers"]
    profiles = geometry["profiles"]
    assert len(profiles["anisotropy"]["mean"]) == L + 1  # states 0..L
    assert len(profiles["attention_entropy"]["mean"]) == L  # blocks 1..L
    assert len(profiles["block_spectral_norm"]["mean"]) == L
    assert profiles["anisotropy"]["n"] == [LIMIT] * (L + 1)
    assert profiles["block_spectral_norm"]["n"] == [SPECTRAL_DOCS] * L
    # Each profile's mean over its layers is the mean of the documents' values.
    for name in ("anisotropy", "attention_entropy"):
        mean = sum(e[name] for e in expected.values()) / len(expected)
        assert sum(profiles[name]["mean"]) / len(profiles[name]["mean"]) == pytest.approx(
            mean, abs=TOL
        )
    report = build_report(runs["geometry"]["folder"])
    long = report.geometry_long
    for name, layers in (
        ("anisotropy", L + 1),
        ("attention_entropy", L),
        ("block_spectral_norm", L),
    ):
        rows = long[(long["metric"] == name) & long["layer"].notna()]
        assert len(rows) == layers, name
        assert list(rows["value"]) == pytest.approx(profiles[name]["mean"], abs=1e-12)
        scalar = long[(long["metric"] == name) & long["layer"].isna()]
        assert len(scalar) == 1, name


@pytest.mark.slow
def test_the_faulty_plugin_fails_alone_and_is_named(runs, expected):
    run = runs["geometry"]
    samples = run["samples"]
    assert {d for d, row in samples.items() if "faulty" in row} == {0, 4}  # 3: a long profile
    for row in samples.values():  # built-ins and the example keep their values
        assert all(math.isfinite(row[name]) for name in ("lss", "anisotropy", "attention_entropy"))
    failures = [f for f in run["geometry"]["failures"] if f.get("plugin") == "lmc_faulty"]
    by_doc = {f["doc_id"]: f for f in failures}
    assert set(by_doc) == {1, 2, 3}
    assert "deliberate failure" in by_doc[1]["error"] and by_doc[1]["metrics"] == ["faulty"]
    assert "2 rows for 1 documents" in by_doc[2]["error"]
    assert "profile 'faulty' has shape" in by_doc[3]["error"]
    assert "declared axis needs" in by_doc[3]["error"]
    assert not [f for f in run["geometry"]["failures"] if f.get("plugin") != "lmc_faulty"]
    # The malformed profile is refused against its declared axis (and reported).
    assert run["geometry"]["profiles"]["faulty"]["n"] == [2] * (expected[0]["n_layers"] + 1)
    stderr = run["stderr"]
    task = f"of task {TASK!r}"  # one warning per cause, counting its documents
    assert f"plugin 'lmc_faulty' failed on 1 document {task} (document 1)" in stderr
    assert "deliberate failure of the faulty plugin" in stderr
    assert f"plugin 'lmc_faulty' failed on 1 document {task} (document 2)" in stderr
    assert f"plugin 'lmc_faulty' failed on 1 document {task} (document 3)" in stderr
    n_measured = run["results"]["config"]["lm_coupling"]["n_measured"][TASK]
    assert n_measured["faulty"] == 2 and n_measured["lss"] == LIMIT


@pytest.mark.slow
def test_the_benchmark_scores_are_those_of_the_stock_run(runs):
    geometry, stock = runs["geometry"], runs["stock"]
    for key in ("acc,none", "acc_norm,none"):
        assert geometry["results"]["results"][TASK][key] == stock["results"]["results"][TASK][key]
    for doc_id, row in geometry["samples"].items():
        assert row["acc"] == stock["samples"][doc_id]["acc"]
        assert row["acc_norm"] == stock["samples"][doc_id]["acc_norm"]


def test_attention_needs_eager_and_the_refusal_names_the_fix(example_site, tiny_model, monkeypatch):
    from lm_coupling.errors import ConfigurationError
    from lm_coupling.geometry import GeometryRunner
    from lm_coupling.plugins.manager import get_registry
    from lm_coupling.selection import make_selection

    monkeypatch.syspath_prepend(str(example_site))
    pm = new_plugin_manager(load_entry_points=True)
    selection = make_selection("attention_entropy", registry=get_registry(pm))
    model = tiny_model("gpt2", seed=5)
    model.config._attn_implementation = "sdpa"
    try:
        with pytest.raises(ConfigurationError, match="attn_implementation=eager") as info:
            GeometryRunner(model, selection, pm)
    finally:
        model.config._attn_implementation = "eager"
    assert "'attention_entropy' (plugin 'lmc_plugin_example')" in str(info.value)
    assert "'sdpa'" in str(info.value)


# -- closed forms and batches, in-process ---------------------------------------------


@pytest.fixture
def example(example_site, monkeypatch):
    """The installed package's plugin module."""
    monkeypatch.syspath_prepend(str(example_site))
    import lmc_plugin_example.plugin as plugin

    return plugin


def _batch(size: int, n_tokens: int, n_layers: int, last: list[int]):
    from lm_coupling.states import BatchInfo

    last_index = torch.tensor(last)
    positions = torch.arange(n_tokens)[None]
    return BatchInfo(
        n_layers=n_layers, d_model=8, vocab_size=11, size=size, n_tokens=n_tokens,
        last_index=last_index, first_index=torch.zeros(size, dtype=torch.long),
        token_mask=(positions > 0) & (positions <= last_index[:, None]),
        target_tokens=torch.full((size,), -1),
    )  # fmt: skip


def test_identical_token_states_have_anisotropy_one(example):
    from lm_coupling.states import LayerView

    batch = _batch(2, 6, 2, last=[5, 3])
    reducer = example.lmc_layer_reducer(selected=("anisotropy",), batch=batch)
    generator = torch.Generator().manual_seed(0)
    for layer in range(3):
        v = torch.randn(2, 1, 8, generator=generator, dtype=torch.float64)
        hidden = v.expand(2, 6, 8).clone()
        hidden[1, 4:] = torch.randn(2, 8, dtype=torch.float64)  # padding: outside the mask
        reducer.update(LayerView(layer=layer, hidden=hidden))
    per_state = reducer.finalize()["anisotropy"]
    torch.testing.assert_close(per_state, torch.ones(2, 3, dtype=torch.float64))
    # Opposite states: cos = -1 between the two halves; two tokens: exactly -1.
    reducer = example.lmc_layer_reducer(selected=("anisotropy",), batch=_batch(1, 3, 0, [2]))
    hidden = torch.tensor([[[9.0, 9.0], [1.0, 2.0], [-2.0, -4.0]]], dtype=torch.float64)
    reducer.update(LayerView(layer=0, hidden=hidden))
    assert float(reducer.finalize()["anisotropy"]) == pytest.approx(-1.0, abs=1e-12)


def test_uniform_attention_over_m_positions_has_entropy_ln_m(example):
    from lm_coupling.states import LayerView

    batch = _batch(2, 7, 2, last=[6, 2])
    reducer = example.lmc_layer_reducer(selected=("attention_entropy",), batch=batch)
    reducer.update(LayerView(layer=0))  # x^0: no block, no attention
    for layer, m in ((1, (7, 3)), (2, (4, 1))):
        attentions = torch.zeros(2, 3, 7, 7, dtype=torch.float64)
        for row, (n, count) in enumerate(zip(batch.last_index.tolist(), m, strict=True)):
            attentions[row, :, n, :count] = 1.0 / count
        reducer.update(LayerView(layer=layer, attentions=attentions))
    per_block = reducer.finalize()["attention_entropy"]
    want = torch.tensor([[math.log(7), math.log(4)], [math.log(3), 0.0]], dtype=torch.float64)
    torch.testing.assert_close(per_block, want)
    values = example.lmc_compute_batch(
        selected=("attention_entropy",), states=None, reduced={"attention_entropy": per_block}
    )
    torch.testing.assert_close(values["values"]["attention_entropy"], want.mean(dim=1))


def test_a_padded_batch_equals_each_prompt_alone(example_site, tiny_model, tokenizer, monkeypatch):
    from lm_coupling.geometry import GeometryRunner
    from lm_coupling.plugins.manager import get_registry
    from lm_coupling.selection import make_selection

    monkeypatch.syspath_prepend(str(example_site))
    pm = new_plugin_manager(load_entry_points=True)
    selection = make_selection("anisotropy,attention_entropy,lss", registry=get_registry(pm))
    model = tiny_model("llama")
    runner = GeometryRunner(model, selection, pm)
    prompts = [
        torch.tensor(tokenizer(text)["input_ids"])
        for text in ("The sun is a star.", "Plants need light and water to grow")
    ]
    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, ids in enumerate(prompts):
        batch[row, : len(ids)] = ids
    last = torch.tensor([len(p) - 1 for p in prompts])
    documents = [[("t", 0)], [("t", 1)]]
    with (
        torch.no_grad(),
        runner.capture(
            last, torch.zeros(2, dtype=torch.long), torch.full((2,), -1), documents
        ) as handle,
    ):
        model(batch)
    docs = runner.compute(handle)
    for doc, ids in zip(docs, prompts, strict=True):
        alone = runner.measure_prompt(ids)
        assert doc.failures == []
        for name in ("anisotropy", "attention_entropy", "lss"):
            assert doc.values[name] == pytest.approx(alone.values[name], rel=1e-5, abs=1e-6), name
            assert math.isfinite(doc.values[name])
