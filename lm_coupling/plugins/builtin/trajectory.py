"""Built-in trajectory metrics: LSS, expodistance, equidistance, norm profile.

A plugin like any other: it declares ``hidden_states``, and its reducer
(``lmc_layer_reducer``) streams ``x^0..x^L`` of each batch through
`lm_coupling.metrics.trajectory.TrajectoryAccumulator`, keeping per-token
summaries (`lm_coupling.states.TrajectoryStates`). A batch whose stack of
states fits in `STACK_BYTES` (16 MiB) is held and summarised at once; a larger
one is streamed state by state, never stacked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.options import parse_bool
from lm_coupling.plugins.specs import MetricSpec, OptionSpec, ProfileSpec

if TYPE_CHECKING:  # the math (and torch) load when a batch is computed, not on declaring
    from lm_coupling.states import BatchInfo, LayerView, TrajectoryStates

TOKENS = OptionSpec(
    "tokens",
    "all",
    "tokens a per-document trajectory value averages over: all (context tokens 1..n) or last (n)",
    choices=("all", "last"),
)
WINDOWED = OptionSpec(
    "windowed", True, "store the windowed LSS profile (window 11)", parse=parse_bool
)
_NEEDS = frozenset({"hidden_states"})
_OWN = ("lss", "expodistance", "equidistance")
_PROFILES = ("norm", "windowed_lss")
_PROFILE_SPECS = (
    ProfileSpec("norm", "states", "norm ||x^l||"),
    ProfileSpec("windowed_lss", "blocks", "windowed LSS (11 layers)", min_blocks=11),
)


@hookimpl
def lmc_declare_metrics():
    """Declare lss, expodistance and equidistance."""
    described = {
        "lss": "line-shape score L/||sum of unit steps||: 1 for a straight trajectory",
        "expodistance": "relative variance of log norm growth: 0 for exact exponential growth",
        "equidistance": "coefficient of variation of step lengths: 0 for equally spaced states",
    }
    return [
        MetricSpec(
            name,
            description,
            _NEEDS,
            (TOKENS, WINDOWED),
            _PROFILES,
            higher_is_better=False,
            label="LSS" if name == "lss" else "",
            profile_specs=_PROFILE_SPECS,
        )
        for name, description in described.items()
    ]


class TrajectoryReducer:
    """Per-token trajectory summaries of one batch (held whole when small, else streamed).

    Args:
        batch: the batch (its token mask and target positions).
        windowed: also the windowed LSS (window 11).
        tokens: ``"all"`` (the context tokens 1..n) or ``"last"`` (n alone; the
            summaries then have the one position n).
    """

    def __init__(self, batch: BatchInfo, windowed: bool, tokens: str):
        from lm_coupling.metrics.trajectory import TrajectoryAccumulator

        self.batch, self.tokens = batch, tokens
        self.accumulator = TrajectoryAccumulator(windowed=windowed, n_layers=batch.n_layers)

    def update(self, view: LayerView) -> None:
        """Add ``x^l`` (all positions, or the rows at n with ``tokens=last``)."""
        if self.tokens == "last":
            self.accumulator.update(view.at_n[:, None])
        else:
            self.accumulator.update(view.hidden)

    def finalize(self) -> TrajectoryStates:
        """The batch's `TrajectoryStates` (over the one position n with ``tokens=last``)."""
        import torch

        from lm_coupling.states import TrajectoryStates

        out = self.accumulator.finalize()
        mask = self.batch.token_mask
        if self.tokens == "last":
            mask = torch.ones((self.batch.size, 1), dtype=torch.bool, device=mask.device)
        return TrajectoryStates(
            norms=out["norms"],
            step_lengths=out["step_lengths"],
            lss=out["lss"],
            windowed_lss=out["windowed_lss"],
            token_mask=mask,
        )


@hookimpl
def lmc_layer_reducer(selected, options, batch: BatchInfo) -> TrajectoryReducer | None:
    """Start the batch's trajectory reducer."""
    if not set(_OWN) & set(selected):
        return None
    return TrajectoryReducer(
        batch,
        windowed=bool(options.get("windowed", WINDOWED.default)),
        tokens=options.get("tokens", TOKENS.default),
    )


@hookimpl
def lmc_compute_batch(selected, reduced: TrajectoryStates | None):
    """Average each token's trajectory metric (and profile) over the document's tokens."""
    from lm_coupling.metrics.trajectory import equidistance, expodistance, masked_token_means

    trajectory = reduced
    if trajectory is None or not set(_OWN) & set(selected):
        return None
    columns = {"norm": trajectory.norms}  # [B, K_i, T] each
    if trajectory.windowed_lss is not None:
        columns["windowed_lss"] = trajectory.windowed_lss
    if "lss" in selected:
        columns["lss"] = trajectory.lss[:, None]
    if "expodistance" in selected:
        columns["expodistance"] = expodistance(trajectory.norms.transpose(1, 2))[:, None]
    if "equidistance" in selected:
        columns["equidistance"] = equidistance(trajectory.step_lengths.transpose(1, 2))[:, None]
    means = {
        name: masked_token_means(column, trajectory.token_mask) for name, column in columns.items()
    }
    profiles = {name: means.pop(name) for name in _PROFILES if name in means}
    return {"values": {name: value[:, 0] for name, value in means.items()}, "profiles": profiles}
