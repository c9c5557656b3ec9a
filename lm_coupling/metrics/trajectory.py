"""Per-token trajectory metrics: norm profile, line-shape score, expodistance, equidistance.

A token's trajectory is the sequence of its hidden states ``x^0_t, ..., x^L_t``
(``x^0`` the input of block 1, ``x^l`` the output of block l before the final
norm). Steps are ``d_l = x^l_t - x^{l-1}_t`` for l = 1..L.

Every function computes in float32, or in float64 when given float64, and
returns NaN (never raises) for tokens whose states are NaN/inf or whose metric
is undefined. :class:`TrajectoryAccumulator` computes the same quantities
streamed block by block, without keeping the ``[B, T, L+1, d]`` stack.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from lm_coupling.metrics import as_work, work_dtype

__all__ = [
    "STACK_BYTES",
    "TrajectoryAccumulator",
    "equidistance",
    "expodistance",
    "line_shape_score",
    "masked_token_mean",
    "masked_token_means",
    "norm_profile",
    "trajectory_summaries",
    "windowed_line_shape_score",
]

STACK_BYTES = 16 * 2**20
"""Largest ``[B, L+1, T, d]`` stack of states that `TrajectoryAccumulator` holds.

Below it a batch's summaries are computed at once on the stack
(`trajectory_summaries`: a fixed number of tensor operations per batch, where
streaming costs about twenty per state), at most about four stacks' worth of
memory in all; above it they are streamed state by state. Both give the same
values up to summation order."""


def _check_trajectory(trajectory: torch.Tensor, name: str = "trajectory") -> None:
    if not isinstance(trajectory, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, found {type(trajectory).__name__}")
    if trajectory.dim() < 2 or trajectory.shape[-2] < 2:
        raise ValueError(
            f"{name} must have shape [..., L+1, d] with L >= 1 (at least two states), "
            f"found shape {tuple(trajectory.shape)}"
        )


def _unit_steps_with_length(
    steps: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unit step vectors, a nonzero-step mask and the step lengths, from ``[..., d]`` steps.

    Zero-length steps give a zero unit vector and ``nonzero`` False (divisor
    +inf); non-finite steps give a NaN unit vector (divisor NaN), so every sum
    that contains them is NaN. Written into ``out`` when given.
    """
    length = torch.linalg.vector_norm(steps, dim=-1)
    nonzero = length > 0
    divisor = torch.where(nonzero, length, math.inf)
    divisor = torch.where(torch.isfinite(length), divisor, math.nan)
    return torch.div(steps, divisor[..., None], out=out), nonzero, length


def _lss_from_sums(unit_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``count / ||unit_sum||``; NaN where count is 0 or the sum is 0 or non-finite."""
    resultant = torch.linalg.vector_norm(unit_sum, dim=-1)
    # A sum of unit vectors is finite unless a step was not (then NaN, and NaN > 0 is
    # False); resultant > 0 also excludes count 0, whose sum is the zero vector.
    return torch.where(resultant > 0, count / resultant, math.nan)


def norm_profile(trajectory: torch.Tensor) -> torch.Tensor:
    """Norm of every state of the trajectory, ``||x^l_t||`` for l = 0..L.

    Reference: Picking paper (Aubry et al., "Picking an LLM's Brain", 2024),
    norm profiles of the residual stream.

    Args:
        trajectory: ``[..., L+1, d]`` states ``x^0..x^L``, any float dtype.

    Returns:
        ``[..., L+1]`` norms in float32 (float64 if given float64). NaN/inf
        states give NaN/inf norms.
    """
    _check_trajectory(trajectory)
    return torch.linalg.vector_norm(as_work(trajectory), dim=-1)


def line_shape_score(trajectory: torch.Tensor) -> torch.Tensor:
    """Line-shape score of each trajectory.

    ``LSS = L' / || sum_l d_l / ||d_l|| ||`` with ``d_l = x^l - x^{l-1}``, where
    the sum and the count ``L'`` run over the nonzero steps only. LSS is 1 for a
    straight trajectory (all steps in one direction) and larger otherwise.

    Reference: Gai and Zhang, 2021 (line-shape score); docs/design.md,
    "Metric definitions".
    Zero-length steps are skipped and not counted.

    Args:
        trajectory: ``[..., L+1, d]`` states ``x^0..x^L``.

    Returns:
        ``[...]`` LSS in float32 (float64 if given float64). NaN where there
        is no nonzero step, where a state is NaN/inf, or where the unit steps
        cancel exactly (closed path, LSS unbounded).

    Example:
        >>> x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
        >>> float(line_shape_score(x))
        3.0
    """
    _check_trajectory(trajectory)
    x = as_work(trajectory)
    unit, nonzero, _ = _unit_steps_with_length(x[..., 1:, :] - x[..., :-1, :])
    return _lss_from_sums(unit.sum(dim=-2), nonzero.sum(dim=-1))


def _check_window(window: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1 or window % 2 == 0:
        raise ValueError(f"window must be an odd positive integer (e.g. 11), found {window!r}")
    return window // 2


def windowed_line_shape_score(trajectory: torch.Tensor, window: int = 11) -> torch.Tensor:
    """Line-shape score of the steps around each depth.

    ``LSS_w(l) = L'_l / || sum_{j in W_l} d_j / ||d_j|| ||`` with
    ``W_l = [l - h, l + h] ∩ [1, L]``, ``h = (window - 1) / 2``, nonzero steps only.

    Reference: Gai and Zhang, 2021 (line-shape score), applied in a sliding
    window as in docs/design.md, "Metric definitions" (window 11 = steps
    l-5..l+5).

    Args:
        trajectory: ``[..., L+1, d]`` states ``x^0..x^L``.
        window: odd number of steps in the window.

    Returns:
        ``[..., L]`` windowed LSS at depth l = 1..L, float32 (float64 if given
        float64). NaN where the window has no nonzero step, contains a
        non-finite state, or its unit steps cancel exactly.
    """
    _check_trajectory(trajectory)
    x = as_work(trajectory)
    stack = x.reshape(-1, *x.shape[-2:])[:, :, None]  # [N, L+1, 1, d]
    out = _summaries_of_stack(stack, True, window)["windowed_lss"]
    return out[:, :, 0].reshape(*x.shape[:-2], -1)


def expodistance(norms: torch.Tensor) -> torch.Tensor:
    """Relative variance of the log norm growth per block.

    ``expodistance = Var_l(a_l) / (Mean_l a_l)^2`` with
    ``a_l = ln(||x^l|| / ||x^{l-1}||)``, l = 1..L, population variance. It is 0
    for exact exponential growth (or decay) of the norms.

    Reference: Aubry et al., "Picking an LLM's Brain: Thought and Fixation in
    Hidden Representations" (2024), exponential norm growth; docs/design.md, "Metric definitions".

    Args:
        norms: ``[..., L+1]`` norms ``||x^0||..||x^L||`` (see :func:`norm_profile`).

    Returns:
        ``[...]`` float32 (float64 if given float64). NaN where a norm is 0 or
        non-finite, or the mean log growth is 0 or non-finite.
    """
    if not isinstance(norms, torch.Tensor) or norms.dim() < 1 or norms.shape[-1] < 2:
        found = tuple(norms.shape) if isinstance(norms, torch.Tensor) else type(norms).__name__
        raise ValueError(f"norms must have shape [..., L+1] with L >= 1, found {found}")
    log_n = torch.log(as_work(norms))
    growth = log_n[..., 1:] - log_n[..., :-1]
    mean = growth.mean(dim=-1)
    var = (growth - mean[..., None]).square().mean(dim=-1)
    # A zero or non-finite norm makes a growth term infinite or NaN, hence the mean
    # non-finite (+inf and -inf terms give NaN): one test covers every undefined case.
    ok = torch.isfinite(mean) & (mean != 0)
    return torch.where(ok, var / mean.square(), math.nan)


def equidistance(step_lengths: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation of the step lengths.

    ``equidistance = std_l(||d_l||) / mean_l(||d_l||)``, l = 1..L, population
    std. It is 0 for equally spaced states.

    Reference: Aubry et al., "Picking an LLM's Brain: Thought and Fixation in
    Hidden Representations" (2024), eq. 2.

    Args:
        step_lengths: ``[..., L]`` step lengths ``||x^l - x^{l-1}||``.

    Returns:
        ``[...]`` float32 (float64 if given float64). NaN where a length is
        non-finite or the mean length is 0.
    """
    if not isinstance(step_lengths, torch.Tensor) or step_lengths.dim() < 1:
        raise ValueError("step_lengths must be a tensor of shape [..., L] with L >= 1")
    if step_lengths.shape[-1] < 1:
        raise ValueError(f"step_lengths needs L >= 1, found shape {tuple(step_lengths.shape)}")
    s = as_work(step_lengths)
    mean = s.mean(dim=-1)
    std = (s - mean[..., None]).square().mean(dim=-1).sqrt()
    # Lengths are >= 0 or NaN; an infinite length makes the mean inf and the std NaN.
    ok = (mean > 0) & torch.isfinite(std)
    return torch.where(ok, std / mean, math.nan)


def trajectory_summaries(
    states: list[torch.Tensor] | tuple[torch.Tensor, ...], windowed: bool = True, window: int = 11
) -> dict[str, torch.Tensor | None]:
    """Norms, step lengths, LSS and windowed LSS of every token, from all its states at once.

    The quantities of :func:`norm_profile`, :func:`line_shape_score` and
    :func:`windowed_line_shape_score` (same definitions, same NaN rules; Gai
    and Zhang, 2021; docs/design.md, "Metric definitions"), laid out as
    `TrajectoryAccumulator.finalize` returns them. Each window sum adds the
    window's unit steps directly (an ``unfold`` of the zero-padded steps), never
    by subtracting prefix sums, so unit steps that cancel exactly give exactly 0.

    Args:
        states: ``L+1`` tensors ``[B, T, d]``, the states ``x^0..x^L``.
        windowed: also the windowed LSS.
        window: odd number of steps per window (11 = steps l-5..l+5).

    Returns:
        dict with ``norms [B, L+1, T]``, ``step_lengths [B, L, T]``,
        ``lss [B, T]`` and ``windowed_lss [B, L, T]`` (None unless
        ``windowed``), float32 (float64 if given float64).
    """
    _check_window(window)
    if len(states) < 2:
        raise ValueError(f"need at least two states (x^0 and x^1), received {len(states)}")
    return _summaries_of_stack(as_work(torch.stack(tuple(states), dim=1)), windowed, window)


def _summaries_of_stack(x: torch.Tensor, windowed: bool, window: int) -> dict:
    """:func:`trajectory_summaries` of the stacked states ``x [B, L+1, T, d]`` (work dtype)."""
    half = _check_window(window)
    batch, n_steps, n_tokens, width = x.shape[0], x.shape[1] - 1, x.shape[2], x.shape[3]
    norms = torch.linalg.vector_norm(x, dim=-1)
    steps = x[:, 1:] - x[:, :-1]
    del x
    # When h >= L - 1 every window [l - h, l + h] ∩ [1, L] is all L steps: each
    # depth's windowed LSS is the LSS itself. Otherwise the windows are summed over
    # the steps padded with h zero steps on each side.
    window_sums = windowed and half < n_steps - 1
    padded = steps.new_zeros((batch, n_steps + 2 * half, n_tokens, width)) if window_sums else None
    # The unit steps overwrite the steps (a temporary of this call) unless they go
    # into the padded window buffer: one stack-sized allocation fewer per batch.
    unit, nonzero, length = _unit_steps_with_length(
        steps, out=steps if padded is None else padded[:, half : half + n_steps]
    )
    del steps
    out: dict[str, torch.Tensor | None] = {
        "norms": norms,
        "step_lengths": length,
        "lss": _lss_from_sums(unit.sum(dim=1), nonzero.sum(dim=1)),
        "windowed_lss": None,
    }
    if window_sums:
        size = 2 * half + 1
        sums = padded.unfold(1, size, 1).sum(dim=-1)  # [B, L, T, d]
        count = torch.nn.functional.pad(nonzero.to(torch.int64), (0, 0, half, half))
        out["windowed_lss"] = _lss_from_sums(sums, count.unfold(1, size, 1).sum(dim=-1))
    elif windowed:
        out["windowed_lss"] = out["lss"][:, None, :].expand(batch, n_steps, n_tokens).clone()
    return out


def masked_token_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`masked_token_mean` of several rows of values per document, in one pass.

    ``out[b, k] = mean_t {values[b, k, t] : mask[b, t] and values[b, k, t] is not NaN}``.

    Args:
        values: ``[B, K, T]`` per-token values (K quantities or layers).
        mask: ``[B, T]`` bool, True for the tokens to average.

    Returns:
        ``[B, K]``; NaN where no masked value is a number.
    """
    if values.dim() != 3 or mask.dim() != 2 or values.shape[::2] != mask.shape:
        raise ValueError(
            f"values must have shape [B, K, T] and mask [B, T]; found values "
            f"{tuple(values.shape)} and mask {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, found {mask.dtype}")
    v = values if values.is_floating_point() else values.float()
    keep = mask[:, None, :] & ~torch.isnan(v)
    total = torch.where(keep, v, 0.0).sum(dim=-1)
    count = keep.sum(dim=-1)
    return torch.where(count > 0, total / count.clamp(min=1).to(v.dtype), math.nan)


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the masked tokens, ignoring NaN values.

    ``mean_t {values[b, t] : mask[b, t] and values[b, t] is not NaN}``.

    Args:
        values: ``[B, T]`` per-token values.
        mask: ``[B, T]`` bool, True for the tokens to average.

    Returns:
        ``[B]`` in the dtype of ``values`` (float32 for non-float input). NaN
        for a row with no masked non-NaN value. Infinite values are kept.
    """
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"values and mask must both have shape [B, T]; found values {tuple(values.shape)} "
            f"and mask {tuple(mask.shape)}"
        )
    return masked_token_means(values[:, None], mask)[:, 0]


class TrajectoryAccumulator:
    """Streaming trajectory summaries, fed one layer of states at a time.

    Call :meth:`update` with ``x^0`` (``[B, T, d]``), then ``x^1 .. x^L``, then
    :meth:`finalize`. It keeps only the previous state, the running sum of unit
    steps, and (when ``windowed``) the last ``window`` unit steps, each
    window summed in step order when it is complete: memory
    ``O(window * B * T * d)``, never the ``L+1`` stack. Results
    equal :func:`norm_profile`, :func:`line_shape_score` and
    :func:`windowed_line_shape_score` on the stacked states (up to summation
    order). Computes in float32, or float64 when the first state is float64.

    Reference: Gai and Zhang, 2021 (LSS); docs/design.md, "Conventions" and
    "Metric definitions".

    When ``n_layers`` is known and the batch's stack ``[B, L+1, T, d]`` is at
    most ``stack_bytes`` (`STACK_BYTES`), the states are held instead and
    summarised at once by :func:`trajectory_summaries` in ``finalize``.

    Args:
        windowed: also compute the windowed LSS profile.
        window: odd number of steps per window (11 = steps l-5..l+5).
        n_layers: number of blocks L, when known (needed to hold the stack).
        stack_bytes: the largest stack held whole (needs ``n_layers``; 0:
            always stream). Default `STACK_BYTES`.
    """

    def __init__(
        self,
        windowed: bool = True,
        window: int = 11,
        *,
        n_layers: int | None = None,
        stack_bytes: int = STACK_BYTES,
    ) -> None:
        self.windowed = bool(windowed)
        self.window = window
        self._half = _check_window(window)
        if n_layers is not None and (isinstance(n_layers, bool) or int(n_layers) < 1):
            raise ValueError(f"n_layers must be a positive integer or None, found {n_layers!r}")
        self._n_layers = None if n_layers is None else int(n_layers)
        self.stack_bytes = int(stack_bytes)
        self.reset()

    @property
    def holds_stack(self) -> bool | None:
        """Whether this batch's states are held and summarised at once (None before x^0)."""
        return self._held is not None if self._dtype is not None else None

    def reset(self) -> None:
        """Forget every state seen so far (``finalize`` calls this)."""
        self._prev: torch.Tensor | None = None
        self._dtype: torch.dtype | None = None
        self._held: torch.Tensor | None = None  # [B, L+1, T, d] states, when the stack is held
        self._n_held = 0
        self._norms: list[torch.Tensor] = []
        self._steps: list[torch.Tensor] = []
        self._unit_sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self._ring: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=self.window)
        self._windowed_out: list[torch.Tensor] = []

    @property
    def n_states(self) -> int:
        """Number of states received so far (L+1 after the last block)."""
        return self._n_held if self._held is not None else len(self._norms)

    def _fits(self, state: torch.Tensor) -> bool:
        """Whether the ``L+1`` states of this shape fit in ``stack_bytes`` (work dtype)."""
        if self._n_layers is None:
            return False
        itemsize = torch.empty((), dtype=self._dtype).element_size()
        return (self._n_layers + 1) * state.numel() * itemsize <= self.stack_bytes

    def update(self, state: torch.Tensor) -> None:
        """Add the next state ``x^l`` of every token.

        Args:
            state: ``[B, T, d]`` states at depth l (any float dtype; detached).
        """
        if not isinstance(state, torch.Tensor) or state.dim() != 3:
            found = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state)
            raise ValueError(f"state must have shape [B, T, d], found {found}")
        if self._prev is not None and state.shape != self._prev.shape:
            raise ValueError(
                f"state shape changed between layers: expected {tuple(self._prev.shape)}, "
                f"found {tuple(state.shape)}"
            )
        if self._dtype is None:
            self._dtype = work_dtype(state)
            if self._fits(state):
                batch, n_tokens, width = state.shape
                self._held = state.new_empty(
                    (batch, self._n_layers + 1, n_tokens, width), dtype=self._dtype
                )
        if self._held is not None:
            if self._n_held > self._n_layers:
                raise ValueError(
                    f"received state {self._n_held} but the accumulator was built for "
                    f"n_layers={self._n_layers}; pass the model's number of blocks (or None)"
                )
            # Held until finalize: copied into the stack (never a view of the caller's memory).
            self._held[:, self._n_held].copy_(state.detach())
            self._prev = self._held[:, self._n_held]  # for the next state's shape check
            self._n_held += 1
            return
        x = state.detach().to(self._dtype)
        self._norms.append(torch.linalg.vector_norm(x, dim=-1))
        if self._prev is not None:
            self._add_step(x - self._prev)
        self._prev = x

    def _add_step(self, step: torch.Tensor) -> None:
        unit, nonzero, length = _unit_steps_with_length(step)
        self._steps.append(length)
        if self._unit_sum is None:
            self._unit_sum, self._count = unit.clone(), nonzero.to(torch.int64)
        else:
            self._unit_sum += unit
            self._count += nonzero
        if not self.windowed:
            return
        self._ring.append((unit, nonzero))
        # Step m completes the window of depth m - h: steps max(1, m - 2h)..m.
        if len(self._steps) > self._half:
            self._windowed_out.append(self._window_lss(len(self._ring)))

    def _window_lss(self, size: int) -> torch.Tensor:
        """LSS of the last ``size`` steps held, their unit steps summed in step order."""
        steps = list(self._ring)[-size:]
        unit_sum, count = steps[0][0].clone(), steps[0][1].to(torch.int64)
        for unit, nonzero in steps[1:]:
            unit_sum += unit
            count += nonzero
        return _lss_from_sums(unit_sum, count)

    def finalize(self) -> dict[str, torch.Tensor | None]:
        """Summaries of the trajectories fed so far, then reset.

        Returns:
            dict with ``norms [B, L+1, T]``, ``step_lengths [B, L, T]``,
            ``lss [B, T]`` and ``windowed_lss [B, L, T]`` (None when
            ``windowed`` is False). NaN marks undefined values as in the dense
            functions.
        """
        if self.n_states < 2:
            raise ValueError(
                f"finalize needs at least two states (x^0 and x^1), received {self.n_states}"
            )
        if self._held is not None:
            stack = self._held[:, : self._n_held]
            out = _summaries_of_stack(stack, self.windowed, self.window)
            self.reset()
            return out
        n_steps = len(self._steps)
        windowed = None
        if self.windowed:
            # Depths L-h+1..L (those not yet emitted) use the last steps, clipped at L.
            for depth in range(len(self._windowed_out) + 1, n_steps + 1):
                first = max(1, depth - self._half)
                self._windowed_out.append(self._window_lss(n_steps - first + 1))
            windowed = torch.stack(self._windowed_out, dim=1)
        out = {
            "norms": torch.stack(self._norms, dim=1),
            "step_lengths": torch.stack(self._steps, dim=1),
            "lss": _lss_from_sums(self._unit_sum, self._count),
            "windowed_lss": windowed,
        }
        self.reset()
        return out
