"""What lm-coupling does with the options of lm-eval 0.4.13's ``run`` command.

`check_run_options` refuses, before the model loads, the options geometry
cannot honour (saying why and what to do instead) and returns those the
results JSON records under ``config.lm_coupling.lm_eval_options``. Every
option's outcome (works, passed on, refused, rejected by lm-eval) and the test
that shows it are listed in ``docs/options.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lm_coupling.errors import ConfigurationError, ModelNotFoundError

HF_MODEL_NAMES = ("hf", "hf-auto", "huggingface", "hf-coupling")
"""lm-eval's names of its Hugging Face model (``--model``), which geometry needs."""

UNRECORDED = frozenset({"model", "model_args", "tasks", "device", "output_path", "verbosity"})
"""The options ``config.lm_coupling.lm_eval_options`` leaves out (the results hold them)."""

_GPU_QUANTIZATION = ("load_in_4bit", "load_in_8bit", "autogptq", "gptqmodel")


def _is_set(value: Any) -> bool:
    """lm-eval's rule for a command-line value that overrides the defaults."""
    return bool(value) or value == 0 and value is not False


def effective_options(args: Any) -> dict[str, Any]:
    """The options the run will use: the ``--config`` YAML, then the command line.

    The precedence of lm-eval's ``EvaluatorConfig.from_cli`` (set values only;
    ``model_args`` parsed into a dict). ``args``: a parsed ``run`` namespace or
    an ``EvaluatorConfig``.
    """
    options: dict[str, Any] = {}
    if isinstance(args, argparse.Namespace):
        values = dict(vars(args))
    else:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    config_path = values.get("config")
    if config_path:
        from lm_eval.config.evaluate_config import EvaluatorConfig

        try:
            options.update(EvaluatorConfig.load_yaml_config(config_path))
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"--config {config_path}: cannot read it ({exc}); give a YAML file of "
                "lm_eval run options"
            ) from exc
    skip = {"command", "func", "metrics", "metric_args"}
    options.update({k: v for k, v in values.items() if k not in skip and _is_set(v)})
    model_args = options.get("model_args") or {}
    if not isinstance(model_args, Mapping):
        from lm_eval.utils import simple_parse_args_string

        model_args = simple_parse_args_string(str(model_args))
    options["model_args"] = dict(model_args)
    return options


def _without_gpu(options: Mapping[str, Any]) -> bool:
    import torch

    return str(options.get("device") or "").startswith("cpu") or not torch.cuda.is_available()


def _checkpoint_quantization(model_args: Mapping[str, Any]) -> Any:
    """``quantization_config`` of a local checkpoint's config.json (GPTQ, AWQ), if any."""
    config = Path(str(model_args.get("pretrained", ""))) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError):
        return None


def _refusal(options: Mapping[str, Any], model_args: Mapping[str, Any]) -> tuple | None:
    """``(option as given, why, what to do instead)`` of the first refused option, or None."""
    model = options.get("model")
    if model is not None and model not in HF_MODEL_NAMES:
        return (
            f"--model {model}",
            "geometry needs the hidden states of a Hugging Face causal LM in this process.",
            "run the model with `--model hf` (or hf-auto, huggingface; a vLLM, API or GGUF "
            "server model cannot be hooked)",
        )
    if "predict_only" in options:
        return (
            "--predict_only",
            "lm-eval replaces every metric by `bypass` and never scores a document, so "
            "geometry would be measured and then dropped.",
            "drop --predict_only; --log_samples keeps the predictions beside the scores and "
            "the geometry",
        )
    if model_args.get("backend") == "seq2seq":
        return (
            "--model_args backend=seq2seq",
            "the geometry is defined for decoder-only causal LMs.",
            "use a decoder-only model with the default backend",
        )
    quantized = [key for key in _GPU_QUANTIZATION if _is_set(model_args.get(key))]
    if quantized and _without_gpu(options):
        return (
            f"--model_args {quantized[0]}={model_args[quantized[0]]}",
            "quantized loading (bitsandbytes, GPTQ) needs CUDA kernels, and this run has no "
            "GPU; on a GPU geometry is measured from the dequantized states.",
            "run on a CUDA machine, or drop the quantization on CPU",
        )
    checkpoint = model_args.get("quantization_config") or _checkpoint_quantization(model_args)
    if checkpoint and _without_gpu(options):
        return (
            f"--model_args quantization_config={model_args.get('quantization_config')}",
            "a quantized checkpoint (GPTQ, AWQ: `quantization_config` in its config.json) "
            "needs CUDA kernels, and this run has no GPU.",
            "run on a CUDA machine, or evaluate the unquantized checkpoint",
        )
    if model_args.get("peft") and model_args.get("delta"):
        return (
            f"--model_args peft={model_args['peft']} and delta={model_args['delta']}",
            "lm-eval refuses an adapter and delta weights together (after loading the model).",
            "apply one of them",
        )
    if _is_set(model_args.get("tp_plan")):
        return (
            f"--model_args tp_plan={model_args['tp_plan']}",
            "tensor parallelism splits each block's weights across processes; geometry "
            "capture is not verified there.",
            "use parallelize=True (whole blocks per GPU) or data parallelism (accelerate launch)",
        )
    return None


def check_run_options(args: Any) -> dict[str, Any]:
    """Refuse the options geometry cannot honour (before any model loads); return those to record.

    Args:
        args: lm-eval's parsed ``run`` namespace or its ``EvaluatorConfig``
            (``--config`` YAML read too).

    Returns:
        The options used, JSON-safe, for ``config.lm_coupling.lm_eval_options``:
        each set flag but those of `UNRECORDED` under its name, and each
        ``--model_args`` key but ``pretrained`` at top level (values of
        secret-looking keys redacted).

    Raises:
        ConfigurationError: a refused option (the message says why and what to
            do instead).
    """
    options = effective_options(args)
    model_args = options["model_args"]
    refused = _refusal(options, model_args)
    if refused is not None:
        shown, why, instead = refused
        raise ConfigurationError(
            f"{shown} cannot be combined with --metrics: {why} Instead: {instead}."
        )
    if "samples" in options:
        options["samples"] = _samples_mapping(options["samples"])
    recorded = {k: v for k, v in options.items() if k not in UNRECORDED}
    recorded.update({k: v for k, v in model_args.items() if k != "pretrained"})
    return _jsonable(recorded)


def _samples_mapping(samples: Any) -> Any:
    """``--samples`` as the mapping lm-eval uses (JSON text or a JSON file's path)."""
    if not isinstance(samples, str):
        return samples
    try:
        return json.loads(samples)
    except ValueError:
        path = Path(samples)
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else samples


_SECRET_KEYS = ("token", "api_key", "password", "secret")


def _jsonable(value: Any) -> Any:
    """A JSON-safe copy; values of secret-looking keys (``token=``) are redacted."""
    if isinstance(value, Mapping):
        return {
            str(k): "<redacted>" if any(w in str(k).lower() for w in _SECRET_KEYS) else _jsonable(v)
            for k, v in value.items()
        }
    try:
        json.dumps(value)
    except TypeError:
        return str(value)
    return value


def check_model_path(pretrained: Any) -> None:
    """Fail at once on a model that cannot be found, before lm-eval indexes its tasks.

    A name that looks like a path (absolute, ``./``, ``../``, ``~``, or an
    existing parent folder) must exist. A hub id (``org/name``) is checked
    against the local cache only when the hub is offline (``HF_HUB_OFFLINE``).

    Raises:
        ModelNotFoundError: "no model at PATH", with what to do.
    """
    if not isinstance(pretrained, str) or not pretrained:
        return
    path = Path(pretrained).expanduser()
    looks_like_path = (
        path.is_absolute()
        or pretrained.startswith((".", "~"))
        or pretrained.count("/") > 1
        or (len(path.parts) > 1 and path.parent.is_dir())
    )
    if looks_like_path:
        if not path.exists():
            raise ModelNotFoundError(
                f"no model at {pretrained} (the folder does not exist); give the folder "
                "that holds config.json, or a Hugging Face hub id such as EleutherAI/pythia-160m"
            )
        if path.is_dir() and not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"no model at {pretrained}: the folder has no config.json; give the folder "
                "save_pretrained wrote"
            )
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(pretrained, "config.json"), str):
            raise ModelNotFoundError(
                f"no model at {pretrained}: it is not a local folder, and the hub is offline "
                "(HF_HUB_OFFLINE=1) with no cached copy; download it first or give a local folder"
            )
