"""Above-chance thresholds for accuracy tests on small item sets."""

from __future__ import annotations

from scipy.stats import binom


def chance_threshold(n: int, chance: float, alpha: float = 1e-3) -> int:
    """Smallest number of hits k with P(X >= k) < alpha for X ~ Binomial(n, chance).

    A model that guesses reaches it with probability below ``alpha``: for 60
    four-option items at alpha = 0.001 that is 27 right (45% against 25%).
    """
    return next(k for k in range(n + 1) if binom.sf(k - 1, n, chance) < alpha)
