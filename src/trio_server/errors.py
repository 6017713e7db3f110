"""The service's error type: what a client is told, with its category and HTTP status.

Categories are those of ``pytrio.errors`` (validation, not_found, authentication,
capacity, server); each front door maps them to its own wire shape.
"""

from __future__ import annotations

import math

RESTART_MESSAGE = "the server restarted while this request was in flight; submit it again"
HOST_RESTART_MESSAGE = "the model host restarted while this request was in flight; submit it again"


class DataDirInUse(RuntimeError):
    """Another service holds the data dir (``core.lock_data_dir``)."""


class ServiceError(Exception):
    """An error for the client: a category (see pytrio.errors) and an HTTP status."""

    def __init__(self, category: str, message: str, status: int = 400, retry_after: float | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.category, self.message, self.status = category, message, status
        self.retry_after = retry_after  # seconds; front doors send it as Retry-After (429)
        self.headers = headers or {}  # more for the reply (a 405's Allow)

    def reply_headers(self) -> dict[str, str]:
        return retry_after_headers(self.retry_after) | self.headers


class HostRestarted(ServiceError):
    """The model host (a Ray actor) died during the call: it may have stopped anywhere,
    and the call's run lost what the host held (``handlers`` counts a forward_backward
    so, as the run's answered calls since its step are: its next step is refused)."""

    def __init__(self, method: str = "") -> None:
        if method in ("forward_backward", "optim_step"):
            # what then happens (handlers: the run's next step is refused, dropping calls made
            # since), so that doing as told works: a resent call alone would be refused again
            message = (f"the model host restarted during this {method}, and the gradients of the run's "
                       "forward_backward calls since its last step went with it: the run's next optim_step "
                       "is refused; after that, run those calls again, then optim_step")
        else:
            message = HOST_RESTART_MESSAGE
        super().__init__("server", message, 500)


def over_capacity(name: str, what: str, pending: int, limit: int, retry_after: float,
                  asked: int = 1) -> ServiceError:
    """A 429: ``asked`` more requests would pass the ``limit`` on pending ones; retrying
    later (same key) will pass."""
    needs = f" and this call needs {asked} more" if asked > 1 else ""
    return ServiceError("capacity", f"capacity {name}: {pending} {what} pending{needs}, the limit is {limit}; "
                        f"retry in {retry_after:g} s", 429, retry_after)


def retry_after_headers(retry_after: float | None) -> dict[str, str]:
    """``Retry-After`` in whole seconds (as HTTP defines it) and ``retry-after-ms`` (which
    the tinker and OpenAI SDKs read first, for sub-second waits)."""
    if retry_after is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(retry_after))), "retry-after-ms": str(int(retry_after * 1000))}


def check_quota(name: str, what: str, used: int, limit: int, remedy: str) -> None:
    """A 403 (category validation: retrying will not help) when ``used`` reached ``limit``."""
    if used >= limit:
        raise ServiceError("validation", f"quota {name}: this user has {used} {what}, the limit is {limit}; "
                           f"{remedy}", 403)


def not_found(what: str) -> ServiceError:
    return ServiceError("not_found", f"{what} not found", 404)
