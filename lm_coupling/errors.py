"""Exceptions and warnings raised by lm-coupling.

Every error lm-coupling raises on purpose is an `LmCouplingError`, so a
notebook can catch them all with one ``except``; the command lines turn them
into exit code 2. All are importable from ``lm_coupling``.
"""


class LmCouplingError(Exception):
    """Base class of every error lm-coupling raises on purpose."""


class ConfigurationError(LmCouplingError, ValueError):
    """Bad command-line or option input; raised before any model loads."""


class ModelNotFoundError(ConfigurationError):
    """No model at the path or hub id given (raised before lm-eval indexes its tasks)."""


class ConcurrentRunError(LmCouplingError, RuntimeError):
    """Another evaluation is running in this process (one at a time per process)."""


class UnsupportedModelError(LmCouplingError, ValueError):
    """The model's blocks, final norm or unembedding could not be located."""


class DataUnavailableError(LmCouplingError):
    """A task's documents cannot be read (hub unreachable offline, empty data file)."""


class PluginError(LmCouplingError):
    """A metric plugin is broken: duplicate name, bad hook, failed import."""


class GeometryWarning(UserWarning):
    """A document's geometry is undefined (NaN); the run goes on."""


class EngineFallbackWarning(UserWarning):
    """The Jacobian engine took a slower route than usual; the message names the cause."""
