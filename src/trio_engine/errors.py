"""The engine's own exceptions, in a module of their own so every engine module can raise
them without importing the host (which imports those modules)."""

from __future__ import annotations


class InvalidInputError(ValueError):
    """Bad request data. ``index`` is the datum index (or None), ``field`` the field."""

    def __init__(self, message: str, index: int | None = None, field: str | None = None):
        super().__init__(message)
        self.index = index
        self.field = field


class AdapterNotFoundError(KeyError):
    """The adapter id names no adapter on this host."""
