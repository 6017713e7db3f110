"""The service's error type: what a client is told, with its category and HTTP status.

Categories are those of ``pytrio.errors`` (validation, not_found, authentication,
capacity, server); each front door maps them to its own wire shape.
"""

from __future__ import annotations

RESTART_MESSAGE = "the server restarted while this request was in flight; submit it again"


class ServiceError(Exception):
    """An error for the client: a category (see pytrio.errors) and an HTTP status."""

    def __init__(self, category: str, message: str, status: int = 400):
        super().__init__(message)
        self.category, self.message, self.status = category, message, status


def not_found(what: str) -> ServiceError:
    return ServiceError("not_found", f"{what} not found", 404)
