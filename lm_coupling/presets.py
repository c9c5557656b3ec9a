"""The papers' settings in one word: ``--metric_args preset=iclr2025``.

A preset stands for a set of ``--metric_args`` values. It is expanded before
the options are parsed, so its values go through the same parsers and checks
as typed ones; options given beside it win (``preset=iclr2025,k=20`` keeps
the preset's norm and pairs and uses K = 20). The run records the preset's
name (``preset``), the options typed beside it that overrode it
(``preset_overrides``), and every expanded value, in
``config.lm_coupling.options`` of lm-eval's results and in ``options`` of the
geometry files. A preset sets only the options of the selected metrics (with
``--metrics lss``, ``preset=iclr2025`` sets nothing but is still recorded).
"""

from __future__ import annotations

import textwrap
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from lm_coupling.errors import ConfigurationError

PRESET_OPTION = "preset"


@dataclass(frozen=True)
class Preset:
    """A named set of option values and where it comes from."""

    name: str
    values: dict[str, str]
    source: str


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "iclr2025",
            {"k": "0.1", "norm": "l1", "pairs": "all", "elementwise_abs": "true"},
            "Aubry et al., ICLR 2025, the headline numbers (Figure 1a): K = d_model/10, "
            "mis-coupling eq. 9 with the l1 norm of the top-K singular values, averaged over "
            "all layer pairs, diagonal included, |A| elementwise as their released code "
            "takes it; the code's six columns (K = 10, 30, 50; trace and 2-norm; the last "
            "block through the final norm) are the metrics iclr2025_miscoupling_*",
        ),
        Preset(
            "skean2025",
            {
                "lbl_tokens": "all",
                "lbl_standardize": "true",
                "lbl_clamp": "true",
                "lbl_last_state": "post_norm",
                "lbl_alpha": "1",
                "curvature_abs": "true",
                "curvature_zero_steps": "zero",
                "dataset_pooling": "mean",
            },
            "Skean et al., Layer by Layer, ICML 2025, as their released code computes it "
            "(OFSkean/information_flow): every token of the prompt (position 0 included), each "
            "document's tokens centred and scaled to unit norm, the Gram matrix clamped at zero "
            "before the trace normalisation, von Neumann entropy (alpha = 1), curvature with "
            "|cos| and zero-length steps counted as angle 0, the last state after the final "
            "norm (transformers' hidden_states[-1]), dataset entropy of mean-pooled tokens; raw "
            "nats (their maxEntropy figures: add lbl_normalized=true)",
        ),
        Preset(
            "arxiv",
            {"norm": "offdiag"},
            "the arXiv version (2407.07810v1) and the authors' project page: coupling as the "
            "off-diagonal part of the co-diagonalisation, ||A - Diag(A)||_F / ||A||_F; K, the "
            "layer pairs and |A| keep this package's defaults (K = 10, l != l', A as is), "
            "since that text fixes none of them",
        ),
    )
}


def expand_preset(
    pairs: Iterable[tuple[str, Any]], known: Collection[str]
) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """Replace ``preset=NAME`` by the preset's values, typed options after them.

    Args:
        pairs: the ``--metric_args`` key/value pairs in the order given.
        known: the option names of the selected metrics (a preset sets only these).

    Returns:
        ``(pairs, recorded)``: the pairs to parse (preset values first, so
        that typed ones win) and the entries to record in the options
        (``preset`` and, when some were typed, ``preset_overrides``); no
        preset: the pairs unchanged and ``{}``.

    Raises:
        ConfigurationError: an unknown preset name, or two presets.
    """
    pairs = list(pairs)
    named = [str(value).strip() for key, value in pairs if key == PRESET_OPTION]
    if not named:
        return pairs, {}
    if len(named) > 1:
        raise ConfigurationError(f"--metric_args: one preset at a time, found {', '.join(named)}")
    if named[0] not in PRESETS:
        raise ConfigurationError(
            f"--metric_args preset={named[0]}: unknown preset; available: {', '.join(PRESETS)} "
            "(README: 'The papers' settings (presets)')"
        )
    preset = PRESETS[named[0]]
    typed = [(key, value) for key, value in pairs if key != PRESET_OPTION]
    expanded = [(key, value) for key, value in preset.values.items() if key in known]
    recorded: dict[str, Any] = {PRESET_OPTION: preset.name}
    overrides = sorted({key for key, _ in typed} & {key for key, _ in expanded})
    if overrides:
        recorded["preset_overrides"] = overrides
    return expanded + typed, recorded


def describe_presets() -> str:
    """One paragraph per preset, for ``lm-coupling metrics``."""
    lines = []
    for preset in PRESETS.values():
        values = ",".join(f"{k}={v}" for k, v in preset.values.items())
        source = textwrap.indent(textwrap.fill(preset.source, 74), "      ")
        lines.append(f"  preset={preset.name}  ({values})\n{source}")
    return "\n".join(lines)
