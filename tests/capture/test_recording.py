"""Recorded forward passes reduced together give each forward's own values.

`StateCollector.record` copies a forward's measured rows and runs no reducer;
`StateCollector.replay` serves several recordings as one batch, right-padded
to the longest (`capture.recording`). Each test compares a replay with the
independent route: every forward captured and reduced alone
(`StateCollector.capture`), on forwards of different lengths, row subsets,
left padding, and a lens-only selection (the rows at n are recorded, not the
whole rows).
"""

from __future__ import annotations

import math

import pytest
import torch
from fixtures.host_reads import HostReads
from fixtures.prompts import PROMPTS, TRAJ_LENS, right_padded

from lm_coupling.capture.architecture import locate_model_parts
from lm_coupling.capture.collector import StateCollector
from lm_coupling.capture.recording import stack_recordings
from lm_coupling.geometry import GeometryRunner
from lm_coupling.plugins.manager import get_registry, new_plugin_manager
from lm_coupling.selection import make_selection


def _runner(model, metrics: str) -> GeometryRunner:
    manager = new_plugin_manager(load_entry_points=False)
    selection = make_selection(metrics, None, registry=get_registry(manager))
    return GeometryRunner(model, selection, manager)


def _right_padded(tokenizer, prompts):
    """``(ids, kwargs, last, first, target)``: right padding, as lm-eval pads scoring."""
    ids, last, target = right_padded(tokenizer, prompts)
    return ids, {}, last, torch.zeros_like(last), target


def _left_padded(tokenizer, prompts):
    """Left padding with an attention mask, as lm-eval pads a generation batch."""
    ids = [torch.tensor(tokenizer(p)["input_ids"]) for p in prompts]
    width = max(len(i) for i in ids)
    batch = torch.zeros(len(ids), width, dtype=torch.int64)
    mask = torch.zeros(len(ids), width, dtype=torch.int64)
    for row, i in enumerate(ids):
        batch[row, width - len(i) :], mask[row, width - len(i) :] = i, 1
    first = (mask == 0).sum(dim=1)
    last = torch.full((len(ids),), width - 1)
    return batch, {"attention_mask": mask}, last, first, torch.full_like(last, -1)


def _forwards(tokenizer):
    """Three forwards of different lengths and paddings, and the rows each measures."""
    return [
        (_right_padded(tokenizer, PROMPTS[:3]), [0, 2]),
        (_right_padded(tokenizer, PROMPTS[3:5]), [0, 1]),
        (_left_padded(tokenizer, PROMPTS[4:7]), [1, 2]),
    ]


def _docs(k, rows):
    return [[("t", 10 * k + row)] for row in rows]


def _assert_same_documents(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.failures == [] and b.failures == []
        assert set(a.values) == set(b.values) and set(a.profiles) == set(b.profiles)
        for name, value in b.values.items():
            assert a.values[name] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), name
        for name, profile in b.profiles.items():
            torch.testing.assert_close(
                torch.as_tensor(a.profiles[name]),
                torch.as_tensor(profile),
                rtol=1e-5,
                atol=1e-6,
                equal_nan=True,
            )


@pytest.mark.parametrize(
    "model_type,metrics",
    [("gpt2", TRAJ_LENS), ("llama", TRAJ_LENS), ("llama", "logit_lens_entropy,tv_to_target")],
)
def test_a_replay_equals_each_forward_captured_alone(model_type, metrics, tiny_model, tokenizer):
    model = tiny_model(model_type)
    runner = _runner(model, metrics)
    alone, recordings = [], []
    with torch.no_grad():
        for k, ((ids, kwargs, last, first, target), rows) in enumerate(_forwards(tokenizer)):
            index = torch.tensor(rows)
            args = (last[index], first[index], target[index], _docs(k, rows), index)
            with runner.capture(*args) as handle:
                model(ids, **kwargs)
            alone += runner.compute(handle)
            with runner.record(*args) as recording:
                model(ids, **kwargs)
            assert recording.complete and recording.size == len(rows)
            recordings.append(recording)
    handle = runner.replay(recordings)
    assert handle.errors == {} and handle.lens_error is None
    assert handle.info.size == 6 and handle.info.n_tokens == max(r.n_tokens for r in recordings)
    assert [doc.doc_id for row in handle.states.documents for doc in row] == [0, 2, 10, 11, 21, 22]
    replayed = runner.compute(handle)
    _assert_same_documents(replayed, alone)
    assert all(math.isfinite(doc.values["logit_lens_entropy"]) for doc in replayed)


def test_indices_given_as_lists_record_what_tensors_record(tiny_model, tokenizer):
    """The harness passes a batch's indices as Python lists (one tensor each, made once)."""
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    (ids, kwargs, last, first, target), rows = _forwards(tokenizer)[0]
    index = torch.tensor(rows)
    as_tensors = (last[index], first[index], target[index], _docs(0, rows), index)
    as_lists = tuple(x.tolist() if isinstance(x, torch.Tensor) else x for x in as_tensors)
    recordings = []
    with torch.no_grad():
        for args in (as_tensors, as_lists):
            with runner.record(*args) as recording:
                model(ids, **kwargs)
            recordings.append(recording)
    by_tensors, by_lists = recordings
    for name in ("last", "first", "target"):
        got, want = getattr(by_lists, name), getattr(by_tensors, name)
        assert got == want and all(type(v) is int for v in got), name
    assert by_lists.documents == by_tensors.documents
    assert torch.equal(by_lists.stacked, by_tensors.stacked)
    assert by_lists.n_tokens == by_tensors.n_tokens
    for got, want in zip(by_lists.states, by_tensors.states, strict=True):
        assert torch.equal(got, want)
    n = last[index].tolist()
    with pytest.raises(ValueError, match="rows must be increasing"):
        with runner.record(n, [0, 0], [-1, -1], None, rows[::-1]):
            pass
    with pytest.raises(ValueError, match="first_index <= last_index"):
        with runner.record(n, [n[0] + 1, 0], [-1, -1], None, rows):
            pass
    with pytest.raises(ValueError, match="1-D integer"):
        with runner.record([float(v) for v in n], [0, 0], [-1, -1], None, rows):
            pass


class _ViewProbe:
    """A reducer that keeps what each `LayerView` held (the stack and the hidden views)."""

    def __init__(self, info):
        self.views = []

    def update(self, view):
        self.views.append(view)

    def finalize(self):
        return self.views


def test_a_replay_serves_one_stack_of_every_state(tiny_model, tokenizer):
    """Each layer's ``hidden`` is a view of ``LayerView.stack``; a live capture serves none."""
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    recordings, live = [], None
    with torch.no_grad():
        for (ids, kwargs, last, first, target), rows in _forwards(tokenizer)[:2]:
            index = torch.tensor(rows)
            with runner.record(last[index], first[index], target[index], None, index) as rec:
                model(ids, **kwargs)
            recordings.append(rec)
        (ids, kwargs, last, first, target), _ = _forwards(tokenizer)[0]
        with runner.collector.capture(last, first, target, {"probe": _ViewProbe}) as live:
            model(ids, **kwargs)
    assert all(view.stack is None for view in live.reduced["probe"])
    views = runner.collector.replay(recordings, {"probe": _ViewProbe}).reduced["probe"]
    stack = views[0].stack
    n_layers = locate_model_parts(model).n_layers
    assert stack.shape == (4, n_layers + 1, max(r.n_tokens for r in recordings), 32)
    for layer, view in enumerate(views):
        assert view.layer == layer and view.stack is stack
        assert view.hidden.data_ptr() == stack[:, layer].data_ptr()
        for start, recording in zip((0, 2), recordings, strict=True):
            rows = view.hidden[start : start + 2]
            torch.testing.assert_close(rows[:, : recording.n_tokens], recording.states[layer])
            assert not rows[:, recording.n_tokens :].any()


def test_lens_only_recordings_keep_the_rows_at_n(tiny_model, tokenizer):
    model = tiny_model("llama")
    runner = _runner(model, "logit_lens_entropy")
    (ids, _, last, first, target), _ = _forwards(tokenizer)[0]
    with torch.no_grad(), runner.record(last, first, target) as recording:
        model(ids)
    parts = locate_model_parts(model)
    assert len(recording.states) == parts.n_layers + 1
    assert all(state.shape == (3, parts.d_model) for state in recording.states)
    assert recording.nbytes == runner.recording_bytes(3, ids.shape[1])


def test_a_recording_holds_copies_of_the_measured_rows(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    parts = locate_model_parts(model)
    (ids, _, last, first, target), _ = _forwards(tokenizer)[0]
    outputs = []
    hooks = [
        block.register_forward_hook(lambda m, a, out: outputs.append(out)) for block in parts.blocks
    ]
    try:
        with torch.no_grad(), runner.record(last, first, target) as everything:
            model(ids)
        with torch.no_grad(), runner.record(last[1:], first[1:], target[1:], None, [1, 2]) as part:
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    model_storage = {
        (out[0] if isinstance(out, tuple) else out).untyped_storage().data_ptr() for out in outputs
    }
    for recording in (everything, part):
        assert not {s.untyped_storage().data_ptr() for s in recording.states} & model_storage
    # Positions up to the last measured one are kept: rows 1-2 end before row 0 does.
    assert everything.n_tokens == int(last.max()) + 1 > part.n_tokens == int(last[1:].max()) + 1
    for layer, state in enumerate(part.states):  # the measured rows, row for row
        expected = everything.states[layer][1:, : part.n_tokens]
        torch.testing.assert_close(state, expected, rtol=0, atol=0)
    assert everything.nbytes == runner.recording_bytes(3, everything.n_tokens)


def _record_twice(runner, model, tokenizer, copy_in_hooks: bool):
    """Two recordings of one forward (rows 0 and 2 of three), the second copying in the hooks."""
    (ids, kwargs, last, first, target), rows = _forwards(tokenizer)[0]
    index = torch.tensor(rows)
    args = (last[index], first[index], target[index], _docs(0, rows), index)
    recordings = []
    with torch.no_grad():
        for copy in (False, copy_in_hooks):
            runner.collector.copy_in_hooks = copy
            with runner.record(*args) as recording:
                model(ids, **kwargs)
            recordings.append(recording)
    return recordings


@pytest.mark.parametrize("stack_first_bytes", [None, 0])
@pytest.mark.parametrize("metrics", [TRAJ_LENS, "logit_lens_entropy"])
def test_states_referenced_in_the_forward_equal_states_copied_in_each_hook(
    metrics, stack_first_bytes, tiny_model, tokenizer, monkeypatch
):
    """A small forward's states are referenced and copied after block L; the copy is exact.

    Either way of copying the references (stacked whole, or each state's rows
    into place: `STACK_FIRST_BYTES`), whole rows or the rows at n alone.
    """
    import lm_coupling.capture.recording as recording_module

    if stack_first_bytes is not None:
        monkeypatch.setattr(recording_module, "STACK_FIRST_BYTES", stack_first_bytes)
    model = tiny_model("gpt2")
    runner = _runner(model, metrics)
    by_reference, copied = _record_twice(runner, model, tokenizer, copy_in_hooks=True)
    for recording in (by_reference, copied):
        assert recording.complete and recording.error is None
    assert torch.equal(by_reference.stacked, copied.stacked)


@pytest.mark.parametrize("stacked_whole", [True, False])
def test_a_referenced_recording_holds_the_model_states_of_its_rows(
    stacked_whole, tiny_model, tokenizer, monkeypatch
):
    """Rows 0 and 2 of three, positions up to the last n, by either copy of the references.

    The forward runs five positions past every row's n (an answer's tokens).
    Stacked whole then selected (a small forward) or each state's rows copied
    into place (`STACK_FIRST_BYTES` passed), the recording equals the model's
    own hidden states there; copied into place it holds exactly
    ``[L+1, 2, max n + 1, d]`` in memory of its own, nothing of the other rows.
    """
    import lm_coupling.capture.recording as recording_module

    if not stacked_whole:
        monkeypatch.setattr(recording_module, "STACK_FIRST_BYTES", 0)
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    (ids, _, last, first, target), rows = _forwards(tokenizer)[0]
    wide = torch.cat([ids, torch.ones(ids.shape[0], 5, dtype=ids.dtype)], dim=1)
    index = torch.tensor(rows)
    with torch.no_grad():
        with runner.record(last[index], first[index], target[index], _docs(0, rows), index) as rec:
            model(wide)
        states = model(wide, output_hidden_states=True).hidden_states
    width, depth = int(last[index].max()) + 1, model.config.n_layer + 1
    assert rec.complete and rec.error is None
    stacked = rec.stacked
    assert stacked.shape == (depth, len(rows), width, model.config.n_embd) and width < wide.shape[1]
    for layer in range(depth - 1):  # the model's last state is after its final norm
        torch.testing.assert_close(stacked[layer], states[layer][index, :width], rtol=0, atol=0)
    if not stacked_whole:
        assert stacked.is_contiguous()
        assert stacked.untyped_storage().nbytes() == stacked.numel() * stacked.element_size()


@pytest.mark.parametrize("rows", [None, [0, 3]])
@pytest.mark.parametrize("whole_rows", [True, False])
def test_both_copies_of_referenced_states_are_equal(rows, whole_rows, monkeypatch):
    """Stacked whole then selected, or each state's rows into place: the same tensor.

    Every row or two of eight; whole rows up to the last n, or the rows at n.
    """
    import lm_coupling.capture.recording as recording_module

    last = [10, 12, 5, 7, 9, 11, 3, 12] if rows is None else [12, 7]
    size = len(last)
    recording = recording_module.Recording(last, [0] * size, [-1] * size, ((),) * size)
    recorder = recording_module.Recorder(recording, 4, rows, whole_rows)
    recorder.width = max(last) + 1
    states = [torch.randn(8, 20, 16) for _ in range(5)]
    copies = []
    for threshold in (2**62, 0):
        monkeypatch.setattr(recording_module, "STACK_FIRST_BYTES", threshold)
        copies.append(recorder._measured_stack(states))
    width = (recorder.width,) if whole_rows else ()
    assert copies[0].shape == copies[1].shape == (5, size, *width, 16)
    assert torch.equal(copies[0], copies[1])
    n = last[-1]  # the last measured row's state x^2 at its n, read from the source
    source = states[2][7 if rows is None else rows[-1], n]
    assert torch.equal(copies[1][2, -1, n] if whole_rows else copies[1][2, -1], source)


def test_a_forward_above_the_reference_budget_is_copied_in_each_hook(
    tiny_model, tokenizer, monkeypatch
):
    import lm_coupling.capture.recording as recording_module

    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    kept: list[bool] = []
    keep = recording_module.Recorder._keep

    def spy(self, hidden):
        kept.append(self.by_reference)
        return keep(self, hidden)

    monkeypatch.setattr(recording_module.Recorder, "_keep", spy)
    small, _ = _record_twice(runner, model, tokenizer, copy_in_hooks=False)
    assert kept and all(kept)  # every state referenced
    kept.clear()
    monkeypatch.setattr(recording_module, "REFERENCE_BYTES", 1024)
    large, _ = _record_twice(runner, model, tokenizer, copy_in_hooks=False)
    assert kept and not any(kept)  # every state copied in its hook
    assert torch.equal(small.stacked, large.stacked)


def test_a_state_written_in_place_is_detected_and_then_copied(tiny_model, tokenizer, monkeypatch):
    """A block that writes its input (x^1) in place: the reference is refused, never used.

    The recording says why and the collector copies each state in its hook
    from then on; that recording's values equal the capture route's, which
    reduces each state as its hook receives it.
    """
    model = tiny_model("gpt2")
    parts = locate_model_parts(model)
    block = parts.blocks[1]
    forward = block.forward

    def writes_its_input(hidden_states, *args, **kwargs):
        hidden_states.mul_(2.0)  # x^1, block 1's output, changed after its hook read it
        return forward(hidden_states, *args, **kwargs)

    monkeypatch.setattr(block, "forward", writes_its_input)  # the shared model is restored
    runner = _runner(model, TRAJ_LENS)
    (ids, kwargs, last, first, target), rows = _forwards(tokenizer)[0]
    index = torch.tensor(rows)
    args = (last[index], first[index], target[index], _docs(0, rows), index)
    with torch.no_grad():
        with runner.record(*args) as refused:
            model(ids, **kwargs)
        assert not refused.complete and "x^1 in place" in refused.error
        assert runner.collector.copy_in_hooks
        with runner.record(*args) as recording:
            model(ids, **kwargs)
        with runner.capture(*args) as handle:
            model(ids, **kwargs)
    assert recording.complete and recording.error is None
    with pytest.raises(ValueError, match="complete recordings"):
        runner.replay([refused])
    _assert_same_documents(runner.compute(runner.replay([recording])), runner.compute(handle))


def test_merging_pads_on_the_right_with_zeros(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    recordings = []
    with torch.no_grad():
        for (ids, kwargs, last, first, target), _ in _forwards(tokenizer)[:2]:
            with runner.record(last, first, target) as recording:
                model(ids, **kwargs)
            recordings.append(recording)
    stack, n_tokens = stack_recordings(recordings, torch.device("cpu"), torch.float32)
    merged = stack.unbind(dim=1)  # each layer's [sum b, T_max, d]
    short, long_ = sorted(recordings, key=lambda r: r.n_tokens)
    assert n_tokens == long_.n_tokens > short.n_tokens
    start = recordings.index(short) * recordings[0].size
    for layer, state in enumerate(merged):
        assert state.shape == (5, n_tokens, model.config.hidden_size)
        rows = state[start : start + short.size]
        torch.testing.assert_close(rows[:, : short.n_tokens], short.states[layer])
        assert not rows[:, short.n_tokens :].any()


def test_replay_and_record_refuse_what_they_cannot_serve(tiny_model, tokenizer):
    model = tiny_model("llama")  # eager attention (demo.tiny builds every model eager)
    runner = _runner(model, TRAJ_LENS)
    (ids, _, last, first, target), _ = _forwards(tokenizer)[0]
    with runner.record(last, first, target) as unfinished:  # no forward ran inside
        pass
    assert not unfinished.complete
    with pytest.raises(ValueError, match="complete recordings"):
        runner.replay([unfinished])
    with pytest.raises(ValueError, match="complete recordings"):
        runner.replay([])
    parts = locate_model_parts(model)
    with pytest.raises(ValueError, match="cannot record"):
        with StateCollector(model, parts, attentions=True).record(last, first, target):
            pass


def _record_and_replay(runner, model, tokenizer, n_forwards: int) -> tuple[int, int]:
    """Host reads of recording one forward, and of replaying ``n_forwards`` recordings."""
    (ids, _, last, first, target), _ = _forwards(tokenizer)[0]
    with torch.no_grad(), HostReads() as recording_reads:
        with runner.record(last, first, target) as recording:
            model(ids)
    with HostReads() as replay_reads:
        runner.compute(runner.replay([recording] * n_forwards))
    return recording_reads.count, replay_reads.count


def test_host_reads_do_not_grow_with_the_pooled_documents(tiny_model, tokenizer):
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    _record_and_replay(runner, model, tokenizer, 1)  # first calls (lazy set-up) untimed
    record_one, replay_one = _record_and_replay(runner, model, tokenizer, 1)
    record_again, replay_many = _record_and_replay(runner, model, tokenizer, 8)
    # Recording reads the batch's few indices once (no read in the hooks); a replay
    # reads each value and profile once, however many forwards it joins.
    assert record_one == record_again <= 4
    assert replay_one == replay_many


def _hook_count(parts) -> int:
    return sum(len(block._forward_hooks) + len(block._forward_pre_hooks) for block in parts.blocks)


def test_standing_hooks_capture_what_is_armed_and_nothing_else(tiny_model, tokenizer):
    """Inside ``standing_hooks`` captures and recordings register no hooks of their own.

    Their values equal those of hooks registered per forward pass; the forward
    passes nobody armed are left alone; on exit every hook is gone.
    """
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    parts = locate_model_parts(model)
    forwards = _forwards(tokenizer)
    per_forward, standing = [], []
    with torch.no_grad():
        for k, ((ids, kwargs, last, first, target), rows) in enumerate(forwards):
            index = torch.tensor(rows)
            args = (last[index], first[index], target[index], _docs(k, rows), index)
            with runner.capture(*args) as handle:
                model(ids, **kwargs)
            per_forward += runner.compute(handle)
        bare = _hook_count(parts)
        with runner.standing_hooks():
            held = _hook_count(parts)
            assert held == bare + 1 + parts.n_layers  # block 1's pre-hook, every block's hook
            recordings = []
            for k, ((ids, kwargs, last, first, target), rows) in enumerate(forwards):
                index = torch.tensor(rows)
                args = (last[index], first[index], target[index], _docs(k, rows), index)
                model(ids, **kwargs)  # nobody armed: nothing is kept
                with runner.record(*args) as recording:
                    model(ids, **kwargs)
                    assert _hook_count(parts) == held
                recordings.append(recording)
                if k == 0:
                    with runner.capture(*args) as handle:
                        with runner.capture(*args) as inner:  # armed already: its own hooks
                            assert _hook_count(parts) == held + 1 + parts.n_layers
                            model(ids, **kwargs)
                    assert handle.states is not None and inner.states is not None
                    _assert_same_documents(runner.compute(handle), per_forward[:2])
            standing = runner.compute(runner.replay(recordings))
        assert _hook_count(parts) == bare
    _assert_same_documents(standing, per_forward)


def test_capture_serves_the_positions_up_to_the_last_measured_one(tiny_model, tokenizer):
    """Positions after every measured row's n are not served; the values do not change."""
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    (ids, _, last, first, target), _ = _forwards(tokenizer)[0]
    rows = torch.tensor([1, 2])  # they end before row 0 does
    assert int(last[rows].max()) + 1 < ids.shape[1]
    with torch.no_grad(), runner.capture(last[rows], first[rows], target[rows], None, rows) as h:
        model(ids)
    assert h.info.n_tokens == int(last[rows].max()) + 1
    assert tuple(h.info.token_mask.shape) == (2, h.info.n_tokens)
    with torch.no_grad(), runner.capture(last[1:], first[1:], target[1:], None, [1, 2]) as whole:
        model(ids[:, : int(last[rows].max()) + 1].contiguous())  # the same positions, cut first
    _assert_same_documents(runner.compute(h), runner.compute(whole))


def test_reducers_finalize_before_the_head_computes_the_logits(tiny_model, tokenizer):
    """The reducers' buffers are freed inside the forward, before the logits [B, T, V] exist."""
    model = tiny_model("gpt2")
    runner = _runner(model, TRAJ_LENS)
    (ids, _, last, first, target), _ = _forwards(tokenizer)[0]
    at_head = []
    with runner.capture(last, first, target) as handle:
        hook = model.lm_head.register_forward_pre_hook(
            lambda module, args: at_head.append((handle.states is not None, set(handle.reduced)))
        )
        try:
            with torch.no_grad():
                model(ids)
        finally:
            hook.remove()
    assert at_head == [(True, set(handle.reduced))] and handle.reduced and not handle.errors


def test_states_of_mixed_dtypes_are_stacked_in_the_promoted_dtype():
    """A hybrid whose one block returns float32 in a bfloat16 model still records (no error)."""
    from lm_coupling.capture.recording import _joinable

    states = [torch.ones(2, 3, 4, dtype=torch.bfloat16), torch.full((2, 3, 4), 0.1)]
    joined = _joinable(states)
    assert [s.dtype for s in joined] == [torch.float32, torch.float32]
    assert torch.equal(joined[1], states[1]) and torch.equal(joined[0], states[0].float())
    same = [torch.ones(2), torch.zeros(2)]
    assert _joinable(same) is same  # nothing converted when nothing differs
