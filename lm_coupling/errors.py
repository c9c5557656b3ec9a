"""Exceptions and warnings raised by lm-coupling."""


class LmCouplingError(Exception):
    """Base class of every error lm-coupling raises on purpose."""


class ConfigurationError(LmCouplingError, ValueError):
    """Bad command-line or option input; raised before any model loads."""


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
