"""Short calibration of a model's shape on a device, for the sweep's ``--plan``.

Nothing here loads a model's weights or builds a model of the planned size:
the shape comes from the model's config alone (``AutoConfig``: a local
folder's ``config.json`` or the hub's cached config), or, where no config can
be read (a hub model offline), from the study file. What is timed on the
device is a small model with random weights:

- a shape within ``PROXY_D`` (width), ``PROXY_VOCAB`` (vocabulary) and
  ``FULL_BUILD_PARAMS`` is built whole at its own sizes and timed as it is:
  a forward pass of ``batch`` sequences of ``tokens`` tokens (seconds per
  token of a request), of one token (seconds per generated token), and one
  block's Jacobian by the package's ``JacobianEngine`` (its default route,
  K as the study asks) at the last of ``tokens`` tokens (seconds per layer);
- a larger shape is not built: its time is its floating-point work at the
  device's measured rates (a GEMM and a memory copy, `device_rates`); one
  layer's Jacobian is timed on one block of the model's own width when
  ``d <= REAL_BLOCK_D`` (`block_jacobian`: one block, a small vocabulary,
  the engine's exact route, the study's prompt length up to
  ``REAL_BLOCK_TOKENS``), else on one ``PROXY_D``-wide block
  (`proxy_jacobian`) scaled by the ratio of their work (`_calibrate_proxy`).
  Each Jacobian figure is the median of ``JACOBIAN_REPEATS`` calls after a
  warm-up call at the same prompt.

So a plan costs seconds and megabytes whatever the models' sizes
(docs/sweep.md, "Named studies", states the factor it was checked within).
Downloads, loading the model's own weights and the metrics other than the
Jacobian ones are not in it; ``startup_seconds`` times what every model's
process pays once (a whole one-document run of a tiny model), measured once
per environment and kept in the user's cache (``startup_cache_path``).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_coupling.sweep.spec import ModelEntry

FULL_BUILD_PARAMS = 20_000_000
"""A shape of at most this many parameters (and within the proxy's sizes) is timed whole."""
PROXY_D = 256
"""Width of the block whose Jacobian is timed for a larger shape."""
PROXY_VOCAB = 8192
"""The largest vocabulary of a shape built whole."""
PROXY_TOKENS = 128
"""The longest prompt of the timed proxy block."""
REAL_BLOCK_D = 1024
"""The widest shape whose Jacobian is timed on one block of its own width (see `block_jacobian`)."""
REAL_BLOCK_TOKENS = 1024
"""The longest prompt of the block timed at the model's own width (longer: scaled by the law)."""
BLOCK_VOCAB = 512
"""Vocabulary of that block's model (its head is no part of a layer's Jacobian)."""
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
    if is_whole(shape):
        return _calibrate_built(shape, device, tokens, batch, k, dtype, shape.n_layers)
    return _calibrate_proxy(shape, device, tokens, batch, k, dtype)


def is_whole(shape: Shape) -> bool:
    """Whether ``shape`` is timed at its own sizes (else on a proxy, module docstring)."""
    return (
        shape.d_model <= PROXY_D
        and shape.vocab <= PROXY_VOCAB
        and param_count(shape) <= FULL_BUILD_PARAMS
    )


def _calibrate_built(shape, device, tokens, batch, k, dtype, layers) -> Calibration:
    """Time a model of ``shape`` with ``layers`` blocks, built whole (random weights)."""
    import torch

    from lm_coupling.plugins.specs import used_k

    longest = getattr(shape.config, "max_position_embeddings", None) or getattr(
        shape.config, "n_positions", None
    )
    tokens = min(tokens, int(longest)) if longest else tokens  # a model of short context
    ids = _ids(shape.vocab, batch, tokens, device)
    model, parts = _build(shape, layers, tokens, device, getattr(torch, dtype))
    forward = _timed_forward(model, ids, device)
    decode = _timed_forward(model, ids[:, :1], device)
    jacobian = _timed_jacobian(model, parts, ids, k, shape.d_model, device)
    del model
    return Calibration(
        forward / (batch * tokens),
        decode / batch,
        jacobian,
        tokens,
        batch,
        used_k(k, shape.d_model),
        f"all {layers} blocks built, random weights",
    )


def _calibrate_proxy(shape, device, tokens, batch, k, dtype) -> Calibration:
    """Seconds of a larger shape from its floating-point work and the device's measured rates.

    Forward, per token of a request: ``F = L (2 P_b + 2 T d) + 2 V d`` flops
    (``P_b = 4 d^2 + 3 d d_ff`` a block's matrix entries, attention over T/2
    keys on average, the head) at the device's measured GEMM rate. Per
    generated token (batch b): ``max(F_1 / rate, bytes of the weights / b /
    bandwidth)``, the weights read once per step. One layer's Jacobian: the
    time of one block of the model's own width and feed-forward size
    (`block_jacobian`) where ``d <= REAL_BLOCK_D``, else of a proxy block
    (width ``PROXY_D``), scaled by the ratio of ``d (2 P_b + 4 T d) + 4 d^3``
    (d products of the block on one token against T keys, then the Gram
    matrix and its eigensolver) at the two shapes and prompts; ``auto``
    takes a cheaper Krylov route above d = 1024, so this is an upper bound
    there. The law is used across widths only above ``REAL_BLOCK_D``: on a
    CPU at d = 256 to 576 the engine's per-layer time grows about half as
    fast as this work (fixed costs per product), so scaling the d = 256
    block's time overestimated SmolLM2's (d = 576) by 2x at load 1 and by
    5x at load 10, where a single timed call of ~30 ms, multiplied by the
    ratio (8.8), also carried the load's noise (docs/sweep.md).
    """
    import torch

    from lm_coupling.plugins.specs import used_k

    flops_per_s, bytes_per_s = device_rates(device, dtype)
    d, V, L = shape.d_model, shape.vocab, shape.n_layers
    d_ff = shape.d_ff or 4 * d

    def block(width: int, ff: int) -> float:
        return 4 * width**2 + 3 * width * ff

    forward = (L * (2 * block(d, d_ff) + 2 * tokens * d) + 2 * V * d) / flops_per_s
    element = torch.finfo(getattr(torch, dtype)).bits // 8
    weights = (L * block(d, d_ff) + V * d) * element
    decode = max(forward, weights / max(1, batch) / bytes_per_s)

    def jacobian_flops(width: int, ff: int, T: int) -> float:
        return width * (2 * block(width, ff) + 4 * T * width) + 4 * width**3

    if d <= REAL_BLOCK_D:
        timed, timed_tokens = block_jacobian(shape, device, dtype, tokens, k)
        ratio = jacobian_flops(d, d_ff, tokens) / jacobian_flops(d, d_ff, timed_tokens)
        how = f"one block's Jacobian (d={d}, random weights) at {timed_tokens} tokens timed"
    else:
        timed, timed_tokens = proxy_jacobian(device, dtype, tokens, k)
        ratio = jacobian_flops(d, d_ff, tokens) / jacobian_flops(PROXY_D, 4 * PROXY_D, timed_tokens)
        how = f"a d={PROXY_D} block's Jacobian at {timed_tokens} tokens timed and scaled"
    return Calibration(
        forward,
        decode,
        timed * ratio,
        tokens,
        batch,
        used_k(k, d),
        f"not built: {flops_per_s / 1e9:.3g} GFLOP/s and {bytes_per_s / 1e9:.3g} GB/s measured, "
        + how,
    )


_RATES: dict[tuple, tuple[float, float]] = {}
_PROXY: dict[tuple, tuple[float, int]] = {}
_BLOCK: dict[tuple, tuple[float, int]] = {}


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
        copy = _median_seconds(lambda: x.clone(), device)
        _RATES[key] = (2 * 512 * 1024 * 4096 / gemm, 2 * x.numel() * 4 / copy)
    return _RATES[key]


def proxy_jacobian(device: str, dtype: str, tokens: int, k: int) -> tuple[float, int]:
    """``(seconds, tokens)`` of one block's Jacobian of a d=``PROXY_D`` Llama-like proxy."""
    import torch

    n = min(tokens, PROXY_TOKENS)
    key = (device, dtype, n, k)
    if key not in _PROXY:
        proxy = Shape("llama", 1, PROXY_D, 4, 512, 4 * PROXY_D, None, "proxy")
        model, parts = _build(proxy, 1, n, device, getattr(torch, dtype))
        ids = _ids(proxy.vocab, 1, n, device)
        _PROXY[key] = (_timed_jacobian(model, parts, ids, k, PROXY_D, device), n)
        del model
    return _PROXY[key]


def block_jacobian(shape: Shape, device: str, dtype: str, tokens: int, k: int) -> tuple[float, int]:
    """``(seconds, tokens)`` of one block's Jacobian at ``shape``'s width, one block built.

    The model's config (or the recorded shape's) with one block and a
    vocabulary of at most ``BLOCK_VOCAB``, random weights, timed by the
    engine as it runs (`_timed_jacobian`) at the last of ``min(tokens,
    REAL_BLOCK_TOKENS)`` tokens (and no more than the model's positions): the
    prompt's length matters more than the work law says (d = 768, K = 76, on
    a CPU: 654 tokens took 1.9x the seconds of 128, the law says 1.08x).
    """
    import torch

    longest = getattr(shape.config, "max_position_embeddings", None) or getattr(
        shape.config, "n_positions", None
    )
    n = min(tokens, REAL_BLOCK_TOKENS, int(longest) if longest else tokens)
    key = (shape.key, device, dtype, n, k)
    if key not in _BLOCK:
        vocab = min(shape.vocab, BLOCK_VOCAB)
        small = dataclasses.replace(shape, vocab=vocab, config=_small_vocab(shape.config, vocab))
        model, parts = _build(small, 1, n, device, getattr(torch, dtype))
        ids = _ids(vocab, 1, n, device)
        _BLOCK[key] = (_timed_jacobian(model, parts, ids, k, shape.d_model, device), n)
        del model
    return _BLOCK[key]


def _small_vocab(config, vocab: int):
    """A copy of ``config`` (None stays None) with ``vocab`` tokens and no special id beyond it."""
    import copy

    if config is None:
        return None
    config = copy.deepcopy(config)
    config.vocab_size = vocab
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= vocab:
            setattr(config, name, None)
    return config


def _median_seconds(fn, device: str, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _ids(vocab: int, batch: int, tokens: int, device: str):
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, tokens), generator=generator).to(device)


def _timed_jacobian(model, parts, ids, k: int, d_model: int, device: str) -> float:
    """Seconds of one block's top-K factors at the last of ``ids[0]``'s tokens.

    The median of ``JACOBIAN_REPEATS`` calls after a warm-up call on the same
    prompt (the route, the replay's probes and the first call's allocations
    are not a layer's work; one call of tens of milliseconds on a loaded
    machine is mostly noise).
    """
    from lm_coupling.jacobian.engine import JacobianEngine
    from lm_coupling.plugins.specs import used_k

    one_block = dataclasses.replace(parts, blocks=parts.blocks[:1])
    engine = JacobianEngine(model, one_block, k_max=used_k(k, d_model))
    engine.factors(ids[0])  # warm-up: route, replay probes, first allocations
    times = []
    for _ in range(JACOBIAN_REPEATS):
        _sync(device)
        start = time.perf_counter()
        engine.factors(ids[0])
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


STARTUP_CACHE_ENV = "LM_COUPLING_CACHE_DIR"
"""Folder of the measured startup seconds (default ``$XDG_CACHE_HOME/lm_coupling``)."""


def startup_cache_path() -> Path:
    """Where the startup seconds are kept: ``$LM_COUPLING_CACHE_DIR`` or the user's cache."""
    import os

    folder = os.environ.get(STARTUP_CACHE_ENV)
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        folder = str(Path(base) / "lm_coupling")
    return Path(folder) / "sweep_startup.json"


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


def cached_startup_seconds(metrics: str | None, refresh: bool = False) -> tuple[float, bool]:
    """``(seconds, measured_now)``: `startup_seconds`, measured once per environment.

    The figure is kept in `startup_cache_path` under the environment's key
    (`_environment_key`); ``refresh`` measures it again. A cache that cannot
    be read or written is left alone (the figure is measured each time).
    """
    import json

    path, key = startup_cache_path(), _environment_key(metrics)
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if not refresh and isinstance(known.get(key), (int, float)):
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
