"""Estimate the thought/fixation boundary from a logit-lens profile.

The Picking paper describes two phases of depth: early "thought" layers where
the logit-lens distribution is spread out (high entropy, far from the target),
and late "fixation" layers where it has settled on its final answer. The
report places the boundary where the profile has fallen half way from its
peak to its final value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

MIN_DROP = 1e-3


def boundary_profile(profiles: Mapping[str, Mapping], names: Sequence[str]) -> list[float] | None:
    """The mean (None as NaN) of the first of ``names`` measured in ``profiles``, else None.

    ``names``: the profiles declared with ``boundary=True``, in catalogue order
    (`Catalogue.boundary_profiles`: logit-lens entropy, then TV to target).
    """
    for name in names:
        mean = (profiles.get(name) or {}).get("mean")
        if mean:
            return [math.nan if v is None else v for v in mean]
    return None


def boundary_layer(profile: Sequence[float], min_drop: float = MIN_DROP) -> float:
    """Layer index where a falling profile first crosses the midpoint of its drop.

    With the profile ``h_l`` over states l = 0..L (normalized logit-lens
    entropy ``H(P^l)/ln V`` or TV to target ``1 - P^l(target)``), let
    ``l* = argmax_l h_l`` and ``m = (h_{l*} + h_L) / 2``. The boundary is the
    smallest ``l >= l*`` with ``h_l <= m``.

    Reference: Aubry et al., "Picking an LLM's Brain: Thought and Fixation in
    Hidden Representations" (2024), the thought/fixation split of the logit
    lens; the midpoint rule is lm-coupling's own operational definition.

    Args:
        profile: ``[L+1]`` per-layer values (NaN entries are ignored).
        min_drop: smallest ``h_{l*} - h_L`` that counts as a drop.

    Returns:
        The layer index l (0..L) as a float; NaN when the profile has fewer
        than two finite values or does not fall by ``min_drop``.
    """
    values = np.asarray(profile, dtype=np.float64)
    finite = np.isfinite(values)
    if finite.sum() < 2:
        return math.nan
    top = int(np.nanargmax(values))
    last = int(np.flatnonzero(finite)[-1])
    drop = values[top] - values[last]
    if not drop >= min_drop:
        return math.nan
    midpoint = (values[top] + values[last]) / 2.0
    for layer in range(top, last + 1):
        if finite[layer] and values[layer] <= midpoint:
            return float(layer)
    return float(last)


def boundary_depth(profile: Sequence[float], min_drop: float = MIN_DROP) -> float:
    """`boundary_layer` of a states 0..L profile divided by L (NaN where it is NaN or L = 0)."""
    n_layers = len(profile) - 1
    layer = boundary_layer(profile, min_drop)
    return layer / n_layers if n_layers > 0 and math.isfinite(layer) else math.nan
