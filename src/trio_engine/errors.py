"""The engine's own exceptions, in a module of their own so every engine module can raise
them without importing the host (which imports those modules)."""

from __future__ import annotations

import errno as errno_module


class InvalidInputError(ValueError):
    """Bad request data. ``index`` is the datum index (or None), ``field`` the field."""

    def __init__(self, message: str, index: int | None = None, field: str | None = None):
        super().__init__(message)
        self.index = index
        self.field = field


class NonFiniteLossError(InvalidInputError):
    """A datum's loss came out NaN or infinite: found after a pass rather than raised in
    it, so told apart from the errors a pass raises (``host._fails_alike``)."""


class AdapterNotFoundError(KeyError):
    """The adapter id names no adapter on this host."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint folder could not be written (disk full, read-only, ...). The previous
    checkpoint of that name, if any, is unchanged. ``reason`` says why, e.g. "No space
    left on device (ENOSPC)"; ``errno`` is the OS error number."""

    def __init__(self, folder: str, cause: OSError):
        code = errno_module.errorcode.get(cause.errno or 0, "")
        self.errno = cause.errno
        self.reason = f"{cause.strerror or cause}" + (f" ({code})" if code else "")
        super().__init__(f"writing checkpoint folder {folder!r} failed: {self.reason}; "
                         "the previous checkpoint of this name, if any, is unchanged")
