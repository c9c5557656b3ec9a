"""Closed forms, properties and the streaming route of the trajectory metrics."""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling.metrics.trajectory import (
    TrajectoryAccumulator,
    equidistance,
    expodistance,
    line_shape_score,
    masked_token_mean,
    masked_token_means,
    norm_profile,
    trajectory_summaries,
    windowed_line_shape_score,
)

F64 = torch.float64


def _line(lengths, direction=(1.0, 2.0, -2.0), start=(0.5, 0.0, 1.0)):
    """States x^0..x^L along one direction with the given positive step lengths."""
    u = torch.tensor(direction, dtype=F64)
    u = u / u.norm()
    offsets = torch.cumsum(torch.tensor([0.0, *lengths], dtype=F64), 0)
    return torch.tensor(start, dtype=F64) + offsets[:, None] * u


def test_straight_trajectory_has_lss_one():
    x = _line([0.1, 3.0, 0.7, 12.0])
    assert line_shape_score(x).item() == pytest.approx(1.0, abs=1e-12)


def test_back_and_forth_lss_closed_form():
    # Steps +e, -e, +e: 3 unit steps summing to e -> LSS = 3.
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 0.0], [5.0, 0.0]], dtype=F64)
    assert line_shape_score(x).item() == pytest.approx(3.0, abs=1e-12)


def test_zigzag_lss_closed_form():
    # Steps alternate between directions at +45 and -45 degrees, 4 steps:
    # sum of units = 4 cos(45) e_1 = 2 sqrt(2) e_1 -> LSS = 4 / (2 sqrt 2) = sqrt 2.
    steps = torch.tensor([[1.0, 1.0], [3.0, -3.0], [0.5, 0.5], [2.0, -2.0]], dtype=F64)
    x = torch.cat([torch.zeros(1, 2, dtype=F64), torch.cumsum(steps, 0)])
    assert line_shape_score(x).item() == pytest.approx(math.sqrt(2.0), abs=1e-12)


def test_zero_steps_are_skipped_and_not_counted():
    # Steps e1, 0, e2, 0: counted L' = 2, sum = e1 + e2 -> LSS = 2 / sqrt 2.
    x = torch.tensor([[0, 0], [1, 0], [1, 0], [1, 1], [1, 1]], dtype=F64)
    assert line_shape_score(x).item() == pytest.approx(math.sqrt(2.0), abs=1e-12)


def test_degenerate_trajectories_give_nan():
    constant = torch.ones(5, 3, dtype=F64)
    closed = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=F64)
    with_nan = _line([1.0, 1.0, 1.0]).clone()
    with_nan[2, 0] = math.nan
    with_inf = _line([1.0, 1.0, 1.0]).clone()
    with_inf[1, 1] = math.inf
    for x in (constant, closed, with_nan, with_inf):
        assert math.isnan(line_shape_score(x).item())
    assert torch.isnan(windowed_line_shape_score(with_nan, window=3)).any()


def test_windowed_lss_on_straight_line_is_one():
    x = _line([float(i % 4 + 1) for i in range(15)])
    out = windowed_line_shape_score(x)
    assert out.shape == (15,)
    torch.testing.assert_close(out, torch.ones(15, dtype=F64), rtol=0, atol=1e-12)


def test_windowed_lss_clips_window_by_hand():
    # Steps e1, e2, e1, e1 with window 3: depth 1 uses steps 1..2, depth 2 uses 1..3,
    # depth 3 uses 2..4, depth 4 uses 3..4.
    steps = torch.tensor([[1, 0], [0, 1], [1, 0], [1, 0]], dtype=F64)
    x = torch.cat([torch.zeros(1, 2, dtype=F64), torch.cumsum(steps, 0)])
    expected = torch.tensor([2 / math.sqrt(2), 3 / math.sqrt(5), 3 / math.sqrt(5), 1.0], dtype=F64)
    torch.testing.assert_close(windowed_line_shape_score(x, window=3), expected)
    # A window covering every step equals the whole-trajectory LSS at every depth.
    whole = windowed_line_shape_score(x, window=9)
    torch.testing.assert_close(whole, line_shape_score(x).expand(4))


def test_window_must_be_odd_positive():
    x = _line([1.0, 1.0])
    for bad in (0, 4, -3, 2.0):
        with pytest.raises(ValueError, match="window"):
            windowed_line_shape_score(x, window=bad)


def test_exact_geometric_growth_has_expodistance_zero():
    norms = 0.3 * 1.7 ** torch.arange(9, dtype=F64)
    assert expodistance(norms).item() == pytest.approx(0.0, abs=1e-12)


def test_expodistance_by_hand():
    # a = (ln 2, ln 4) = (ln 2, 2 ln 2): mean 1.5 ln2, var 0.25 (ln2)^2 -> 1/9.
    a = [math.log(2.0), math.log(4.0)]
    mean = sum(a) / 2
    var = sum((v - mean) ** 2 for v in a) / 2
    out = expodistance(torch.tensor([1.0, 2.0, 8.0], dtype=F64))
    assert out.item() == pytest.approx(var / mean**2, rel=1e-12)
    assert out.item() == pytest.approx(1 / 9, rel=1e-12)


def test_expodistance_degenerate_gives_nan():
    cases = [
        [1.0, 0.0, 2.0],  # zero norm
        [1.0, math.nan, 2.0],
        [1.0, math.inf, 2.0],
        [1.0, 2.0, 1.0],  # mean log growth 0
    ]
    out = expodistance(torch.tensor(cases, dtype=F64))
    assert torch.isnan(out).all()


def test_equidistance_closed_forms():
    assert equidistance(torch.full((6,), 2.5, dtype=F64)).item() == pytest.approx(0.0, abs=1e-15)
    # lengths 1, 3: mean 2, population std 1 -> 0.5.
    assert equidistance(torch.tensor([1.0, 3.0], dtype=F64)).item() == pytest.approx(0.5)
    bad = equidistance(torch.tensor([[0.0, 0.0], [1.0, math.nan]], dtype=F64))
    assert torch.isnan(bad).all()


def test_norm_profile_and_dtypes():
    x = torch.tensor([[3.0, 4.0], [0.0, 1.0]], dtype=torch.bfloat16)
    out = norm_profile(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([5.0, 1.0]))
    assert norm_profile(x.to(F64)).dtype == F64
    assert line_shape_score(x).dtype == torch.float32


def test_shape_errors_name_the_shape():
    with pytest.raises(ValueError, match=r"\[\.\.\., L\+1, d\]"):
        line_shape_score(torch.zeros(1, 3))


@pytest.mark.parametrize(
    ("B", "T", "L", "d", "windowed", "window"),
    [
        (2, 3, 5, 4, True, 11),
        (1, 1, 1, 3, True, 11),
        (3, 2, 17, 6, True, 11),
        (2, 4, 12, 5, True, 3),
        (2, 2, 7, 3, False, 11),
        (1, 3, 9, 4, True, 1),
    ],
)
@pytest.mark.parametrize("route", ["streamed", "stacked"])
def test_accumulator_equals_dense(B, T, L, d, windowed, window, route):
    gen = torch.Generator().manual_seed(B * 100 + L)
    states = [torch.randn(B, T, d, generator=gen, dtype=F64) for _ in range(L + 1)]
    states[2 % (L + 1)][0, 0] = states[1 % (L + 1)][0, 0]  # one zero step
    if route == "streamed":
        acc = TrajectoryAccumulator(windowed=windowed, window=window)
    else:
        acc = TrajectoryAccumulator(windowed=windowed, window=window, n_layers=L)
    for state in states:
        acc.update(state)
    assert acc.holds_stack == (route != "streamed")
    out = acc.finalize()
    stack = torch.stack(states, dim=2)  # [B, T, L+1, d]
    torch.testing.assert_close(out["norms"], norm_profile(stack).transpose(1, 2))
    lengths = (stack[:, :, 1:] - stack[:, :, :-1]).norm(dim=-1).transpose(1, 2)
    torch.testing.assert_close(out["step_lengths"], lengths)
    torch.testing.assert_close(out["lss"], line_shape_score(stack), equal_nan=True)
    if windowed:
        dense = windowed_line_shape_score(stack, window=window).transpose(1, 2)
        torch.testing.assert_close(out["windowed_lss"], dense, equal_nan=True)
    else:
        assert out["windowed_lss"] is None
    assert acc.n_states == 0  # finalize resets


def test_stack_budget_chooses_the_route_and_both_agree():
    """Over ``stack_bytes`` the states stream; under it they are held; the values agree."""
    gen = torch.Generator().manual_seed(3)
    states = [torch.randn(2, 5, 8, generator=gen) for _ in range(7)]  # L = 6, float32
    stack = 7 * 2 * 5 * 8 * 4  # bytes of the [B, L+1, T, d] stack
    outs = {}
    for budget in (stack - 1, stack):
        acc = TrajectoryAccumulator(n_layers=6, stack_bytes=budget)
        for state in states:
            acc.update(state)
        held = acc.holds_stack
        outs[held] = acc.finalize()
    assert set(outs) == {False, True}
    for key, value in outs[False].items():
        torch.testing.assert_close(outs[True][key], value, equal_nan=True)


def test_held_states_do_not_alias_the_callers_tensors():
    """A state changed in place after ``update`` does not change the held stack's values."""
    states = [torch.full((1, 1, 2), float(i * i)) for i in range(4)]
    states[1][0, 0, 1] = 5.0
    expected = trajectory_summaries([state.clone() for state in states])
    held = TrajectoryAccumulator(n_layers=3)
    for state in states:
        held.update(state)
        state.zero_()  # what a model writing into its buffer would do
    out = held.finalize()
    for key, value in expected.items():
        torch.testing.assert_close(out[key], value, equal_nan=True)


def test_stacked_route_refuses_more_states_than_layers():
    acc = TrajectoryAccumulator(n_layers=2)
    for _ in range(3):
        acc.update(torch.randn(1, 2, 3))
    with pytest.raises(ValueError, match="n_layers=2"):
        acc.update(torch.randn(1, 2, 3))


def test_window_sums_keep_exact_cancellation():
    """Unit steps +e, -e around depth 2 with window 3: steps 1..3 sum to e, LSS 3 exactly."""
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [4.0, 0.0]], dtype=F64)
    out = trajectory_summaries([row[None, None] for row in x], window=3)
    windowed = out["windowed_lss"][0, :, 0]  # depths 1, 2, 3: steps 1-2, 1-3, 2-3
    assert math.isnan(windowed[0]) and windowed[1].item() == 3.0 and math.isnan(windowed[2])
    dense = windowed_line_shape_score(x, window=3)
    torch.testing.assert_close(out["windowed_lss"][0, :, 0], dense, equal_nan=True)
    assert out["lss"].item() == 3.0


@pytest.mark.parametrize("n_layers", [5, 6, 7])
def test_windows_covering_every_step_give_the_lss_at_every_depth(n_layers):
    """With h >= L - 1 each window [l - h, l + h] is all L steps: the LSS itself, exactly."""
    gen = torch.Generator().manual_seed(n_layers)
    states = [torch.randn(2, 3, 4, generator=gen) for _ in range(n_layers + 1)]
    out = trajectory_summaries(states, window=11)  # h = 5
    stack = torch.stack(states, dim=2)
    dense = windowed_line_shape_score(stack, window=11).transpose(1, 2)
    torch.testing.assert_close(out["windowed_lss"], dense)
    whole = torch.equal(out["windowed_lss"], out["lss"][:, None, :].expand_as(dense))
    assert whole == (n_layers <= 6)  # L = 7: the first and last windows leave a step out


def test_masked_token_means_equal_row_by_row_means():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(3, 4, 6, generator=gen)
    values[0, 1, 2] = math.nan
    values[2, :, :] = math.nan
    mask = torch.rand(3, 6, generator=gen) > 0.3
    out = masked_token_means(values, mask)
    for k in range(4):
        torch.testing.assert_close(out[:, k], masked_token_mean(values[:, k], mask), equal_nan=True)
    assert torch.isnan(out[2]).all()
    with pytest.raises(ValueError, match=r"\[B, K, T\]"):
        masked_token_means(values, mask[:, :2])


def test_accumulator_float32_and_nan_tokens():
    gen = torch.Generator().manual_seed(0)
    states = [torch.randn(2, 3, 4, generator=gen).to(torch.float16) for _ in range(6)]
    states[3][1, 2, 0] = math.nan
    acc = TrajectoryAccumulator(window=3)
    for state in states:
        acc.update(state)
    out = acc.finalize()
    assert out["lss"].dtype == torch.float32
    assert math.isnan(out["lss"][1, 2].item())
    assert torch.isfinite(out["lss"][0]).all()
    # Window 3 around depth l uses steps l-1..l+1; steps 3 and 4 touch x^3.
    nan_depths = torch.isnan(out["windowed_lss"][1, :, 2]).nonzero().flatten().tolist()
    assert nan_depths == [1, 2, 3, 4]  # depths 2..5 (1-based)


def test_accumulator_memory_is_bounded():
    acc = TrajectoryAccumulator(window=5)
    for _ in range(30):
        acc.update(torch.randn(1, 2, 3))
    assert len(acc._ring) == 5
    assert acc.finalize()["windowed_lss"].shape == (1, 30 - 1, 2)


def test_accumulator_errors():
    acc = TrajectoryAccumulator()
    acc.update(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="at least two states"):
        acc.finalize()
    with pytest.raises(ValueError, match="shape changed"):
        acc.update(torch.zeros(1, 3, 3))


def test_masked_token_mean_ignores_masked_and_nan():
    values = torch.tensor([[1.0, 100.0, math.nan, 3.0], [math.nan, 5.0, 7.0, 9.0]])
    mask = torch.tensor([[True, False, True, True], [True, False, False, False]])
    out = masked_token_mean(values, mask)
    assert out[0].item() == pytest.approx(2.0)
    assert math.isnan(out[1].item())
    with pytest.raises(ValueError, match="shape"):
        masked_token_mean(values, mask[:, :2])
