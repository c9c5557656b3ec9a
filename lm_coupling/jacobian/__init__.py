"""The block-Jacobian engine: replays, routes, Krylov and the linear algebra."""

from lm_coupling.jacobian.engine import JacobianEngine, naive_block_jacobians

__all__ = ["JacobianEngine", "naive_block_jacobians"]
