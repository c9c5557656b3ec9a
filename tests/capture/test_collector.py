"""Streaming capture: equality with a dense route, padding, generate, dtypes, hook cleanup.

The collector serves views to named reducers; the built-in trajectory and lens
reducers (plugins/builtin) stand in for any plugin's here, and the tests at
the end check what capture serves (states, lens, attentions, documents), its
isolation of a failing reducer or lens, and its memory against the depth.
"""

from __future__ import annotations

import math

import pytest
import torch
from fixtures.tiny import ARCHITECTURES, build_tiny_model

from lm_coupling.capture.collector import StateCollector
from lm_coupling.capture.lens import LogitLens
from lm_coupling.metrics.trajectory import (
    line_shape_score,
    norm_profile,
    windowed_line_shape_score,
)
from lm_coupling.model.architecture import block_output_hidden, locate_model_parts

PROMPTS = (
    "Question: Which property of a mineral can be determined just by looking at it?",
    "The sun is a star.",
    "Plants need light",
)
ATOL = 1e-5


def _reducers(trajectory=True, lens=True, windowed=True, tokens="all"):
    """The built-in trajectory and lens reducers, as a run starts them."""
    from lm_coupling.plugins.builtin.lens import LensReducer
    from lm_coupling.plugins.builtin.trajectory import TrajectoryReducer

    out = {}
    if trajectory:
        out["trajectory"] = lambda batch: TrajectoryReducer(batch, windowed, tokens)
    if lens:
        out["lens"] = LensReducer
    return out


def _collector(model, parts, trajectory=True, lens=True, **kwargs):
    return StateCollector(
        model, parts, hidden_states=trajectory, lens=LogitLens(parts) if lens else None, **kwargs
    )


class _Captured:
    """A finished capture as the tests read it: the reducers' summaries and the states."""

    def __init__(self, handle):
        assert handle.errors == {}, handle.errors
        self.handle = handle
        self.trajectory = handle.reduced.get("trajectory")
        self.lens = handle.reduced.get("lens")
        states = handle.states
        self.n_layers, self.d_model, self.vocab_size = (
            states.n_layers, states.d_model, states.vocab_size
        )  # fmt: skip


def capture_prompt_states(
    model, parts, ids, target_token=-1, trajectory=True, lens=True, windowed=True, tokens="all"
):
    collector = _collector(model, parts, trajectory, lens)
    reducers = _reducers(trajectory, lens, windowed, tokens)
    return _Captured(collector.capture_prompt(ids, target_token, reducers))


def _ids(tokenizer, text):
    return torch.tensor(tokenizer(text)["input_ids"])


def _dense_states(model, parts, input_ids, **kwargs):
    """[B, T, L+1, d]: x^0..x^{L-1} from output_hidden_states, x^L from a hook."""
    kept = {}
    hook = parts.blocks[-1].register_forward_hook(
        lambda module, args, output: kept.__setitem__("x", block_output_hidden(output))
    )
    try:
        with torch.no_grad():
            out = model(input_ids, output_hidden_states=True, use_cache=False, **kwargs)
    finally:
        hook.remove()
    states = [*out.hidden_states[: parts.n_layers], kept["x"]]
    return torch.stack(states, dim=2).float()


def _dense_lens(model, parts, rows, target):
    """Entropy/ln V, P(target), top-1 of softmax(W_U N(x) + b) from the model's own modules."""
    with torch.no_grad():
        normed = parts.final_norm(rows) if parts.final_norm is not None else rows
        logits = model.get_output_embeddings()(normed).float()
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])
    prob = logp.exp()[torch.arange(len(target)), :, target.clamp(min=0)]
    prob = torch.where((target >= 0)[:, None], prob, torch.nan)
    return entropy, prob, logits.argmax(-1)


def _assert_states_match_dense(states, traj, last, target, model, parts):
    t = states.trajectory
    torch.testing.assert_close(t.norms, norm_profile(traj).transpose(1, 2), atol=ATOL, rtol=ATOL)
    steps = (traj[:, :, 1:] - traj[:, :, :-1]).norm(dim=-1).transpose(1, 2)
    torch.testing.assert_close(t.step_lengths, steps, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(t.lss, line_shape_score(traj), atol=1e-4, rtol=1e-4)
    windowed = windowed_line_shape_score(traj).transpose(1, 2)
    torch.testing.assert_close(t.windowed_lss, windowed, atol=1e-4, rtol=1e-4)
    rows = traj[torch.arange(len(last)), last]  # [B, L+1, d]
    entropy, prob, top1 = _dense_lens(model, parts, rows, target)
    torch.testing.assert_close(states.lens.entropy, entropy, atol=ATOL, rtol=0)
    torch.testing.assert_close(states.lens.target_prob, prob, atol=ATOL, rtol=0, equal_nan=True)
    assert torch.equal(states.lens.top1, top1)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_collector_equals_dense_route(model_type, tiny_model, tokenizer):
    model = tiny_model(model_type)
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[0])
    target = torch.tensor([int(ids[3])])
    states = capture_prompt_states(model, parts, ids, target_token=int(target))
    traj = _dense_states(model, parts, ids[None])
    last = torch.tensor([len(ids) - 1])
    _assert_states_match_dense(states, traj, last, target, model, parts)
    assert (states.n_layers, states.d_model, states.vocab_size) == (3, 32, len(tokenizer))
    mask = states.trajectory.token_mask
    assert mask.shape == (1, len(ids)) and not mask[0, 0] and mask[0, 1:].all()
    # The last lens layer is the model's own next-token distribution.
    with torch.no_grad():
        p_model = model(ids[None]).logits[0, -1].float().softmax(-1)
    torch.testing.assert_close(
        states.lens.target_prob[0, -1], p_model[target[0]], atol=ATOL, rtol=0
    )
    assert states.lens.top1[0, -1] == p_model.argmax()


def _alone(model, parts, tokenizer):
    ids = [_ids(tokenizer, p) for p in PROMPTS]
    targets = [int(i[1]) for i in ids]
    return (
        ids,
        targets,
        [capture_prompt_states(model, parts, i, t) for i, t in zip(ids, targets, strict=True)],
    )


def _assert_row_matches(states, row, start, alone, length):
    """Row ``row`` of a batch, real tokens from ``start``, equals the prompt alone."""
    t, a = states.trajectory, alone.trajectory
    span = slice(start, start + length)
    assert torch.equal(t.token_mask[row, span], a.token_mask[0])
    assert t.token_mask[row].sum() == a.token_mask[0].sum()
    keep = a.token_mask[0]
    for name in ("norms", "step_lengths", "windowed_lss"):
        got = getattr(t, name)[row][..., span][..., keep]
        torch.testing.assert_close(got, getattr(a, name)[0][..., keep], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(t.lss[row, span][keep], a.lss[0, keep], atol=1e-4, rtol=1e-4)
    for name in ("entropy", "target_prob"):
        torch.testing.assert_close(
            getattr(states.lens, name)[row], getattr(alone.lens, name)[0], atol=ATOL, rtol=0
        )
    assert torch.equal(states.lens.top1[row], alone.lens.top1[0])


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_right_padded_batch_equals_prompt_alone(model_type, tiny_model, tokenizer):
    model = tiny_model(model_type)
    parts = locate_model_parts(model)
    ids, targets, alone = _alone(model, parts, tokenizer)
    width = max(len(i) for i in ids)
    batch = torch.zeros(len(ids), width, dtype=torch.int64)  # pad id 0 on the right
    for row, i in enumerate(ids):
        batch[row, : len(i)] = i
    last = [len(i) - 1 for i in ids]
    collector = _collector(model, parts)
    with torch.no_grad(), collector.capture(last, [0] * len(ids), targets, _reducers()) as handle:
        model(batch)  # as lm-eval's loglikelihood batches: no attention mask
    for row, i in enumerate(ids):
        _assert_row_matches(_Captured(handle), row, 0, alone[row], len(i))


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_generate_left_padded_captures_prefill_only(model_type, tiny_model, tokenizer):
    model = tiny_model(model_type)
    parts = locate_model_parts(model)
    ids, targets, alone = _alone(model, parts, tokenizer)
    width = max(len(i) for i in ids)
    batch = torch.zeros(len(ids), width, dtype=torch.int64)
    mask = torch.zeros_like(batch)
    pads = [width - len(i) for i in ids]
    for row, i in enumerate(ids):
        batch[row, pads[row] :] = i
        mask[row, pads[row] :] = 1
    collector = _collector(model, parts)
    last = [width - 1] * len(ids)
    with torch.no_grad(), collector.capture(last, pads, targets, _reducers()) as handle:
        generated = model.generate(
            batch, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0
        )
    assert generated.shape == (len(ids), width + 2)
    captured = _Captured(handle)
    assert captured.trajectory.norms.shape == (len(ids), 4, width)
    for row, i in enumerate(ids):
        _assert_row_matches(captured, row, pads[row], alone[row], len(i))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_half_precision_is_summarised_in_float32(model_type, dtype, tiny_model, tokenizer):
    model = tiny_model(model_type, dtype=dtype)
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[1])
    states = capture_prompt_states(model, parts, ids, target_token=int(ids[2]))
    t, lens = states.trajectory, states.lens
    for value in (t.norms, t.step_lengths, t.lss, t.windowed_lss, lens.entropy, lens.target_prob):
        assert value.dtype == torch.float32
        assert torch.isfinite(value[..., 1:]).all()
    # Same numbers as the dense functions on the model's own half-precision states.
    traj = _dense_states(model, parts, ids[None])
    torch.testing.assert_close(t.norms, norm_profile(traj).transpose(1, 2), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        p_model = model(ids[None]).logits[0, -1].float().softmax(-1)
    torch.testing.assert_close(lens.target_prob[0, -1], p_model[ids[2]], atol=2e-3, rtol=0)


def test_float64_model_stays_float64(tiny_model, tokenizer):
    model = tiny_model("gpt2", dtype=torch.float64)
    states = capture_prompt_states(model, locate_model_parts(model), _ids(tokenizer, PROMPTS[1]))
    assert states.trajectory.norms.dtype == states.lens.entropy.dtype == torch.float64
    assert torch.isnan(states.lens.target_prob).all()  # no target token


def test_tokens_last_and_no_window(tiny_model, tokenizer):
    model = tiny_model("llama")
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[0])
    full = capture_prompt_states(model, parts, ids)
    last = capture_prompt_states(model, parts, ids, tokens="last", windowed=False, lens=False)
    n = len(ids) - 1
    assert last.lens is None and last.trajectory.windowed_lss is None
    assert last.trajectory.token_mask.tolist() == [[True]]  # the one position n
    for name in ("norms", "step_lengths"):
        got, want = getattr(last.trajectory, name), getattr(full.trajectory, name)
        torch.testing.assert_close(got[..., 0], want[..., n], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(last.trajectory.lss[0, 0], full.trajectory.lss[0, n])


def test_lens_only(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    states = capture_prompt_states(
        model, locate_model_parts(model), _ids(tokenizer, PROMPTS[2]), trajectory=False
    )
    assert states.trajectory is None and states.lens.entropy.shape == (1, 4)
    assert ((states.lens.entropy >= 0) & (states.lens.entropy <= 1)).all()


def _hook_counts(parts):
    return [(len(b._forward_hooks), len(b._forward_pre_hooks)) for b in parts.blocks]


def test_hooks_are_removed_when_the_forward_raises(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)
    before = _hook_counts(parts)
    collector = _collector(model, parts)
    ids = _ids(tokenizer, PROMPTS[1])[None]
    with pytest.raises(ValueError, match="batch size 1"):
        with torch.no_grad(), collector.capture([1, 1], [0, 0], [-1, -1], _reducers()):
            assert _hook_counts(parts) != before
            model(ids)
    assert _hook_counts(parts) == before
    with pytest.raises(ValueError, match="outside the"):
        with torch.no_grad(), collector.capture([99], [0], [-1], _reducers()):
            model(ids)
    with pytest.raises(RuntimeError, match="boom"):
        with collector.capture([1], [0], [-1], _reducers()) as handle:
            raise RuntimeError("boom")
    assert handle.states is None
    assert _hook_counts(parts) == before


def test_only_the_first_forward_is_captured(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[0])
    alone = capture_prompt_states(model, parts, ids)
    collector = _collector(model, parts)
    with torch.no_grad(), collector.capture([len(ids) - 1], [0], [-1], _reducers()) as handle:
        model(ids[None])
        model(torch.zeros(3, 2, dtype=torch.int64))  # would not fit the indices
    torch.testing.assert_close(_Captured(handle).trajectory.norms, alone.trajectory.norms)
    with collector.capture([0], [0], [-1], _reducers()) as idle:
        pass
    assert idle.states is None and idle.reduced == {}


def test_model_without_final_norm(tokenizer):
    model = build_tiny_model("gpt2", len(tokenizer))
    model.transformer.ln_f = torch.nn.Identity()
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[1])
    states = capture_prompt_states(model, parts, ids, target_token=int(ids[1]))
    with torch.no_grad():
        p_model = model(ids[None]).logits[0, -1].softmax(-1)
    torch.testing.assert_close(states.lens.target_prob[0, -1], p_model[ids[1]], atol=ATOL, rtol=0)


def test_bad_arguments(tiny_model):
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)
    with pytest.raises(TypeError, match="ModelParts"):
        StateCollector(model, None)
    with pytest.raises(TypeError, match="logits"):
        StateCollector(model, parts, lens=object())
    collector = _collector(model, parts, lens=False)
    with pytest.raises(ValueError, match="first_index <= last_index"):
        with collector.capture([1], [2], None, {}):
            pass
    with pytest.raises(ValueError, match="one entry per document"):
        with collector.capture([1, 2], [0], None, {}):
            pass
    with pytest.raises(ValueError, match="1-D integer"):
        capture_prompt_states(model, parts, torch.zeros(2, 3, dtype=torch.int64))


# -- what capture serves ------------------------------------------------------------


class _Keep:
    """A reducer that keeps copies of what it is served (tests only: real reducers reduce)."""

    def __init__(self, batch):
        self.batch, self.views = batch, []

    def update(self, view):
        self.views.append({k: getattr(view, k) for k in ("layer", "hidden", "at_n", "logits")})
        self.views[-1]["attentions"] = view.attentions

    def finalize(self):
        return self


def test_views_are_the_states_lens_and_attentions(tiny_model, tokenizer):
    model = tiny_model("llama")  # eager attention (fixtures.tiny builds every model eager)
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[0])
    collector = _collector(model, parts, attentions=True)
    handle = collector.capture_prompt(ids, -1, {"keep": _Keep}, [[("arc", 7)]])
    keep = handle.reduced["keep"]
    assert [v["layer"] for v in keep.views] == [0, 1, 2, 3]
    assert keep.batch.documents == ((("arc", 7),),) and keep.batch.documents[0][0].doc_id == 7
    assert handle.states.documents[0][0].task == "arc" and handle.states.size == 1
    assert keep.batch.token_mask.tolist() == [[False] + [True] * (len(ids) - 1)]
    traj = _dense_states(model, parts, ids[None])[0]  # [T, L+1, d]
    with torch.no_grad():
        out = model(ids[None], output_attentions=True, use_cache=False)
    for view in keep.views:
        layer = view["layer"]
        torch.testing.assert_close(view["hidden"][0], traj[:, layer], atol=ATOL, rtol=0)
        torch.testing.assert_close(view["at_n"][0], traj[-1, layer], atol=ATOL, rtol=0)
        normed = parts.final_norm(traj[-1, layer][None])
        logits = model.get_output_embeddings()(normed).detach()
        torch.testing.assert_close(view["logits"], logits, atol=ATOL, rtol=0)
        if layer == 0:
            assert view["attentions"] is None
        else:
            torch.testing.assert_close(
                view["attentions"], out.attentions[layer - 1], atol=ATOL, rtol=0
            )
    # The last lens layer is the model's own output.
    torch.testing.assert_close(keep.views[-1]["logits"][0], out.logits[0, -1], atol=ATOL, rtol=0)


class _Boom:
    def __init__(self, batch):
        self.layer = None

    def update(self, view):
        if view.layer == 2:
            raise RuntimeError("reducer boom")

    def finalize(self):
        return "never"


class _Doubled:
    """A lens of another kind: the logit lens of 2 x^l."""

    name = "doubled"

    def __init__(self, parts):
        self.parts = parts

    def logits(self, layer, hidden):
        return self.parts.unembed_fp32(self.parts.final_norm_fp32(2 * hidden + layer))


def test_a_failing_reducer_is_dropped_and_the_others_keep_their_values(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[0])
    alone = capture_prompt_states(model, parts, ids, target_token=int(ids[2]))
    reducers = {**_reducers(), "boom": _Boom, "broken_start": lambda batch: 1 / 0}
    handle = _collector(model, parts).capture_prompt(ids, int(ids[2]), reducers)
    assert set(handle.errors) == {"boom", "broken_start"}
    assert "reducer boom" in handle.errors["boom"]
    assert "ZeroDivisionError" in handle.errors["broken_start"]
    assert "boom" not in handle.reduced
    for name in ("trajectory", "lens"):
        for field, value in vars(handle.reduced[name]).items():
            want = getattr(getattr(alone, name), field)
            if value is not None:
                torch.testing.assert_close(value, want, equal_nan=True)


def test_a_plugged_lens_is_served_and_a_failing_one_fails_only_its_readers(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[1])
    collector = StateCollector(model, parts, lens=_Doubled(parts))
    handle = collector.capture_prompt(ids, -1, {"keep": _Keep})
    assert handle.info.lens == "doubled"
    for view in handle.reduced["keep"].views:
        want = LogitLens(parts).logits(0, 2 * view["at_n"] + view["layer"])
        torch.testing.assert_close(view["logits"], want)

    class Failing(_Doubled):
        def logits(self, layer, hidden):
            raise RuntimeError("lens boom")

    collector = StateCollector(model, parts, lens=Failing(parts))
    handle = collector.capture_prompt(ids, -1, {"keep": _Keep, **_reducers(lens=False)})
    assert "lens boom" in handle.lens_errors["doubled"]
    assert all(v["logits"] is None for v in handle.reduced["keep"].views)
    alone = capture_prompt_states(model, parts, ids, lens=False)
    torch.testing.assert_close(handle.reduced["trajectory"].lss, alone.trajectory.lss)


class _Weigh:
    """Counts the bytes of earlier views' tensors still alive when each layer arrives."""

    def __init__(self, batch):
        import weakref

        self.weakref, self.earlier, self.alive, self.view_bytes = weakref.ref, [], [], 0

    def update(self, view):
        tensors = [t for t in (view.hidden, view.at_n, view.normed, view.logits) if t is not None]
        self.view_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.alive.append(
            sum(ref().numel() * ref().element_size() for ref in self.earlier if ref() is not None)
        )
        self.earlier.extend(self.weakref(t) for t in tensors)

    def finalize(self):
        return self


@pytest.mark.parametrize("n_layers", [2, 4, 8])
def test_capture_holds_one_layer_whatever_the_depth(n_layers, tokenizer):
    # bfloat16 states are cast to float32 by capture itself: every served tensor is
    # capture's own, so what stays alive of earlier layers is what capture holds.
    model = build_tiny_model("gpt2", len(tokenizer), dtype=torch.bfloat16, n_layers=n_layers)
    parts = locate_model_parts(model)
    assert parts.n_layers == n_layers
    ids = _ids(tokenizer, PROMPTS[0])
    handle = _collector(model, parts).capture_prompt(ids, -1, {"weigh": _Weigh})
    weigh = handle.reduced["weigh"]
    assert len(weigh.alive) == n_layers + 1
    assert weigh.view_bytes > 0 and max(weigh.alive) == 0  # no earlier layer is kept
