"""API keys: ``trio keys create`` prints a key once; the store keeps only its SHA-256.

Requests carry the key as ``Authorization: Bearer <key>`` (or ``X-API-Key``). Every
route except health needs one. ``--no-auth`` (localhost development only) maps every
request to one shared user: the embedded service's user (pytrio's LocalTransport), so
``trio serve --no-auth --data-dir ~/.cache/trio/embedded`` serves what an in-process
program trained (`make demo` ends with that command).
"""

from __future__ import annotations

from fastapi import Request

from .errors import ServiceError
from .store import Store

ANONYMOUS = "local"  # = pytrio.transport.local.LOCAL_USER (trio_server may not import it)


def api_key_from(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key")


def authenticate(store: Store, request: Request, enabled: bool) -> str:
    """The user id for this request, or a 401 ServiceError."""
    if not enabled:
        return ANONYMOUS
    key = api_key_from(request)
    if not key:
        raise ServiceError("authentication", "missing API key: send 'Authorization: Bearer <key>'", 401)
    user = store.user_for_key(key)
    if user is None:
        raise ServiceError("authentication", "invalid API key", 401)
    return user
