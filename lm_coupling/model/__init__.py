"""The anatomy of any Hugging Face causal LM: its parts, the float32 read-out, block calls."""

from lm_coupling.model.architecture import (
    ModelParts,
    block_output_hidden,
    locate_model_parts,
    register_override,
)

__all__ = ["ModelParts", "block_output_hidden", "locate_model_parts", "register_override"]
