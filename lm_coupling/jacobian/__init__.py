"""The block-Jacobian engine: replays, routes, Krylov and the linear algebra."""
