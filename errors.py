"""Errors a user can act on.

Every error outcore raises for bad input derives from :class:`OutcoreError`.
The CLI prints ``str(err)`` as one line on stderr and exits with code 2, so a
message must name the offending value and say what to do.
"""


class OutcoreError(Exception):
    """Base class for errors caused by input, configuration or environment."""


class ConfigError(OutcoreError):
    """A config value is missing, unknown or out of range."""


class ModelError(OutcoreError):
    """A model cannot be found or loaded."""


class DataError(OutcoreError):
    """Training data is missing, unreadable, malformed or empty."""


class BudgetError(OutcoreError):
    """A tier's byte budget cannot hold what is asked of it."""


class IntegrityError(OutcoreError):
    """Bytes read back do not match their checksum (corrupt or truncated file)."""


class SwapDirError(OutcoreError):
    """The swap directory is missing, locked, read-only or too small."""


class CheckpointError(OutcoreError):
    """A checkpoint is missing, incomplete or does not match the run."""
