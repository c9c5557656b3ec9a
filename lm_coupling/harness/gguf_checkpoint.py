"""GGUF checkpoints (``gguf_file=`` in ``--model_args``), checked before the model loads.

transformers reads ``pretrained=<folder>,gguf_file=<file>`` (the file relative
to the folder, or absolute) with the ``gguf`` package and dequantizes every
tensor to float; the geometry is measured on that float model. `check_gguf`
refuses, with the fix, what would fail only after loading; the quantisation is
recorded (``config.lm_coupling.model_source``), so that a GGUF model is filed
under its file and quantisation (`lm_coupling.model_source`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lm_coupling.errors import ConfigurationError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file (llama.cpp's ggml/docs/gguf.md)."""

INSTALL_EXTRA = "pip install 'lm-coupling[gguf]'"
"""The install line that brings the GGUF reader (the ``gguf`` package)."""


def _first_bytes(path: Path) -> bytes:
    """The file's first 8 bytes (empty when it cannot be read)."""
    try:
        with path.open("rb") as fh:
            return fh.read(8)
    except OSError:
        return b""


def _local_folder(pretrained: Any) -> Path | None:
    if not isinstance(pretrained, str) or not pretrained:
        return None
    path = Path(pretrained).expanduser()
    return path if path.exists() else None


def check_pretrained_file(pretrained: Any) -> None:
    """Refuse ``pretrained=`` naming a file (lm-eval takes a folder or a hub id).

    Raises:
        ConfigurationError: a GGUF file (give its folder and ``gguf_file=``),
            or any other file (give the folder save_pretrained wrote).
    """
    path = _local_folder(pretrained)
    if path is None or not path.is_file():
        return
    if _first_bytes(path).startswith(GGUF_MAGIC):
        raise ConfigurationError(
            f"pretrained={pretrained} names a GGUF file; lm-eval's hf model loads one as "
            f"pretrained=<folder>,gguf_file=<file>: use pretrained={path.parent},"
            f"gguf_file={path.name}"
        )
    raise ConfigurationError(
        f"pretrained={pretrained} is a file, not a model: give the folder save_pretrained "
        "wrote (with config.json and the weights), a hub id, or for a GGUF file "
        "pretrained=<folder>,gguf_file=<file.gguf>"
    )


def gguf_path(model_args: Mapping[str, Any]) -> Path | None:
    """The local GGUF file ``model_args`` name, or None (no ``gguf_file=``, or a hub repo)."""
    name = model_args.get("gguf_file")
    if not name:
        return None
    file = Path(str(name)).expanduser()
    if file.is_absolute():
        return file
    folder = _local_folder(model_args.get("pretrained"))
    return None if folder is None else folder / file


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return ""


def _readable(gguf: Any, type_name: str) -> bool:
    """Whether the installed gguf dequantizes this tensor type (what transformers calls)."""
    import numpy as np

    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        gguf.dequantize(np.zeros(0, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    except Exception:  # implemented; an empty block array only fails its reshape
        return True
    return True


def read_header(gguf: Any, path: Path) -> dict[str, Any]:
    """Read a GGUF file's header with the ``gguf`` module (memory-mapped, no weights loaded).

    Returns:
        The results' ``config.lm_coupling.model_source`` entry
        (`lm_coupling.model_source`): ``format`` (``"gguf"``), ``file``,
        ``quantization`` (the type most of its matrices, tensors of two or more
        dimensions, are stored in, e.g. ``Q4_1``), ``architecture``
        (``general.architecture``) and ``tensor_types`` (each type's count).

    Raises:
        ConfigurationError: not a GGUF file, or an unreadable header.
    """
    first = _first_bytes(path)
    if not first.startswith(GGUF_MAGIC):
        raise ConfigurationError(
            f"{path} is not a GGUF file (it starts with {first!r}, not "
            f"{GGUF_MAGIC!r}): gguf_file= takes a llama.cpp GGUF file; for a safetensors or "
            "PyTorch checkpoint drop gguf_file= and give pretrained=<the folder with config.json>"
        )
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # a truncated or corrupt file: the reader's own words
        raise ConfigurationError(
            f"{path} starts like a GGUF file but cannot be read ({type(exc).__name__}: {exc}); "
            "download it again"
        ) from exc
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    matrices = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
    quantization = (matrices or counts).most_common(1)[0][0] if counts else "none"
    return {
        "format": "gguf",
        "file": str(path),
        "quantization": quantization,
        "architecture": architecture,
        "tensor_types": dict(sorted(counts.items())),
    }


# transformers' GGUF loader (``load_gguf_checkpoint`` in modeling_gguf_pytorch_utils,
# transformers 4.56-5.24) maps these llama.cpp architecture names before it looks them up.
_TRANSFORMERS_RENAMES = (
    ("qwen2moe", "qwen2_moe"),
    ("qwen3moe", "qwen3_moe"),
    ("gpt-oss", "gpt_oss"),
    ("minimax-m2", "minimax_m2"),
    ("t5", "t5"),  # t5, t5encoder and umt5 files are all read as T5 (or UMT5)
)


def transformers_architectures() -> tuple[str, ...]:
    """The GGUF architectures the installed transformers builds a model from, sorted.

    The keys of its GGUF config mapping (``transformers.integrations.ggml``,
    what ``GGUF_SUPPORTED_ARCHITECTURES`` lists) less ``general``, which
    names no architecture.
    """
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return tuple(sorted(name for name in GGUF_CONFIG_MAPPING if name != "general"))


def check_architecture(header: Mapping[str, Any]) -> None:
    """Refuse a GGUF file whose architecture transformers cannot load (after its renames).

    Raises:
        ConfigurationError: the architecture is missing or not supported, named.
    """
    supported = transformers_architectures()
    name = header["architecture"]
    renamed = next((new for old, new in _TRANSFORMERS_RENAMES if old in name), name)
    if name in supported or renamed in supported:
        return
    import transformers

    what = (
        "has no general.architecture field"
        if name == "unknown"
        else f"is a GGUF file of architecture {name!r} (its general.architecture)"
    )
    raise ConfigurationError(
        f"{header['file']} {what}, "
        f"so transformers {transformers.__version__} cannot load it from GGUF; it reads "
        f"{', '.join(supported)}. Use the model's safetensors checkpoint instead "
        "(pretrained=<folder or hub id>, no gguf_file=), or a transformers release that "
        "lists this architecture"
    )


def check_gguf(model_args: Mapping[str, Any]) -> dict[str, Any] | None:
    """Check a ``gguf_file=`` checkpoint before the model loads: its header (`read_header`).

    None without ``gguf_file=``.

    A hub repository's GGUF (``pretrained=org/name`` and a relative
    ``gguf_file``) is left to lm-eval once the reader is known to be there.

    Raises:
        ConfigurationError: no gguf package, ``pretrained=`` naming a file, a
            file that is not GGUF, an architecture transformers cannot load
            from GGUF, or a tensor type the installed gguf cannot dequantize
            (Q8_1, Q8_K, the integer types, F64 in gguf 0.19).
        ModelNotFoundError: the file is missing (the folder's GGUF files listed).
    """
    check_pretrained_file(model_args.get("pretrained"))
    if not model_args.get("gguf_file"):
        return None
    try:
        import gguf
    except ImportError as exc:
        raise ConfigurationError(
            "gguf_file= needs the GGUF reader, the gguf package, which is not installed: "
            f"{INSTALL_EXTRA} (transformers reads GGUF files through it)"
        ) from exc
    path = gguf_path(model_args)
    if path is None:
        return None
    if not path.is_file():
        found = sorted(p.name for p in path.parent.glob("*.gguf")) if path.parent.is_dir() else []
        raise ModelNotFoundError(
            f"no GGUF file at {path}: gguf_file= is taken relative to pretrained= (or give its "
            f"absolute path); GGUF files in {path.parent}: {', '.join(found) or 'none'}"
        )
    header = read_header(gguf, path)
    check_architecture(header)
    unreadable = sorted(name for name in header["tensor_types"] if not _readable(gguf, name))
    if unreadable:
        raise ConfigurationError(
            f"{path} stores tensors as {', '.join(unreadable)}, which the installed gguf "
            f"{_version()} cannot dequantize (transformers loads GGUF "
            "files through gguf.dequantize); convert the file to a type it reads (F32, F16, "
            "BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants Q2_K..Q6_K) with llama.cpp's "
            "llama-quantize, or use the float checkpoint"
        )
    return header
