"""The name a GGUF checkpoint is filed under: its file and its quantisation.

A GGUF model is loaded as ``pretrained=<folder>,gguf_file=<file>``; filed
under ``<folder>`` alone it would merge with a float checkpoint saved in the
same folder, or with another quantisation of it. The results record the file
and its quantisation (``config.lm_coupling.model_source``, written by the
run from the file's header, `lm_coupling.harness.gguf_checkpoint`); the
geometry file and the report name such a model by the file's path, and its
dtype by the quantisation (``gguf:Q4_1``): the weights' storage, while every
state is computed in float32 as for any model (docs/design.md).

Pure: imports neither torch nor gguf (the report reads it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GGUF_DTYPE_PREFIX = "gguf:"


def source_of(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``config.lm_coupling.model_source`` of a results file, when it is a GGUF record."""
    lmc = config.get("lm_coupling") or {}
    source = lmc.get("model_source") if isinstance(lmc, Mapping) else None
    if isinstance(source, Mapping) and source.get("format") == "gguf" and source.get("file"):
        return source
    return None


def filed_name(config: Mapping[str, Any], default: Any) -> Any:
    """The model's name: the GGUF file's path for a GGUF checkpoint, else ``default``."""
    source = source_of(config)
    return str(source["file"]) if source is not None else default


def filed_dtype(config: Mapping[str, Any], default: Any) -> Any:
    """The model's dtype column: ``gguf:<quantisation>`` for a GGUF checkpoint, else ``default``."""
    source = source_of(config)
    if source is None:
        return default
    return f"{GGUF_DTYPE_PREFIX}{source.get('quantization', 'unknown')}"
