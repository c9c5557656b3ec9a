"""Getting states out of any Hugging Face causal LM: parts, hooks, Jacobians."""

from lm_coupling.capture.collector import CaptureHandle, StateCollector
from lm_coupling.capture.lens import LogitLens
from lm_coupling.jacobian.engine import JacobianEngine, naive_block_jacobians
from lm_coupling.model.architecture import (
    ModelParts,
    block_output_hidden,
    locate_model_parts,
    register_override,
)

__all__ = [
    "CaptureHandle",
    "JacobianEngine",
    "naive_block_jacobians",
    "StateCollector",
    "LogitLens",
    "ModelParts",
    "block_output_hidden",
    "locate_model_parts",
    "register_override",
]
