"""Layer by Layer's conventions as the authors' released code applies them.

Skean et al., "Layer by Layer" (ICML 2025); released code
OFSkean/information_flow, ``experiments/utils/metrics/metric_functions.py``.
Three of its conventions differ from this package's defaults
(docs/metrics.md, "Layer by Layer's measures"); the two that are math live
here:

* **the Gram clamp**: ``compute_entropy`` forms ``Z Z^T`` (N x N) when the
  document has N <= d tokens and ``Z^T Z`` (d x d) otherwise, sets its
  negative entries to zero, divides by its trace and takes the alpha-entropy
  of its eigenvalues (repitl's ``matrixAlphaEntropy``, positive eigenvalues
  only). The clamp changes the spectrum whenever the (standardised) tokens
  have negative inner products, so which of the two matrices is clamped
  matters: :func:`clamped_gram_eigenvalues` clamps the same one.
* **position 0**: the authors' tokens are every position of the prompt;
  :func:`tokens_from_first` is that mask.

The third, the last state after the final norm (transformers'
``hidden_states[-1]``), is applied by the plugin (the model's own norm).
"""

from __future__ import annotations

import math

import torch

__all__ = ["clamped_gram_eigenvalues", "tokens_from_first"]


def tokens_from_first(first_index: torch.Tensor, last_index: torch.Tensor, n_tokens: int):
    """``[B, T]`` bool: positions ``first_index .. last_index`` (position 0 included)."""
    positions = torch.arange(n_tokens, device=first_index.device)[None]
    return (positions >= first_index[:, None]) & (positions <= last_index[:, None])


def clamped_gram_eigenvalues(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of each document's clamped Gram matrix, as the authors' ``compute_entropy``.

    With Z the document's N measured token states (rows), ``C = Z Z^T`` if
    N <= d else ``Z^T Z``, and the eigenvalues of ``max(C, 0)`` (entrywise).

    Reference: Skean et al. (ICML 2025), released code, ``compute_entropy``
    (``torch.clamp(cov, min=0)`` before the trace normalisation).

    Args:
        states: ``[B, T, d]`` one layer's token states.
        mask: ``[B, T]`` bool, the measured tokens.

    Returns:
        ``[B, d]`` float64 eigenvalues, ascending, zero-padded on the left
        (they feed ``spectrum_entropy``, where zeros carry no mass); NaN for a
        document with a non-finite measured state.
    """
    if states.dim() != 3 or tuple(mask.shape) != tuple(states.shape[:2]):
        raise ValueError(
            f"states [B, T, d] and mask [B, T] must match, found {tuple(states.shape)} and "
            f"{tuple(mask.shape)}"
        )
    B, _, d = states.shape
    out = torch.zeros(B, d, dtype=torch.float64, device=states.device)
    for b in range(B):
        z = states[b][mask[b]].to(torch.float64)
        if not bool(torch.isfinite(z).all()):
            out[b] = math.nan
            continue
        if z.shape[0] == 0:
            continue
        cov = z @ z.T if z.shape[0] <= d else z.T @ z
        lam = torch.linalg.eigvalsh(cov.clamp(min=0))
        out[b, d - lam.shape[0] :] = lam
    return out
