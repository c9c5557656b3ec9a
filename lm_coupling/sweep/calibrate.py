"""Short calibration of a model's shape on a device, for the sweep's ``--plan``.

Nothing here loads a model's weights or builds a model of the planned size:
the shape comes from the model's config alone (``AutoConfig``: a local
folder's ``config.json`` or the hub's cached config), or, where no config can
be read (a hub model offline), from the study file.

- Forward, per token of a request: ``F = L (2 P_b + 2 T d) + 2 V d`` flops
  (``P_b = 4 d^2 + 3 d d_ff`` a block's matrix entries, attention over T/2
  keys on average, the head) at the device's measured GEMM rate
  (`device_rates`). Per generated token (batch b): ``max(F / rate, bytes of
  the weights / b / bandwidth)``, the weights read once per step.
- One layer's Jacobian: one block of the model's own width, feed-forward size
  and prompt length (up to ``BLOCK_TOKENS``), a vocabulary of at most
  ``BLOCK_VOCAB`` and random weights, timed by the package's
  ``JacobianEngine`` (its default route, K as the study asks): the median of
  ``JACOBIAN_REPEATS`` calls after a warm-up call. A shape wider than
  ``BLOCK_D`` is timed on a Llama block of width ``PROXY_D`` at up to
  ``PROXY_TOKENS`` tokens; the time is scaled by the ratio of
  ``d (2 P_b + 4 T d) + 4 d^3`` (d products of the block on one token against
  T keys, then the Gram matrix and its eigensolver) between the two shapes and
  prompts (an upper bound above d = 1024, where the engine's ``auto`` route
  takes Krylov steps). Across widths the law is used only there: between
  d = 256 and 576 on a CPU the engine's time grows about half as fast as this
  work (fixed costs per product; docs/sweep.md).
- Startup (`cached_startup_seconds`): a whole one-document run of the bundled
  demo model in a fresh process, what every model's process pays once,
  measured once per environment and kept in the user's cache.

So a plan costs seconds and megabytes whatever the models' sizes
(docs/sweep.md, "Named studies", states the factor it was checked within).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_coupling.sweep.spec import ModelEntry

BLOCK_D = 1024
"""The widest block built at a model's own width (wider: the proxy block, scaled)."""
BLOCK_TOKENS = 1024
"""The longest prompt of the block timed at a model's own width (longer: scaled)."""
PROXY_D = 256
"""Width of the block timed for a shape wider than ``BLOCK_D``."""
PROXY_TOKENS = 128
"""The longest prompt of the proxy block."""
BLOCK_VOCAB = 512
"""Vocabulary of the timed block's model (its head is no part of a layer's Jacobian)."""
JACOBIAN_REPEATS = 3
"""Timed calls of a block's Jacobian (their median is kept), after one warm-up call."""


@dataclass(frozen=True)
class Shape:
    """A model's sizes and where they were read (``source``: ``config`` or ``study file``)."""

    model_type: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab: int
    d_ff: int | None
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
            "study file",
        )
    text = config.get_text_config()
    d_ff = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
    return Shape(
        text.model_type,
        int(text.num_hidden_layers),
        int(text.hidden_size),
        int(text.num_attention_heads),
        int(text.vocab_size),
        int(d_ff) if d_ff else None,
        "config",
        config,
    )


def _block_work(d: int, d_ff: int) -> float:
    return 4 * d**2 + 3 * d * d_ff


def _jacobian_work(d: int, d_ff: int, tokens: int) -> float:
    return d * (2 * _block_work(d, d_ff) + 4 * tokens * d) + 4 * d**3


def calibrate(
    shape: Shape, device: str, tokens: int, batch: int, k: int, dtype: str = "float32"
) -> Calibration:
    """Seconds per request token, per generated token and per layer's Jacobian (see above)."""
    import torch

    from lm_coupling.plugins.specs import used_k

    flops_per_s, bytes_per_s = device_rates(device, dtype)
    d, V, L = shape.d_model, shape.vocab, shape.n_layers
    d_ff = shape.d_ff or 4 * d
    forward = (L * (2 * _block_work(d, d_ff) + 2 * tokens * d) + 2 * V * d) / flops_per_s
    element = torch.finfo(getattr(torch, dtype)).bits // 8
    weights = (L * _block_work(d, d_ff) + V * d) * element
    decode = max(forward, weights / max(1, batch) / bytes_per_s)
    timed, width, timed_tokens = block_jacobian(shape, device, dtype, tokens, k)
    timed_ff = d_ff if width == d else 4 * width
    ratio = _jacobian_work(d, d_ff, tokens) / _jacobian_work(width, timed_ff, timed_tokens)
    return Calibration(
        forward,
        decode,
        timed * ratio,
        tokens,
        batch,
        used_k(k, d),
        f"not built: {flops_per_s / 1e9:.3g} GFLOP/s and {bytes_per_s / 1e9:.3g} GB/s measured, "
        f"one block's Jacobian (d={width}, random weights) at {timed_tokens} tokens timed"
        + ("" if ratio == 1 else f" and scaled x{ratio:.3g}"),
    )


_RATES: dict[tuple, tuple[float, float]] = {}
_BLOCK: dict[tuple, tuple[float, int, int]] = {}


def device_rates(device: str, dtype: str) -> tuple[float, float]:
    """``(flops/s, bytes/s)`` of ``device``: a [512, 1024] x [1024, 4096] product, a 64 MB copy."""
    import torch

    key = (device, dtype)
    if key not in _RATES:
        torch_dtype = getattr(torch, dtype)
        a = torch.randn(512, 1024, device=device).to(torch_dtype)
        b = torch.randn(1024, 4096, device=device).to(torch_dtype)
        x = torch.empty(16 * 2**20, dtype=torch.float32, device=device)
        gemm = _median_seconds(lambda: a @ b, device)
        copied = _median_seconds(lambda: x.clone(), device)
        _RATES[key] = (2 * 512 * 1024 * 4096 / gemm, 2 * x.numel() * 4 / copied)
    return _RATES[key]


def block_jacobian(
    shape: Shape, device: str, dtype: str, tokens: int, k: int
) -> tuple[float, int, int]:
    """``(seconds, width, tokens)`` of one block's Jacobian as timed for ``shape`` (see above)."""
    import torch
    import transformers

    from lm_coupling.jacobian.engine import JacobianEngine
    from lm_coupling.model.architecture import locate_model_parts
    from lm_coupling.plugins.specs import used_k

    longest = getattr(shape.config, "max_position_embeddings", None)  # n_positions too (GPT-2)
    own = shape.d_model <= BLOCK_D
    width = shape.d_model if own else PROXY_D
    n = min(tokens, BLOCK_TOKENS if own else PROXY_TOKENS, int(longest) if longest else tokens)
    key = (shape.key if own else width, device, dtype, n, k)
    if key not in _BLOCK:
        config = _one_block_config(shape, n)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=getattr(torch, dtype)
            ).eval()
        parts = locate_model_parts(model)
        engine = JacobianEngine(model, parts, k_max=used_k(k, width))
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (n,), generator=generator).to(device)
        seconds = _median_seconds(lambda: engine.factors(ids), device, JACOBIAN_REPEATS)
        _BLOCK[key] = (seconds, width, n)
        del model, engine
    return _BLOCK[key]


def _one_block_config(shape: Shape, tokens: int):
    """One block of ``shape`` with a small vocabulary: its config's, else a Llama block."""
    vocab = min(shape.vocab, BLOCK_VOCAB)
    own = shape.d_model <= BLOCK_D
    if shape.config is not None and own:
        config = copy.deepcopy(shape.config)
        config.num_hidden_layers = 1
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:1]
        config.vocab_size = vocab
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value >= vocab:
                setattr(config, name, None)
        return config
    import transformers

    d, heads = (shape.d_model, shape.n_heads) if own else (PROXY_D, 4)
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=shape.d_ff if own and shape.d_ff else 4 * d,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(tokens + 1, 128),
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def _median_seconds(fn, device: str, repeats: int = 5) -> float:
    """The median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def startup_cache_path() -> Path:
    """Where the startup seconds are kept: lm-coupling's cache folder (`lm_coupling.fetch`)."""
    from lm_coupling.fetch import cache_dir

    return cache_dir() / "sweep_startup.json"


def _environment_key(metrics: str | None) -> str:
    """What the startup depends on: the interpreter, the packages' versions, the metrics."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    packages = ("lm-coupling", "lm_eval", "transformers", "torch", "datasets")
    return "|".join([sys.executable, *map(installed, packages), metrics or ""])


def cached_startup_seconds(metrics: str | None) -> tuple[float, bool]:
    """``(seconds, measured_now)``: `startup_seconds`, measured once per environment.

    The figure is kept in `startup_cache_path` under the environment's key
    (`_environment_key`). A cache that cannot be read or written is left
    alone (the figure is measured each time).
    """
    path, key = startup_cache_path(), _environment_key(metrics)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    if isinstance(known.get(key), (int, float)):
        return float(known[key]), False
    seconds = startup_seconds(metrics)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**known, key: seconds}, indent=1) + "\n")
    except OSError:
        pass
    return seconds, True


def startup_seconds(metrics: str | None) -> float:
    """Seconds a model's process costs beside its documents: a whole run of one document.

    A fresh ``python -m lm_coupling run`` of the bundled demo model on one
    bundled ``lmc_hellaswag_offline`` document, with the sweep's metrics:
    imports, lm-eval's task index, loading a model and a task, the metrics'
    set-up and writing the results, as each model of a sweep pays them once.

    Raises:
        RuntimeError: the run failed (its output's end in the message).
    """
    import tempfile

    from lm_coupling.demo.assets import bundled_model_path

    with tempfile.TemporaryDirectory(prefix="lmc_startup_") as tmp:
        command = [
            sys.executable, "-m", "lm_coupling", "run", "--model", "hf",
            "--model_args", f"pretrained={bundled_model_path()},dtype=float32",
            "--device", "cpu", "--tasks", "lmc_hellaswag_offline", "--limit", "1",
            "--output_path", tmp,
        ]  # fmt: skip
        if metrics:
            command += ["--metrics", metrics]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        env.pop("LM_COUPLING_DATA_DIR", None)  # the bundled sample documents
        start = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(
            "the startup calibration (a one-document lm-coupling run of the bundled model) "
            "failed:\n" + done.stdout[-1500:] + done.stderr[-1500:]
        )
    return seconds
