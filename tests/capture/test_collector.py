"""Streaming capture: equality with a dense route, padding, generate, dtypes, hook cleanup."""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling.capture.architecture import block_output_hidden, locate_model_parts
from lm_coupling.capture.collector import StateCollector, capture_prompt_states
from lm_coupling.demo.tiny import ARCHITECTURES, build_tiny_model
from lm_coupling.metrics.trajectory import (
    line_shape_score,
    norm_profile,
    windowed_line_shape_score,
)

PROMPTS = (
    "Question: Which property of a mineral can be determined just by looking at it?",
    "The sun is a star.",
    "Plants need light",
)
ATOL = 1e-5


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
    collector = StateCollector(model, parts, trajectory=True, lens=True)
    with torch.no_grad(), collector.capture(last, [0] * len(ids), targets) as handle:
        model(batch)  # as lm-eval's loglikelihood batches: no attention mask
    for row, i in enumerate(ids):
        _assert_row_matches(handle.states, row, 0, alone[row], len(i))


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
    collector = StateCollector(model, parts, trajectory=True, lens=True)
    with torch.no_grad(), collector.capture([width - 1] * len(ids), pads, targets) as handle:
        generated = model.generate(
            batch, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0
        )
    assert generated.shape == (len(ids), width + 2)
    assert handle.states.trajectory.norms.shape == (len(ids), 4, width)
    for row, i in enumerate(ids):
        _assert_row_matches(handle.states, row, pads[row], alone[row], len(i))


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
    assert last.trajectory.token_mask[0].nonzero().flatten().tolist() == [n]
    for name in ("norms", "step_lengths"):
        got, want = getattr(last.trajectory, name), getattr(full.trajectory, name)
        torch.testing.assert_close(got[..., n], want[..., n], atol=ATOL, rtol=ATOL)
        assert torch.isnan(got[..., :n]).all()
    torch.testing.assert_close(last.trajectory.lss[0, n], full.trajectory.lss[0, n])


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
    collector = StateCollector(model, parts, trajectory=True, lens=True)
    ids = _ids(tokenizer, PROMPTS[1])[None]
    with pytest.raises(ValueError, match="batch size 1"):
        with torch.no_grad(), collector.capture([1, 1], [0, 0], [-1, -1]):
            assert _hook_counts(parts) != before
            model(ids)
    assert _hook_counts(parts) == before
    with pytest.raises(ValueError, match="outside the"):
        with torch.no_grad(), collector.capture([99], [0], [-1]):
            model(ids)
    with pytest.raises(RuntimeError, match="boom"):
        with collector.capture([1], [0], [-1]) as handle:
            raise RuntimeError("boom")
    assert handle.states is None
    assert _hook_counts(parts) == before


def test_only_the_first_forward_is_captured(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)
    ids = _ids(tokenizer, PROMPTS[0])
    alone = capture_prompt_states(model, parts, ids)
    collector = StateCollector(model, parts, trajectory=True, lens=True)
    with torch.no_grad(), collector.capture([len(ids) - 1], [0], [-1]) as handle:
        model(ids[None])
        model(torch.zeros(3, 2, dtype=torch.int64))  # would not fit the indices
    torch.testing.assert_close(handle.states.trajectory.norms, alone.trajectory.norms)
    with collector.capture([0], [0], [-1]) as idle:
        pass
    assert idle.states is None


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
    with pytest.raises(ValueError, match="tokens must be"):
        StateCollector(model, parts, trajectory=True, lens=True, tokens="first")
    with pytest.raises(TypeError, match="ModelParts"):
        StateCollector(model, None, trajectory=True, lens=True)
    collector = StateCollector(model, parts, trajectory=True, lens=False)
    with pytest.raises(ValueError, match="first_index <= last_index"):
        with collector.capture([1], [2], None):
            pass
    with pytest.raises(ValueError, match="one entry per document"):
        with collector.capture([1, 2], [0], None):
            pass
    with pytest.raises(ValueError, match="1-D integer"):
        capture_prompt_states(model, parts, torch.zeros(2, 3, dtype=torch.int64))
