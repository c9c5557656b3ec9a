"""Getting states out of any Hugging Face causal LM: parts, hooks, Jacobians."""

from lm_coupling.capture.architecture import (
    ModelParts,
    block_output_hidden,
    locate_model_parts,
    register_override,
)
from lm_coupling.capture.collector import CaptureHandle, StateCollector, capture_prompt_states
from lm_coupling.capture.jacobian import JacobianEngine, naive_block_jacobians

__all__ = [
    "CaptureHandle",
    "JacobianEngine",
    "naive_block_jacobians",
    "StateCollector",
    "capture_prompt_states",
    "ModelParts",
    "block_output_hidden",
    "locate_model_parts",
    "register_override",
]
