"""Pure tensor math of the geometry metrics (torch only).

Modules: ``trajectory`` (norm profile, LSS, expodistance, equidistance),
``lens`` (logit-lens entropy, target probability, fixation depth), ``coupling``
(block coupling matrices and scores) and ``tokenwise`` (token-wise coupling).
"""

import torch


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_work(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its work dtype (:func:`work_dtype`)."""
    return x.to(work_dtype(x))
