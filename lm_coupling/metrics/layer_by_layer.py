"""Layer by Layer's representation measures of one layer's token states.

Skean, Arefin, Zhao, Patel, Naghiyev, LeCun, Shwartz-Ziv, "Layer by Layer:
Uncovering Hidden Representations in Language Models" (ICML 2025; code:
OFSkean/information_flow) score each layer with measures of its token states
``Z in R^{T x d}`` (rows: the measured tokens of one document at that layer):

* prompt entropy, the matrix-based alpha-entropy of the trace-normalised Gram
  matrix ``K = Z Z^T`` (Renyi's entropy of its eigenvalues);
* curvature, the mean angle between consecutive differences of token states
  along the sequence;
* effective rank (Roy and Vetterli, 2007; not in the authors' code, added
  here), ``exp`` of the Shannon entropy of the normalised singular values of ``Z``;
* dataset entropy, the alpha-entropy of the Gram matrix of one pooled vector
  per document, over a task's documents (:class:`DatasetGram`).

Every function takes one layer's states ``[B, T, d]`` and a mask ``[B, T]`` of
the measured tokens (padding and unmeasured positions False), so a caller can
reduce the layers one at a time. The spectra are computed in float64 from the
states cast to float64 (the Gram matrices square the states' dynamic range);
the returned values are float32, or float64 when the states are float64.

Conventions the paper leaves open, and departures from the authors' code, are
named in each docstring and in docs/metrics.md. The formulas act on the states
as given; :func:`standardize_tokens` is the preprocessing the authors' code
applies first (centre over tokens, unit-norm rows), offered as an option.
"""

from __future__ import annotations

import math

import torch

from lm_coupling.metrics import work_dtype

__all__ = [
    "DatasetGram",
    "curvature",
    "effective_rank",
    "effective_rank_from_eigenvalues",
    "gram_eigenvalues",
    "normalize_entropy",
    "pool_tokens",
    "prompt_entropy",
    "spectrum_entropy",
    "standardize_tokens",
]


def _check_states(states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Validate ``[B, T, d]`` states and return the boolean mask ``[B, T]``."""
    if not isinstance(states, torch.Tensor) or not states.is_floating_point():
        raise TypeError("states must be a floating-point torch.Tensor of shape [B, T, d]")
    if states.dim() != 3:
        raise ValueError(f"states must have shape [B, T, d], found {tuple(states.shape)}")
    if mask is None:
        return torch.ones(states.shape[:2], dtype=torch.bool, device=states.device)
    if mask.shape != states.shape[:2]:
        raise ValueError(
            f"mask must have shape [B, T] = {list(states.shape[:2])}, found {tuple(mask.shape)}"
        )
    return mask.to(device=states.device, dtype=torch.bool)


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not alpha > 0 or math.isinf(alpha):
        raise ValueError(f"alpha must be a finite number > 0 (1 = von Neumann), found {alpha}")
    return alpha


def spectrum_entropy(eigenvalues: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Renyi alpha-entropy, in nats, of a nonnegative spectrum normalised to sum 1.

    ``p_i = lambda_i / sum_j lambda_j``;
    ``S_alpha = ln(sum_i p_i^alpha) / (1 - alpha)`` for alpha != 1 and
    ``S_1 = -sum_i p_i ln p_i`` (the von Neumann entropy of the trace-normalised
    matrix, the limit alpha -> 1). ``0 <= S_alpha <= ln(k)`` with k the number of
    nonzero eigenvalues; ``ln k`` when they are equal.

    Round-off: eigenvalues below ``k_total * eps(float64) * max_i lambda_i``
    (negative ones included) are taken as exact zeros, the usual numerical-rank
    tolerance, so that for alpha < 1 round-off does not count as mass.

    Reference: Renyi (1961); Sanchez Giraldo, Rao, Principe, "Measures of
    entropy from data using infinitely divisible kernels" (IEEE Trans. Inf.
    Theory, 2015), the matrix-based entropy; Skean et al. (ICML 2025), eq. 1.

    Args:
        eigenvalues: ``[..., k]`` eigenvalues of a positive semi-definite matrix.
        alpha: the order, > 0 (1 by default).

    Returns:
        ``[...]`` float64; NaN where the spectrum is all zero or not finite.
    """
    alpha = _check_alpha(alpha)
    lam = _round_off_to_zero(eigenvalues)
    total = lam.sum(dim=-1, keepdim=True)
    p = lam / total
    if alpha == 1.0:
        out = torch.special.entr(p).sum(dim=-1)
    else:
        powered = torch.where(p > 0, p.clamp(min=0) ** alpha, torch.zeros_like(p))
        out = torch.log(powered.sum(dim=-1)) / (1.0 - alpha)
    bad = ~(total.squeeze(-1) > 0) | ~torch.isfinite(eigenvalues.to(torch.float64)).all(dim=-1)
    return torch.where(bad, torch.full_like(out, math.nan), out)


def _round_off_to_zero(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Float64 eigenvalues, those below ``k * eps * max_i lambda_i`` (negatives too) set to 0."""
    lam = eigenvalues.to(torch.float64)
    tol = lam.shape[-1] * torch.finfo(torch.float64).eps * lam.amax(dim=-1, keepdim=True)
    return torch.where(lam > tol, lam, torch.zeros_like(lam))


def gram_eigenvalues(states: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Eigenvalues of the Gram matrix ``Z Z^T`` of each document's measured token states.

    ``Z`` holds the measured rows of ``states[b]`` (unmeasured rows are set to
    zero, which adds only zero eigenvalues). ``Z Z^T`` (T x T) and ``Z^T Z``
    (d x d) share their nonzero eigenvalues, the squared singular values of
    ``Z``; the smaller of the two is decomposed.

    Args:
        states: ``[B, T, d]`` one layer's token states.
        mask: ``[B, T]`` bool, True on measured tokens (None: all).

    Returns:
        ``[B, min(T, d)]`` float64 eigenvalues, ascending; a document with a
        non-finite measured state gets NaN eigenvalues.
    """
    mask = _check_states(states, mask)
    z = torch.where(mask[..., None], states.to(torch.float64), torch.zeros((), dtype=torch.float64))
    finite = torch.isfinite(z).all(dim=-1).all(dim=-1)
    z = torch.where(finite[:, None, None], z, torch.zeros_like(z))
    T, d = z.shape[1], z.shape[2]
    gram = z @ z.transpose(1, 2) if T <= d else z.transpose(1, 2) @ z
    lam = torch.linalg.eigvalsh(gram)
    return torch.where(finite[:, None], lam, torch.full_like(lam, math.nan))


def prompt_entropy(
    states: torch.Tensor,
    mask: torch.Tensor | None = None,
    alpha: float = 1.0,
    normalized: bool = False,
) -> torch.Tensor:
    """Prompt entropy: the alpha-entropy of the trace-normalised Gram matrix of a document's tokens.

    ``K = Z Z^T`` (T x T, ``Z`` the document's measured token states at one
    layer), ``S_alpha(Z) = ln(sum_i (lambda_i(K) / tr K)^alpha) / (1 - alpha)``,
    von Neumann (Shannon of the eigenvalues) at alpha = 1. Orthonormal token
    states give ``ln T``; identical (or collinear) ones give 0.

    Reference: Skean et al., "Layer by Layer" (ICML 2025), Section 3.1, eq. 1
    (prompt entropy). Departures from the authors' code, named: their code
    first centres the tokens and scales each to unit norm
    (:func:`standardize_tokens`, an option here), clamps negative Gram entries
    to zero (not in the paper; not done here), and reports the entropy divided
    by ``ln min(T, d)`` in its figures (``normalized=True`` here).

    Args:
        states: ``[B, T, d]`` one layer's token states.
        mask: ``[B, T]`` bool, True on the measured tokens (None: all).
        alpha: the order, > 0.
        normalized: divide by ``ln min(T_b, d)``, the largest possible value
            (NaN when ``min(T_b, d) = 1``).

    Returns:
        ``[B]`` entropy in nats (float32; float64 for float64 states). NaN for
        a document with no measured token, all-zero or non-finite states.
    """
    mask = _check_states(states, mask)
    out = spectrum_entropy(gram_eigenvalues(states, mask), alpha)
    if normalized:
        out = normalize_entropy(out, mask.sum(dim=1), states.shape[-1])
    return out.to(work_dtype(states))


def normalize_entropy(entropy: torch.Tensor, n_tokens: torch.Tensor, d: int) -> torch.Tensor:
    """``entropy / ln min(T_b, d)``: the prompt entropy over its largest possible value.

    Args:
        entropy: ``[B]`` prompt entropies in nats.
        n_tokens: ``[B]`` measured tokens per document.
        d: the width.

    Returns:
        ``[B]`` float64; NaN where ``min(T_b, d) <= 1``.
    """
    size = n_tokens.to(device=entropy.device).clamp(max=d).to(torch.float64)
    out = entropy.to(torch.float64) / torch.log(size)
    return torch.where(size > 1, out, torch.full_like(out, math.nan))


def effective_rank(states: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Effective rank of a document's token states at one layer.

    ``erank(Z) = exp(-sum_i p_i ln p_i)``, ``p_i = sigma_i / sum_j sigma_j``
    with ``sigma_i`` the singular values of ``Z`` (T x d, the measured token
    states). Between 1 (rank one) and ``rank(Z)``; ``T`` for orthonormal token
    states. It uses the singular values, not their squares: ``exp`` of the
    alpha = 1 prompt entropy (eigenvalues of ``Z Z^T`` = ``sigma_i^2``) is a
    different number.

    Reference: Roy and Vetterli, "The effective rank: a measure of effective
    dimensionality" (EUSIPCO 2007), Definition 1. Not one of Skean et al.'s
    measures (their released code has no effective rank): added here beside
    them.

    Args:
        states: ``[B, T, d]`` one layer's token states.
        mask: ``[B, T]`` bool, True on the measured tokens (None: all).

    Returns:
        ``[B]`` float32 (float64 for float64 states); NaN for a document with
        no measured token, all-zero or non-finite states.
    """
    mask = _check_states(states, mask)
    return effective_rank_from_eigenvalues(gram_eigenvalues(states, mask)).to(work_dtype(states))


def effective_rank_from_eigenvalues(eigenvalues: torch.Tensor) -> torch.Tensor:
    """:func:`effective_rank` from the Gram eigenvalues ``sigma_i^2`` (:func:`gram_eigenvalues`).

    Round-off: eigenvalues below ``k * eps(float64) * max_i lambda_i`` are
    taken as exact zeros before the square root, the tolerance
    :func:`spectrum_entropy` uses. Applied after it, the square root would
    lift an eigenvalue's round-off of ``eps`` to ``sqrt(eps)`` in ``sigma``,
    and a rank-one document would get ``1 + 3e-7``, not 1.

    Args:
        eigenvalues: ``[..., k]`` eigenvalues of ``Z Z^T``.

    Returns:
        ``[...]`` float64 ``exp(H(sigma / sum sigma))``; NaN as :func:`spectrum_entropy`.
    """
    sigma = _round_off_to_zero(eigenvalues).sqrt()
    sigma = torch.where(torch.isnan(eigenvalues), eigenvalues.to(torch.float64), sigma)
    return spectrum_entropy(sigma, 1.0).exp()


def _compact(states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each document's measured tokens to the front, in order: ``([B, T, d], count [B])``."""
    T = mask.shape[1]
    position = torch.arange(T, device=mask.device).expand_as(mask)
    key = torch.where(mask, position, position + T)
    order = key.argsort(dim=1)
    z = states.gather(1, order[..., None].expand_as(states))
    return z, mask.sum(dim=1)


def _angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Angle between rows of ``a`` and ``b`` (``[..., d]``), Kahan's stable form.

    ``2 atan2(|| a/|a| - b/|b| ||, || a/|a| + b/|b| ||)``: exact to round-off at
    0 and pi, where ``arccos`` of the cosine loses half the digits.
    """
    ua = a / torch.linalg.vector_norm(a, dim=-1, keepdim=True)
    ub = b / torch.linalg.vector_norm(b, dim=-1, keepdim=True)
    diff = torch.linalg.vector_norm(ua - ub, dim=-1)
    summ = torch.linalg.vector_norm(ua + ub, dim=-1)
    return 2 * torch.atan2(diff, summ)


def curvature(
    states: torch.Tensor,
    mask: torch.Tensor | None = None,
    absolute: bool = False,
    zero_steps: str = "skip",
) -> torch.Tensor:
    """Curvature: the mean angle between consecutive differences of token states along the sequence.

    With ``z_1, ..., z_T`` a document's measured token states at one layer in
    sequence order, ``v_k = z_{k+1} - z_k`` and
    ``C = (1 / (T - 2)) sum_{k=1}^{T-2} arccos(v_{k+1}^T v_k / (||v_{k+1}|| ||v_k||))``
    in radians, in [0, pi]: 0 for states on a straight line traversed in one
    direction, pi/2 for consecutive steps at right angles.

    Reference: Skean et al., "Layer by Layer" (ICML 2025), Section 3.2
    (curvature, after Henaff et al., "Perceptual straightening of natural
    videos", Nature Neuroscience 2019). Conventions the paper leaves open,
    named: a pair with a zero-length step has no angle and is left out of the
    mean (the authors' code counts it as angle 0); the angle is computed in the
    stable form ``2 atan2(|u - w|, |u + w|)`` of the unit steps, equal to the
    arccos of the cosine. Departure of the authors' code from the paper's
    formula: it takes ``|v_{k+1}^T v_k|``, folding every angle into [0, pi/2];
    ``absolute=True`` reproduces that.

    Args:
        states: ``[B, T, d]`` one layer's token states.
        mask: ``[B, T]`` bool, True on the measured tokens (None: all); the
            measured tokens of a document, in position order, form its sequence.
        absolute: fold each angle to ``min(theta, pi - theta)`` (authors' code).
        zero_steps: a pair with a zero-length step is left out of the mean
            (``"skip"``) or counted as angle 0 (``"zero"``, the authors' code,
            which also gives 0, not NaN, when no pair has an angle).

    Returns:
        ``[B]`` radians (float32; float64 for float64 states). NaN for fewer
        than three measured tokens, no pair of nonzero consecutive steps, or
        non-finite states.
    """
    mask = _check_states(states, mask)
    dtype = work_dtype(states)
    z, count = _compact(states.to(dtype), mask)
    if z.shape[1] < 3:
        return torch.full((z.shape[0],), math.nan, dtype=dtype, device=z.device)
    steps = z[:, 1:] - z[:, :-1]  # [B, T-1, d]
    length = torch.linalg.vector_norm(steps, dim=-1)
    angle = _angle(steps[:, 1:], steps[:, :-1])  # [B, T-2]
    if absolute:
        angle = torch.minimum(angle, math.pi - angle)
    k = torch.arange(angle.shape[1], device=z.device)
    valid_pair = k[None, :] < (count[:, None] - 2)
    nonzero = (length[:, 1:] > 0) & (length[:, :-1] > 0)
    finite = torch.isfinite(length[:, 1:]) & torch.isfinite(length[:, :-1])
    if zero_steps not in ("skip", "zero"):
        raise ValueError(f"zero_steps must be 'skip' or 'zero', found {zero_steps!r}")
    use = valid_pair & nonzero & finite
    bad = (valid_pair & ~finite).any(dim=1)
    total = torch.where(use, angle, torch.zeros_like(angle)).sum(dim=1)
    n = (valid_pair if zero_steps == "zero" else use).sum(dim=1)
    out = total / n.to(dtype)
    if zero_steps == "zero":
        out = torch.where(n == 0, torch.zeros_like(out), out)
        return torch.where(bad, torch.full_like(out, math.nan), out)
    return torch.where(bad | (n == 0), torch.full_like(out, math.nan), out)


def standardize_tokens(states: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The authors' preprocessing: centre the measured tokens, then scale each to unit norm.

    ``z_t <- (z_t - mean_s z_s) / ||z_t - mean_s z_s||`` over the measured tokens
    of each document (unmeasured rows are left as they are).

    Reference: Skean et al. (ICML 2025), released code (after Zhang et al.,
    "Matrix entropy", its ``normalize``); not part of the paper's formulas.

    Args:
        states: ``[B, T, d]`` one layer's token states.
        mask: ``[B, T]`` bool, True on the measured tokens (None: all).

    Returns:
        ``[B, T, d]`` in the states' work dtype; a token equal to the mean (one
        measured token, or identical tokens) becomes NaN, so the metrics built
        on it are NaN for that document.
    """
    mask = _check_states(states, mask)
    dtype = work_dtype(states)
    z = states.to(dtype)
    m = mask[..., None].to(dtype)
    mean = (z * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True)
    centred = z - mean
    norm = torch.linalg.vector_norm(centred, dim=-1, keepdim=True)
    scaled = centred / torch.where(norm > 0, norm, torch.full_like(norm, math.nan))
    return torch.where(mask[..., None], scaled, z)


def pool_tokens(
    states: torch.Tensor, mask: torch.Tensor | None = None, pooling: str = "mean"
) -> torch.Tensor:
    """One vector per document: the mean of its measured token states, or the last one.

    ``zbar = (1 / T) sum_t z_t`` (``pooling="mean"``, what Layer by Layer's
    dataset entropy uses) or ``z_T``, the last measured token
    (``pooling="last"``, the target position n).

    Args:
        states: ``[B, T, d]`` one layer's token states.
        mask: ``[B, T]`` bool, True on the measured tokens (None: all).
        pooling: ``"mean"`` or ``"last"``.

    Returns:
        ``[B, d]`` in the states' work dtype; NaN for a document with no
        measured token.
    """
    mask = _check_states(states, mask)
    dtype = work_dtype(states)
    z = states.to(dtype)
    if pooling == "mean":
        m = mask[..., None]
        return torch.where(m, z, torch.zeros((), dtype=dtype)).sum(dim=1) / m.sum(dim=1)
    if pooling == "last":
        T = mask.shape[1]
        position = torch.arange(T, device=mask.device).expand_as(mask)
        last = torch.where(mask, position, torch.full_like(position, -1)).amax(dim=1)
        picked = z.gather(1, last.clamp(min=0)[:, None, None].expand(-1, 1, z.shape[-1]))[:, 0]
        return torch.where((last >= 0)[:, None], picked, torch.full_like(picked, math.nan))
    raise ValueError(f"pooling must be 'mean' or 'last', found {pooling!r}")


class DatasetGram:
    """Streamed dataset entropy: one pooled vector per document per layer, no token states kept.

    Dataset entropy at state l is the alpha-entropy of the trace-normalised
    Gram matrix ``K = Zbar Zbar^T`` (N x N) of the N documents' pooled vectors
    ``zbar_i`` (:func:`pool_tokens`) at that state:
    ``S_alpha(Zbar) = ln(sum_i (lambda_i(K) / tr K)^alpha) / (1 - alpha)``.
    N identical documents give 0; N orthonormal pooled vectors give ``ln N``.

    The accumulator keeps the pooled rows while there are at most d of them and
    folds them into the second moment ``Zbar^T Zbar`` (d x d, the same nonzero
    spectrum as ``K``) past d, so its memory is ``(L+1) min(N, d) d`` float64
    numbers whatever N. :meth:`merge` joins two accumulators (data-parallel
    ranks); the result does not depend on the order of the documents beyond
    round-off.

    Reference: Skean et al., "Layer by Layer" (ICML 2025), Section 3.1
    (dataset entropy, on the mean-pooled prompt representations; their code
    mean-pools after its :func:`standardize_tokens` step).

    Args:
        n_states: number of states per document (L + 1).
        d: the width d.
    """

    def __init__(self, n_states: int, d: int):
        if n_states < 1 or d < 1:
            raise ValueError(f"need n_states >= 1 and d >= 1, found {n_states}, {d}")
        self.n_states = int(n_states)
        self.d = int(d)
        self.count = 0
        self._rows: list[torch.Tensor] = []  # each [n, n_states, d] float64
        self._moment: torch.Tensor | None = None  # [n_states, d, d] float64

    def update(self, pooled: torch.Tensor) -> None:
        """Add documents' pooled vectors ``[B, L+1, d]``; a row with a non-finite value is refused.

        Raises:
            ValueError: wrong shape, or a non-finite pooled vector (leave the
                document out and say so before calling).
        """
        if pooled.dim() != 3 or tuple(pooled.shape[1:]) != (self.n_states, self.d):
            raise ValueError(
                f"pooled must have shape [B, {self.n_states}, {self.d}], found "
                f"{tuple(pooled.shape)}"
            )
        if not bool(torch.isfinite(pooled).all()):
            raise ValueError("pooled vectors must be finite; leave failed documents out")
        rows = pooled.detach().to(torch.float64)
        self.count += rows.shape[0]
        if self._moment is not None:
            self._moment += torch.einsum("bli,blj->lij", rows, rows)
            return
        self._rows.append(rows)
        if self.count > self.d:
            self._fold()

    def _fold(self) -> None:
        stacked = torch.cat(self._rows)
        self._moment = torch.einsum("bli,blj->lij", stacked, stacked)
        self._rows = []

    def merge(self, other: DatasetGram) -> None:
        """Add another accumulator's documents (same shape) to this one."""
        if (other.n_states, other.d) != (self.n_states, self.d):
            raise ValueError(
                f"cannot merge a [{other.n_states}, {other.d}] accumulator into "
                f"[{self.n_states}, {self.d}]"
            )
        if other._moment is None:
            for rows in other._rows:
                self.update(rows)
            return
        if self._moment is None:
            if self._rows:
                self._fold()
            else:
                self._moment = torch.zeros_like(other._moment)
        self._moment += other._moment.to(self._moment.device)
        self.count += other.count

    def entropy(self, alpha: float = 1.0, clamp: bool = False) -> torch.Tensor:
        """Dataset entropy per state ``[L+1]`` float64, in nats; NaN for fewer than one document.

        ``clamp``: set the negative entries of the matrix decomposed (the N x N
        Gram for N <= d, else the d x d second moment, as the authors' code
        chooses) to zero first (the authors' ``compute_entropy``).
        """
        _check_alpha(alpha)
        if self.count == 0:
            return torch.full((self.n_states,), math.nan, dtype=torch.float64)
        if self._moment is not None:
            matrix = self._moment
        else:
            z = torch.cat(self._rows).transpose(0, 1)  # [L+1, N, d]
            matrix = z @ z.transpose(1, 2)
        lam = torch.linalg.eigvalsh(matrix.clamp(min=0) if clamp else matrix)
        return spectrum_entropy(lam, alpha)
