"""The Layer by Layer and Jacobian-lens plugins through the library runner: options, lens files."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from fixtures.jacobians import states_at_last

from lm_coupling.capture.lens import JacobianLens, LogitLens
from lm_coupling.errors import ConfigurationError
from lm_coupling.geometry import GeometryRunner
from lm_coupling.metrics import layer_by_layer as lbl
from lm_coupling.model.architecture import block_output_hidden, locate_model_parts
from lm_coupling.plugins.builtin.jacobian_lens import load_lens, save_lens
from lm_coupling.selection import make_selection

TEXT = "Question: which gas do plants take in from the air? Answer:"


def _token_states(model, ids) -> torch.Tensor:
    """``[L+1, T, d]``: the block inputs and outputs, by hooks (before the final norm)."""
    parts = locate_model_parts(model)
    states = []
    handles = [
        parts.blocks[0].register_forward_pre_hook(
            lambda _m, args, kwargs: states.append(
                (args[0] if args else kwargs["hidden_states"])[0]
            ),
            with_kwargs=True,
        )
    ]
    for block in parts.blocks:
        handles.append(
            block.register_forward_hook(
                lambda _m, _a, out: states.append(block_output_hidden(out)[0])
            )
        )
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        for h in handles:
            h.remove()
    return torch.stack(states)


@pytest.mark.parametrize(
    "args",
    [None, "lbl_alpha=2,lbl_standardize=true,curvature_abs=true,lbl_normalized=true"],
)
def test_options_reach_the_math(tiny_model, tokenizer, args):
    model = tiny_model("llama", init_std=0.2)
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    names = "prompt_entropy,curvature,effective_rank,curvature_min_layer"
    doc = GeometryRunner(model, make_selection(names, args)).measure_prompt(ids)
    z = _token_states(model, ids)[:, 1:]  # measured: tokens 1..n
    opts = dict(alpha=1.0, standardize=False, absolute=False, normalized=False)
    if args:
        opts = dict(alpha=2.0, standardize=True, absolute=True, normalized=True)
    if opts["standardize"]:
        z = lbl.standardize_tokens(z)
    entropy = lbl.prompt_entropy(z, alpha=opts["alpha"], normalized=opts["normalized"])
    curv = lbl.curvature(z, absolute=opts["absolute"])
    assert doc.values["prompt_entropy"] == pytest.approx(float(entropy.mean()), abs=1e-5)
    assert doc.values["curvature"] == pytest.approx(float(curv.mean()), abs=1e-5)
    assert doc.values["effective_rank"] == pytest.approx(
        float(lbl.effective_rank(z).mean()), abs=1e-4
    )
    L = z.shape[0] - 1
    assert doc.values["curvature_min_layer"] == pytest.approx(float(curv.argmin()) / L, abs=1e-6)
    torch.testing.assert_close(
        torch.as_tensor(doc.profiles["curvature"]).float(), curv, atol=1e-5, rtol=0
    )


def test_lens_file_round_trip_and_refusals(tmp_path):
    J = torch.randn(4, 8, 8)
    J[-1] = torch.eye(8)  # J_L = I: the file does not store it
    path = save_lens(tmp_path, J, 5, "my_task")
    assert path == tmp_path / "jlens_my_task.pt"
    record = load_lens(path, n_layers=3, d_model=8)
    torch.testing.assert_close(record["jacobians"], J)
    assert (record["n_documents"], record["task"], record["n_layers"], record["d_model"]) == (
        5, "my_task", 3, 8,
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="target layer 2 .* another model"):
        load_lens(path, n_layers=4, d_model=8)
    torch.save({"something": 1}, tmp_path / "other.pt")
    torch.save({"format": "lm_coupling.jacobian_lens", "version": 1}, tmp_path / "v1.pt")
    with pytest.raises(ConfigurationError, match="version 1.*fit the lens again"):
        load_lens(tmp_path / "v1.pt", 3, 8)
    with pytest.raises(ConfigurationError, match="not a Jacobian lens"):
        load_lens(tmp_path / "other.pt", 3, 8)


def test_identity_jacobians_make_the_logit_lens(tiny_model, tokenizer):
    model = tiny_model("gpt2", init_std=0.2)
    parts = locate_model_parts(model)
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    states, logits = states_at_last(model, parts, ids)
    eye = torch.eye(parts.d_model).expand(parts.n_layers + 1, -1, -1)
    jlens, logit = JacobianLens(eye, parts), LogitLens(parts)
    for layer in range(parts.n_layers + 1):
        torch.testing.assert_close(
            jlens.logits(layer, states[layer][None]), logit.logits(layer, states[layer][None])
        )
    torch.testing.assert_close(jlens.logits(parts.n_layers, states[-1][None])[0], logits)


@pytest.mark.parametrize("metrics", ["jlens_entropy", "jlens_entropy,jlens_fixation_depth"])
def test_a_loaded_identity_lens_reads_as_the_logit_lens_in_the_forward_pass(
    tiny_model, tokenizer, tmp_path, metrics
):
    model = tiny_model("gpt2", init_std=0.2)
    parts = locate_model_parts(model)
    eye = torch.eye(parts.d_model).expand(parts.n_layers + 1, -1, -1)
    path = save_lens(tmp_path, eye, 1, "task")
    selection = make_selection(f"{metrics},logit_lens_entropy,fixation_depth", f"jlens_path={path}")
    runner = GeometryRunner(model, selection)
    assert set(runner.lenses) == {"logit", "jacobian"}  # two named lenses, one forward pass
    ids = torch.tensor(tokenizer(TEXT)["input_ids"])
    doc = runner.measure_prompt(ids[:-1], int(ids[-1]), sampled=False)
    assert not doc.failures
    assert doc.values["jlens_entropy"] == pytest.approx(doc.values["logit_lens_entropy"], abs=1e-6)
    if "jlens_fixation_depth" in metrics:
        assert doc.values["jlens_fixation_depth"] == doc.values["fixation_depth"]


def test_listing_the_new_metrics_loads_no_torch():
    code = (
        "import sys; import lm_coupling.plugins.builtin.jacobian_lens, "
        "lm_coupling.plugins.builtin.layer_by_layer; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
