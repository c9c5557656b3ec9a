"""A metric of the states at the measured token n, written the short way (docs/plugins.md)."""

from lm_coupling import metric


@metric(
    "cosine of each state x^l_n to the last one x^L_n, mean over states 0..L",
    profile="states",
    label="cosine to the last state",
    bounds=(-1.0, 1.0),
)
def cosine_to_last(states):
    """``cos(x^l_n, x^L_n)`` for l = 0..L; ``states`` is ``[B, L+1, d]``."""
    import torch

    last = states[:, -1:].expand_as(states)
    profile = torch.nn.functional.cosine_similarity(states, last, dim=-1)  # [B, L+1]
    return profile.mean(dim=1), profile
