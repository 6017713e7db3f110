"""One exception tree for the SDK, and the one place that maps wire errors onto it.

    TrioError
    ├── ValidationError        bad input (also a ValueError)         HTTP 400/413/422
    ├── AuthenticationError    missing or wrong API key              HTTP 401
    ├── NotFoundError          unknown run, sampler, checkpoint      HTTP 404
    ├── CapacityError          over a limit or queue full            HTTP 429
    ├── ServerError            the service failed                    HTTP 5xx
    ├── ConnectionError        could not reach the service
    └── TimeoutError           no answer in time

Every error carries the ``request_id`` of the operation it belongs to, when known.
Client-side request validation also maps here (``validated``), so a bad argument
raises ``ValidationError`` at call time, before anything is sent.
"""

from __future__ import annotations

import builtins
import copy
from typing import Any, TypeVar

import pydantic

_M = TypeVar("_M", bound=pydantic.BaseModel)


class TrioError(Exception):
    """Base of every SDK error.

    Attributes:
        message: what went wrong, naming the field and value for bad input.
        request_id: the operation's id, when the service assigned one.
        status_code: the HTTP status (for an operation's failed outcome, and in-process,
            the status its category has over HTTP: 400, 401, 404, 429 or 500).
        retry_after: seconds the service asked to wait before retrying (``Retry-After``).
        seq_unused: the service refused the call without reading it (a body over its
            size limit), so the call's place in its run's order is free for the next one.
    """

    category = "server"

    def __init__(self, message: str, request_id: str | None = None, status_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.status_code = status_code
        self.retry_after: float | None = None
        self.seq_unused = False

    def __str__(self) -> str:
        return f"{self.message} (request_id={self.request_id})" if self.request_id else self.message


class ValidationError(TrioError, ValueError):
    category = "validation"


class AuthenticationError(TrioError):
    category = "authentication"


class NotFoundError(TrioError):
    category = "not_found"


class CapacityError(TrioError):
    category = "capacity"


class ServerError(TrioError):
    category = "server"


class ConnectionError(TrioError):  # noqa: A001 - the SDK's own, distinct from the builtin
    category = "connection"


class TimeoutError(TrioError, builtins.TimeoutError):  # noqa: A001
    """No answer in time: ``except TimeoutError`` (the builtin) catches it too."""

    category = "timeout"


_BY_CATEGORY = {cls.category: cls for cls in (ValidationError, AuthenticationError, NotFoundError, CapacityError, ServerError, ConnectionError, TimeoutError)}
_BY_STATUS = {400: ValidationError, 401: AuthenticationError, 403: AuthenticationError, 404: NotFoundError, 413: ValidationError, 422: ValidationError, 429: CapacityError}


_STATUS_BY_CATEGORY = {"validation": 400, "authentication": 401, "not_found": 404, "capacity": 429}


def error_from_category(category: str, message: str, request_id: str | None = None,
                        status: int | None = None) -> TrioError:
    status = status or _STATUS_BY_CATEGORY.get(category, 500)
    return _BY_CATEGORY.get(category, ServerError)(message, request_id, status)


def is_transient(exc: TrioError) -> bool:
    """Worth submitting again (same idempotency key): unreachable, overloaded, or a 5xx."""
    return isinstance(exc, ConnectionError | CapacityError | ServerError)


def error_from_status(status: int, message: str, request_id: str | None = None) -> TrioError:
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else ValidationError)
    return cls(message, request_id, status)


def describe_validation_error(exc: Any) -> str:
    """A pydantic ValidationError as 'field.path: message (got value)'."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(f"[{x}]" if isinstance(x, int) else str(x) for x in err["loc"]).replace(".[", "[")
        value = err.get("input")
        shown = type(value).__name__ if isinstance(value, dict | list) else repr(value)
        message = err["msg"].removeprefix("Value error, ")  # our validators' own messages
        if message.startswith(loc):  # they name the field themselves
            parts.append(message)
        else:
            parts.append(f"{loc}: {message} (got {shown[:80]})")
    return "; ".join(parts)


def validated(model: type[_M], **fields: Any) -> _M:
    """Build a request, turning a pydantic error into a ValidationError at call time.

    The request owns its values: a caller's object that changes after the call (an
    AdamParams reused with the next step's learning rate, set while this step waits its
    turn) does not change the call. Models among ``fields`` are validated again from a
    copy (pydantic would keep the caller's instance as it is, even if changed since it
    was built); ``data`` is copied datum by datum by its own validator.
    """
    try:
        return model(**{name: value if name == "data" else _own(value) for name, value in fields.items()})
    except pydantic.ValidationError as exc:
        raise ValidationError(describe_validation_error(exc)) from None


def _own(value: Any) -> Any:
    if isinstance(value, pydantic.BaseModel):
        return type(value).model_validate(value.model_dump())
    return copy.deepcopy(value)
