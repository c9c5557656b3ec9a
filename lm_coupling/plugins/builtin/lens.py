"""Built-in lens metrics: entropy, TV to the target token, fixation depth.

A plugin like any other: it declares ``lens``, and its reducer receives, per
state l = 0..L, the run's lens logits at the target position n (the logit
lens unless a plugin supplies another through ``lmc_lens``) and keeps three
numbers per document and layer (`lm_coupling.states.LensStates`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_coupling.plugins.markers import hookimpl
from lm_coupling.plugins.specs import UNIT_INTERVAL, MetricSpec, ProfileSpec

if TYPE_CHECKING:  # the math (and torch) load when a batch is computed, not on declaring
    from lm_coupling.states import BatchInfo, LayerView, LensStates

_NEEDS = frozenset({"lens"})
_OWN = ("logit_lens_entropy", "tv_to_target", "fixation_depth")


@hookimpl
def lmc_declare_metrics():
    """Declare logit_lens_entropy, tv_to_target and fixation_depth."""
    return [
        MetricSpec(
            "logit_lens_entropy",
            "mean over layers of the logit-lens entropy H(P^l)/ln V at the target position",
            _NEEDS,
            profiles=(
                ProfileSpec(
                    "logit_lens_entropy",
                    "states",
                    "logit-lens entropy H/ln V",
                    UNIT_INTERVAL,
                    boundary=True,
                ),
            ),
            higher_is_better=False,
            label="logit-lens entropy H/ln V",
            bounds=UNIT_INTERVAL,
        ),
        MetricSpec(
            "tv_to_target",
            "mean over layers of 1 - P^l(gold token): distance of the lens to the answer",
            _NEEDS,
            profiles=(
                ProfileSpec("tv_to_target", "states", "TV to target", UNIT_INTERVAL, boundary=True),
            ),
            higher_is_better=False,
            label="TV to target",
            bounds=UNIT_INTERVAL,
            reads_target=True,
        ),
        MetricSpec(
            "fixation_depth",
            "smallest l/L after which the lens's top-1 token no longer changes",
            _NEEDS,
            label="fixation depth l/L",
            bounds=UNIT_INTERVAL,
        ),
    ]


class LensReducer:
    """Lens entropy, target probability and top-1 token at n, every state at once.

    After x^L, capture hands it the lens logits of every state,
    ``[B, L+1, V]``, from one read-out per batch (``update_lens``), and it
    summarises them in one `lens_summary` call (each row's values are those
    of that state's logits alone).

    Args:
        batch: the batch (its target tokens and vocabulary size).
        top1: keep the top-1 tokens (``fixation_depth`` is selected).

    Raises:
        ValueError: a target token outside ``[-1, V)``.
    """

    def __init__(self, batch: BatchInfo, top1: bool = True):
        self.target, self.top1 = batch.target_tokens, top1
        bad = (self.target < -1) | (self.target >= batch.vocab_size)
        if bool(bad.any()):  # checked once per batch, not per layer (a host-device sync)
            raise ValueError(
                f"target ids must be -1 (none) or in [0, {batch.vocab_size}), found "
                f"{self.target.tolist()}"
            )
        self.summary: tuple | None = None

    def update(self, view: LayerView) -> None:
        """Nothing per state: the lens of every state arrives at once (`update_lens`)."""

    def update_lens(self, logits) -> None:
        """Summarise the lens distributions ``P^l`` of the rows at n, ``logits [B, L+1, V]``."""
        from lm_coupling.metrics.lens import lens_summary

        target = self.target.to(logits.device)
        self.summary = lens_summary(logits, target, check_target=False, top1=self.top1)

    def finalize(self) -> LensStates | None:
        """``LensStates`` with ``[B, L+1]`` entropy, target probability and top-1.

        None when the lens failed (capture records why; the lens metrics are then NaN).
        """
        from lm_coupling.states import LensStates

        if self.summary is None:
            return None
        entropy, target_prob, top1 = self.summary
        return LensStates(entropy=entropy, target_prob=target_prob, top1=top1)


@hookimpl
def lmc_layer_reducer(selected, batch: BatchInfo) -> LensReducer | None:
    """Start the batch's lens reducer."""
    if not set(_OWN) & set(selected):
        return None
    return LensReducer(batch, top1="fixation_depth" in selected)


@hookimpl
def lmc_compute_batch(selected, reduced: LensStates | None):
    """Reduce the per-layer lens quantities at n to per-document values."""
    from lm_coupling.metrics.lens import fixation_depth, tv_to_target

    lens = reduced
    if lens is None or not set(_OWN) & set(selected):
        return None
    tv = tv_to_target(lens.target_prob)
    values, profiles = {}, {}
    if "logit_lens_entropy" in selected:
        values["logit_lens_entropy"] = lens.entropy.mean(dim=1)
        profiles["logit_lens_entropy"] = lens.entropy
    if "tv_to_target" in selected:
        values["tv_to_target"] = tv.mean(dim=1)
        profiles["tv_to_target"] = tv
    if "fixation_depth" in selected:
        values["fixation_depth"] = fixation_depth(lens.top1)
    return {"values": values, "profiles": profiles}
