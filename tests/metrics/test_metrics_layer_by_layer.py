"""Closed forms and invariances of Layer by Layer's measures (prompt entropy, curvature, ...)."""

from __future__ import annotations

import math

import pytest
import torch

from lm_coupling.metrics.layer_by_layer import (
    DatasetGram,
    curvature,
    effective_rank,
    pool_tokens,
    prompt_entropy,
    spectrum_entropy,
    standardize_tokens,
)


def _orthonormal(T: int, d: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, T, generator=gen, dtype=torch.float64))
    return scale * q.T  # [T, d] orthonormal rows


@pytest.mark.parametrize("alpha", [1.0, 2.0, 0.5])
def test_orthonormal_tokens_give_ln_t_and_rank_t(alpha):
    T, d = 5, 12
    z = _orthonormal(T, d, scale=3.0)[None]
    torch.testing.assert_close(
        prompt_entropy(z, alpha=alpha), torch.tensor([math.log(T)], dtype=torch.float64)
    )
    torch.testing.assert_close(effective_rank(z), torch.tensor([float(T)], dtype=torch.float64))


def test_more_tokens_than_width_uses_the_small_gram():
    # T > d: the d x d second moment is decomposed; d orthonormal directions, T = 2d tokens.
    d = 6
    base = _orthonormal(d, d)
    z = torch.cat([base, base])[None]  # each direction twice: Gram eigenvalues all 2
    torch.testing.assert_close(prompt_entropy(z), torch.tensor([math.log(d)], dtype=torch.float64))
    torch.testing.assert_close(effective_rank(z), torch.tensor([float(d)], dtype=torch.float64))


@pytest.mark.parametrize("seed", range(20))
def test_collinear_tokens_give_zero_entropy_and_rank_one(seed):
    # Without the round-off tolerance before the square root, about a third of
    # these seeds gave an effective rank of 1 + 3e-7.
    v = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    z = torch.stack([v, -2 * v, 0.5 * v])[None]
    assert abs(prompt_entropy(z).item()) < 1e-12
    torch.testing.assert_close(effective_rank(z), torch.ones(1, dtype=torch.float64))


def test_entropy_against_direct_eigen_formula():
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, 7, 5, generator=gen, dtype=torch.float64)
    for alpha in (1.0, 3.0):
        for b in range(2):
            lam = torch.linalg.svdvals(z[b]) ** 2
            p = lam / lam.sum()
            if alpha == 1.0:
                expected = -(p * p.log()).sum()
            else:
                expected = torch.log((p**alpha).sum()) / (1 - alpha)
            torch.testing.assert_close(prompt_entropy(z, alpha=alpha)[b], expected)
        s = torch.linalg.svdvals(z[1])
        q = s / s.sum()
        torch.testing.assert_close(effective_rank(z)[1], torch.exp(-(q * q.log()).sum()))


def test_normalized_entropy_divides_by_log_min_t_d():
    z = _orthonormal(4, 9)[None]
    torch.testing.assert_close(
        prompt_entropy(z, normalized=True), torch.ones(1, dtype=torch.float64)
    )


def test_mask_and_padding_invariance():
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(6, 10, generator=gen)
    padded = torch.cat([torch.full((3, 10), 7.0), z])[None]  # left padding with junk
    mask = torch.tensor([[False] * 3 + [True] * 6])
    for fn in (prompt_entropy, effective_rank, curvature):
        torch.testing.assert_close(fn(padded, mask), fn(z[None]))
    batch = torch.stack([torch.cat([z, torch.zeros(3, 10)]), padded[0]])
    batch_mask = torch.tensor([[True] * 6 + [False] * 3, mask[0].tolist()])
    for fn in (prompt_entropy, effective_rank, curvature):
        out = fn(batch, batch_mask)
        torch.testing.assert_close(out[0], out[1])


def test_straight_trajectory_has_zero_curvature():
    direction = torch.randn(16, dtype=torch.float64)
    t = torch.tensor([0.0, 0.5, 2.0, 2.1, 5.0], dtype=torch.float64)  # uneven steps, one direction
    z = (3.0 + t[:, None] * direction)[None]
    assert curvature(z).item() < 1e-12
    # In float32 the states themselves are rounded: each step's direction is off by up
    # to about eps32 * |z| / |step| radians, whatever the arithmetic after that.
    steps = torch.linalg.vector_norm(z[0].diff(dim=0), dim=-1)
    bound = 4 * torch.finfo(torch.float32).eps * z.abs().max() * 4 / steps.min()
    assert curvature(z.float()).item() < bound.item()


def test_curvature_closed_forms():
    e = torch.eye(4, dtype=torch.float64)
    # Steps e0, e1, e0, e1: right angles everywhere.
    z = torch.cumsum(torch.stack([torch.zeros(4, dtype=torch.float64), e[0], e[1], e[0], e[1]]), 0)
    torch.testing.assert_close(curvature(z[None]), torch.tensor([math.pi / 2], dtype=torch.float64))
    # Back and forth: every angle pi; the authors' |cos| folds it to 0.
    zz = torch.stack([e[0] * k for k in (0, 1, 0, 1)])[None]
    torch.testing.assert_close(curvature(zz), torch.tensor([math.pi], dtype=torch.float64))
    assert curvature(zz, absolute=True).item() < 1e-12
    # 60 degrees then 120 degrees: mean pi/2; absolute folds 120 to 60.
    steps = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(3) / 2], [-1.0, 0.0]], dtype=torch.float64)
    zs = torch.cat([torch.zeros(1, 2, dtype=torch.float64), steps.cumsum(0)])[None]
    torch.testing.assert_close(curvature(zs), torch.tensor([math.pi / 2], dtype=torch.float64))
    torch.testing.assert_close(
        curvature(zs, absolute=True), torch.tensor([math.pi / 3], dtype=torch.float64)
    )


def test_curvature_skips_zero_steps_and_needs_three_tokens():
    e = torch.eye(3, dtype=torch.float64)
    # Steps e0, 0, e1, e1: only the pair (e1, e1) has an angle: 0.
    z = torch.stack([0 * e[0], e[0], e[0], e[0] + e[1], e[0] + 2 * e[1]])[None]
    assert curvature(z).item() < 1e-12
    assert math.isnan(curvature(z[:, :2]).item())
    flat = torch.ones(1, 4, 3)
    assert math.isnan(curvature(flat).item())


def test_degenerate_documents_are_nan():
    z = torch.randn(2, 4, 6)
    z[1, 2, 0] = math.nan
    mask = torch.ones(2, 4, dtype=torch.bool)
    for fn in (prompt_entropy, effective_rank, curvature):
        out = fn(z, mask)
        assert math.isfinite(out[0].item()) and math.isnan(out[1].item())
    assert math.isnan(prompt_entropy(torch.zeros(1, 3, 4)).item())
    assert math.isnan(effective_rank(z, torch.zeros(2, 4, dtype=torch.bool))[0].item())


def test_standardize_tokens_centres_and_scales():
    gen = torch.Generator().manual_seed(8)
    z = torch.randn(1, 5, 7, generator=gen, dtype=torch.float64)
    s = standardize_tokens(z)
    torch.testing.assert_close(s.norm(dim=-1), torch.ones(1, 5, dtype=torch.float64))
    centred = z - z.mean(dim=1, keepdim=True)
    torch.testing.assert_close(s, centred / centred.norm(dim=-1, keepdim=True))


def test_pool_tokens_mean_and_last():
    z = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    mask = torch.tensor([[False, True, True], [True, True, False]])
    torch.testing.assert_close(pool_tokens(z, mask)[0], z[0, 1:].mean(0))
    torch.testing.assert_close(pool_tokens(z, mask, "last")[1], z[1, 1])
    with pytest.raises(ValueError, match="pooling"):
        pool_tokens(z, mask, "max")


def test_dataset_entropy_identical_and_orthonormal_documents():
    n_states, d = 3, 10
    v = torch.randn(n_states, d, dtype=torch.float64)
    same = DatasetGram(n_states, d)
    same.update(v.expand(4, -1, -1))
    assert same.entropy().abs().max().item() < 1e-12
    ortho = DatasetGram(n_states, d)
    rows = _orthonormal(6, d)  # six orthonormal documents, same at every state
    ortho.update(rows[:, None, :].expand(-1, n_states, -1) * 2.0)
    torch.testing.assert_close(
        ortho.entropy(), torch.full((n_states,), math.log(6), dtype=torch.float64)
    )


def test_dataset_gram_folds_past_d_and_merges():
    gen = torch.Generator().manual_seed(11)
    pooled = torch.randn(9, 2, 4, generator=gen, dtype=torch.float64)  # N = 9 > d = 4
    whole = DatasetGram(2, 4)
    whole.update(pooled)
    assert whole._moment is not None and whole.count == 9
    z = pooled.transpose(0, 1)
    lam = torch.linalg.eigvalsh(z @ z.transpose(1, 2)).clamp(min=0)  # [2, 9]
    p = lam / lam.sum(-1, keepdim=True)
    expected = -torch.log((p**2).sum(-1))  # the alpha = 2 entropy ln sum p^2 / (1 - 2)
    torch.testing.assert_close(whole.entropy(2.0), expected)
    a, b = DatasetGram(2, 4), DatasetGram(2, 4)
    a.update(pooled[:2])  # rows kept
    b.update(pooled[2:])  # folded
    a.merge(b)
    torch.testing.assert_close(a.entropy(2.0), expected)
    c = DatasetGram(2, 4)
    c.update(pooled[:3])
    c.merge(a)  # rows into a folded one
    assert c.count == 12


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match=r"\[B, T, d\]"):
        prompt_entropy(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="mask"):
        curvature(torch.zeros(1, 3, 4), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="alpha"):
        spectrum_entropy(torch.ones(3), alpha=0)
    with pytest.raises(ValueError, match="finite"):
        DatasetGram(1, 2).update(torch.full((1, 1, 2), math.nan))
