"""Short calibration of a model's shape on a device, for the sweep's ``--plan``.

Nothing here loads a model's weights: the shape comes from the model's config
alone (``AutoConfig``: a local folder's ``config.json`` or the hub's cached
config), or, where no config can be read (a hub model offline), from the
study file; the model is then built from that config with random weights on
the device and timed:

- a forward pass of ``batch`` sequences of ``tokens`` tokens (seconds per
  token of a request) and of one token (seconds per generated token);
- one block's Jacobian by the package's ``JacobianEngine`` (its default route,
  K as the study asks) at the last of ``tokens`` tokens (seconds per layer).

A model of at most ``FULL_BUILD_PARAMS`` parameters is built whole; a larger
one twice, with one and with two blocks, and the forward pass of L blocks is
extrapolated as ``t_1 + (L - 1) (t_2 - t_1)``.
Downloads, loading the model's own weights and the metrics other than the
Jacobian ones are not in it; ``startup_seconds`` times what every model's
process pays once (a whole one-document run of a tiny model).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from lm_coupling.sweep.spec import ModelEntry

FULL_BUILD_PARAMS = 300_000_000


@dataclass(frozen=True)
class Shape:
    """A model's sizes and where they were read (``source``: ``config`` or ``study file``)."""

    model_type: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab: int
    d_ff: int | None
    params: float | None
    source: str
    config: Any = None

    @property
    def key(self) -> tuple:
        """What the calibration depends on (models of one key share it)."""
        return (self.model_type, self.n_layers, self.d_model, self.n_heads, self.vocab, self.d_ff)


@dataclass(frozen=True)
class Calibration:
    """Seconds measured on the device for one shape."""

    forward_per_token: float
    decode_per_token: float
    jacobian_per_layer: float
    tokens: int
    batch: int
    k: int
    layers_built: str


def shape_of(entry: ModelEntry, recorded: dict[str, Any]) -> Shape:
    """``entry``'s shape from its config; from ``recorded`` (the study's) when none is readable.

    Raises:
        ValueError: no readable config and no complete recorded shape.
    """
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(entry.name, revision=entry.revision)
    except (OSError, ValueError) as exc:
        missing = [k for k in ("n_layers", "d_model", "n_heads", "vocab") if k not in recorded]
        if missing:
            raise ValueError(
                f"{entry.label}: no config could be read ({type(exc).__name__}) and the study "
                f"records no shape ({', '.join(missing)} missing)"
            ) from exc
        return Shape(
            str(recorded.get("model_type", "llama")),
            int(recorded["n_layers"]),
            int(recorded["d_model"]),
            int(recorded["n_heads"]),
            int(recorded["vocab"]),
            int(recorded["d_ff"]) if recorded.get("d_ff") else None,
            float(recorded["params"]) if recorded.get("params") else None,
            "study file",
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d_ff = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
    return Shape(
        text.model_type,
        int(text.num_hidden_layers),
        int(text.hidden_size),
        int(text.num_attention_heads),
        int(text.vocab_size),
        int(d_ff) if d_ff else None,
        None,
        "config",
        config,
    )


def _config_with_layers(shape: Shape, layers: int, tokens: int):
    """The model's config (or one built from the recorded shape) with ``layers`` blocks."""
    import copy

    from lm_coupling.demo.tiny import ARCHITECTURES, tiny_config

    if shape.config is not None:
        config = copy.deepcopy(shape.config)
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:layers]
        return config
    model_type = shape.model_type if shape.model_type in ARCHITECTURES else "llama"
    return tiny_config(
        model_type,
        shape.vocab,
        d_model=shape.d_model,
        n_layers=layers,
        n_heads=shape.n_heads,
        d_ff=shape.d_ff,
        max_len=max(tokens + 1, 128),
    )


def _build(shape: Shape, layers: int, tokens: int, device: str, dtype):
    import torch
    import transformers

    from lm_coupling.model.architecture import locate_model_parts

    torch.manual_seed(0)
    config = _config_with_layers(shape, layers, tokens)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, locate_model_parts(model)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _timed_forward(model, ids, device: str, repeats: int = 3) -> float:
    import torch

    with torch.no_grad():
        model(ids)  # warm-up
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            model(ids)
            _sync(device)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def param_count(shape: Shape) -> float:
    """Parameters: the recorded count, else ``12 L d^2 + 2 V d`` (a GPT block's count)."""
    if shape.params:
        return shape.params
    return 12 * shape.n_layers * shape.d_model**2 + 2 * shape.vocab * shape.d_model


def calibrate(
    shape: Shape, device: str, tokens: int, batch: int, k: int, dtype: str = "float32"
) -> Calibration:
    """Time a forward pass and one block's Jacobian at ``shape`` on ``device`` (see above)."""
    import torch

    from lm_coupling.jacobian.engine import JacobianEngine
    from lm_coupling.plugins.specs import used_k

    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (batch, tokens), generator=generator).to(device)
    one = ids[:, :1]
    whole = param_count(shape) <= FULL_BUILD_PARAMS or shape.n_layers <= 2
    if whole:
        model, parts = _build(shape, shape.n_layers, tokens, device, torch_dtype)
        forward = _timed_forward(model, ids, device)
        decode = _timed_forward(model, one, device)
        built = f"all {shape.n_layers} blocks"
    else:
        small, _ = _build(shape, 1, tokens, device, torch_dtype)
        f1, d1 = _timed_forward(small, ids, device), _timed_forward(small, one, device)
        del small
        model, parts = _build(shape, 2, tokens, device, torch_dtype)
        f2, d2 = _timed_forward(model, ids, device), _timed_forward(model, one, device)
        extra = shape.n_layers - 1
        forward = f1 + extra * max(f2 - f1, 0.0)
        decode = d1 + extra * max(d2 - d1, 0.0)
        built = "1 and 2 blocks, extrapolated"
    one_block = dataclasses.replace(parts, blocks=parts.blocks[:1])
    engine = JacobianEngine(model, one_block, k_max=used_k(k, shape.d_model))
    engine.factors(ids[0, : min(tokens, 4)])  # warm-up: route and replay probes
    _sync(device)
    start = time.perf_counter()
    engine.factors(ids[0])
    _sync(device)
    jacobian = time.perf_counter() - start
    del model, engine
    return Calibration(
        forward / (batch * tokens),
        decode / batch,
        jacobian,
        tokens,
        batch,
        used_k(k, shape.d_model),
        built,
    )


def startup_seconds(metrics: str | None) -> float:
    """Seconds a model's process costs beside its documents: a whole run of one document.

    A fresh ``python -m lm_coupling run`` of a tiny random GPT-2 (saved here) on
    one bundled ``lmc_hellaswag_offline`` document, with the sweep's metrics:
    imports, lm-eval's task index, loading a model and a task, the metrics'
    set-up and writing the results, as each model of a sweep pays them once.

    Raises:
        RuntimeError: the run failed (its output's end in the message).
    """
    import json
    import os
    import tempfile
    from pathlib import Path

    from lm_coupling.demo.tiny import save_tiny_model, train_tokenizer

    samples = Path(__file__).resolve().parents[1] / "demo" / "sample_tasks"
    with tempfile.TemporaryDirectory(prefix="lmc_startup_") as tmp:
        model = save_tiny_model(Path(tmp) / "model", "gpt2", train_tokenizer())
        command = [
            sys.executable, "-m", "lm_coupling", "run", "--model", "hf",
            "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
            "--tasks", "lmc_hellaswag_offline", "--limit", "1",
            "--metadata", json.dumps({"lmc_data_dir": str(samples)}),
            "--output_path", str(Path(tmp) / "out"),
        ]  # fmt: skip
        if metrics:
            command += ["--metrics", metrics]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        start = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(
            "the startup calibration (a one-document lm-coupling run of a tiny model) failed:\n"
            + done.stdout[-1500:]
            + done.stderr[-1500:]
        )
    return seconds
