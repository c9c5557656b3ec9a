"""The name and weights fingerprint an in-memory model is filed under (``config.model_args``).

The name is recorded where lm-eval records ``pretrained``: it names the output
folder and the leaderboard row.
"""

from __future__ import annotations

from typing import Any

from lm_coupling.errors import ConfigurationError

FINGERPRINT_KEY = "weights"
FINGERPRINT_LENGTH = 16  # hex digits of the sha256 kept in the results


def recorded_model_args(model: Any, model_name: str | None) -> dict[str, Any]:
    """``config.model_args`` of an in-memory model's results: its name and weights fingerprint.

    The name is ``model_name``, else the model's ``name_or_path``; the
    fingerprint (``weights``) keeps two models filed under one name apart.

    Raises:
        ConfigurationError: neither gives a name (a model built from a config), or
            ``model_name`` is not a non-empty string.
    """
    from lm_coupling.harness.cache import weights_fingerprint
    from lm_coupling.model.transformers_adapter import loaded_from

    if model_name is not None:
        if not isinstance(model_name, str) or not model_name.strip():
            raise ConfigurationError(
                f"model_name must be a non-empty string, not {model_name!r}: it names the "
                "output folder and the leaderboard row"
            )
        name = model_name.strip()
    else:
        name = loaded_from(model)
    if not name.strip():
        raise ConfigurationError(
            f"the {type(model).__name__} in memory has no name (it was not loaded from a path, "
            "so its config's name_or_path is empty): name it, "
            "evaluate(model=model, tokenizer=tokenizer, model_name='my-model', ...). The name is "
            "recorded as lm-eval records pretrained=, and names the output folder and the "
            "leaderboard row; two different models need two names"
        )
    return {"pretrained": name, FINGERPRINT_KEY: weights_fingerprint(model)[:FINGERPRINT_LENGTH]}


def check_model_named(model_args: Any) -> None:
    """A model lm-eval loads needs ``pretrained=`` (lm-eval's ``HFLM`` takes no default).

    Raises:
        ConfigurationError: no ``pretrained`` in the model arguments.
    """
    if not (model_args or {}).get("pretrained"):
        raise ConfigurationError(
            "no model given: add --model_args pretrained=PATH_OR_HUB_ID (e.g. "
            "pretrained=EleutherAI/pythia-160m, or the folder save_pretrained wrote); "
            "`lm-coupling demo --where` prints the bundled model's folder"
        )
