"""Errors a user can fix, reported as one readable line."""


class DataError(ValueError):
    """Bad input data or data settings.

    The message is one line that names the file (and line) at fault and says how to fix it; the CLI
    prints ``str(err)`` and nothing else, so it must stand on its own.
    """


class SetupError(ValueError):
    """A trainer setting this machine cannot run (a precision, a device); the message names the fix."""


class CheckpointError(ValueError):
    """A checkpoint path that does not exist or holds no checkpoint; the message says what to do."""
