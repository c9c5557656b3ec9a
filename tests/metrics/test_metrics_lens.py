"""Closed forms and references for the logit-lens quantities."""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling.metrics.lens import (
    fixation_depth,
    lens_summary,
    tv_to_target,
)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """The lens entropy of ``[B, L+1, V]`` logits, no target."""
    return lens_summary(logits, torch.full((logits.shape[0],), -1), top1=False)[0]


def _direct_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``-sum_v P ln P / ln V`` written out (``0 ln 0 = 0``)."""
    p = torch.softmax(logits, -1)
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    return -plogp.sum(-1) / math.log(logits.shape[-1])


def test_uniform_logits_have_entropy_one():
    logits = torch.full((2, 4, 50), 3.0)
    torch.testing.assert_close(_entropy(logits), torch.ones(2, 4))


def test_one_hot_logits_have_entropy_near_zero():
    logits = torch.zeros(3, 1, 1000, dtype=torch.float64)
    logits[..., 7] = 60.0
    out = _entropy(logits)
    assert out.dtype == torch.float64
    assert (out >= 0).all() and (out < 1e-20).all()


def test_entropy_matches_direct_formula_and_handles_minus_inf():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 1, 30, generator=gen, dtype=torch.float64)
    logits[0, 0, :10] = -math.inf
    torch.testing.assert_close(_entropy(logits), _direct_entropy(logits))


def test_lens_summary_against_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=gen).to(torch.bfloat16)
    target = torch.tensor([4, -1, 39])
    entropy, prob, top1 = lens_summary(logits, target)
    full = logits.float()
    p = torch.softmax(full, -1)
    torch.testing.assert_close(entropy, _direct_entropy(full))
    torch.testing.assert_close(prob[0], p[0, :, 4])
    torch.testing.assert_close(prob[2], p[2, :, 39])
    assert torch.isnan(prob[1]).all()
    assert torch.equal(top1, full.argmax(-1))
    assert entropy.dtype == prob.dtype == torch.float32 and top1.dtype == torch.int64


def test_undefined_rows_are_nan_and_the_others_untouched():
    # NaN logits, a row entirely -inf and a +inf logit have no distribution: NaN
    # entropy and target probability; the row beside them keeps its exact values.
    logits = torch.randn(4, 1, 16, dtype=torch.float64)
    logits[0, 0, 3] = math.nan
    logits[1, 0] = -math.inf
    logits[2, 0, 5] = math.inf
    entropy, prob, _ = lens_summary(logits, torch.tensor([1, 1, 1, 1]))
    assert torch.isnan(entropy[:3]).all() and torch.isnan(prob[:3]).all()
    p = torch.softmax(logits[3, 0], -1)
    torch.testing.assert_close(entropy[3, 0], -(p * p.log()).sum() / math.log(16))
    torch.testing.assert_close(prob[3, 0], p[1])


def test_lens_summary_rejects_bad_target():
    logits = torch.zeros(2, 3, 10)
    with pytest.raises(ValueError, match="target ids"):
        lens_summary(logits, torch.tensor([10, 0]))
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        lens_summary(logits, torch.tensor([1, 2, 3]))


def test_tv_to_target_is_total_variation_to_one_hot():
    p = torch.softmax(torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64), -1)
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    tv = 0.5 * (p - one_hot).abs().sum()
    torch.testing.assert_close(tv_to_target(p[2]), tv)
    assert math.isnan(tv_to_target(torch.tensor(math.nan)).item())


@pytest.mark.parametrize(
    ("sequence", "expected"),
    [
        ([5, 5, 5, 5, 5], 0.0),  # constant
        ([1, 2, 3, 4, 5], 1.0),  # settles only at the last layer
        ([1, 5, 5, 5, 5], 0.25),
        ([5, 2, 5, 5, 5], 0.5),  # returns to 5 after a change
        ([3, 3, 7, 7, 9], 1.0),
        ([1, 9], 1.0),
    ],
)
def test_fixation_depth_hand_made(sequence, expected):
    top1 = torch.tensor([sequence])
    assert fixation_depth(top1).item() == pytest.approx(expected)


def test_fixation_depth_batched():
    top1 = torch.tensor([[1, 1, 2], [2, 2, 2], [0, 1, 1]])
    torch.testing.assert_close(fixation_depth(top1), torch.tensor([1.0, 0.0, 0.5]))
