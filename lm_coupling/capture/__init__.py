"""Hooks scoped to one forward call, and lenses: the states plugins ask for, layer by layer."""

from lm_coupling.capture.collector import CaptureHandle, StateCollector
from lm_coupling.capture.lens import LogitLens, TransformLens

__all__ = ["CaptureHandle", "LogitLens", "StateCollector", "TransformLens"]
