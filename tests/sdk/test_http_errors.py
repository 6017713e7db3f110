"""HttpTransport's error mapping and request shape, against ``httpx.MockTransport``.

Every HTTP failure becomes one class of ``pytrio.errors``: the service's own
``{"error": {"category", "message"}}`` bodies by category, anything else (a proxy's HTML,
an empty body, FastAPI's default 404) by status. Network failures become the SDK's
ConnectionError / TimeoutError with the httpx exception chained. No network, no server.

HttpTransport builds its httpx.AsyncClient itself, lazily, with no injection point, so
the ``mock_http`` fixture wraps ``httpx.AsyncClient`` for the test's duration: the
transport's own base_url, headers, timeout and limits still apply; only the bytes are
answered by a handler.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import pytrio as trio
from pytrio import session as session_mod
from pytrio import types as t
from pytrio.futures import run_sync
from pytrio.session import Session
from pytrio.transport.http import HttpTransport

BASE = "http://trio.test"
KEY = "sk-test-0123"
WAIT = 5.0
_RealAsyncClient = httpx.AsyncClient
Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture
def mock_http(monkeypatch) -> Callable[[Handler], list[httpx.Request]]:
    """``mock_http(handler)`` answers every request the SDK sends with ``handler``;
    returns the list of requests seen."""

    def install(handler: Handler) -> list[httpx.Request]:
        seen: list[httpx.Request] = []

        def record(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return handler(request)

        def client(**kwargs: Any) -> httpx.AsyncClient:
            return _RealAsyncClient(transport=httpx.MockTransport(record), **kwargs)

        monkeypatch.setattr(httpx, "AsyncClient", client)
        return seen

    return install


def run(operation: Callable[[HttpTransport], Any], api_key: str | None = KEY) -> Any:
    """Run one transport operation in a fresh event loop, closing the client after."""
    transport = HttpTransport(BASE, api_key)

    async def main() -> Any:
        try:
            return await operation(transport)
        finally:
            await transport.close()

    return asyncio.run(main())


def submit(transport: HttpTransport) -> Any:
    return transport.submit("optim_step", {"model_id": "run-1", "seq": 0}, "key-1")


def service_error(status: int, category: str, message: str) -> Handler:
    body = {"error": {"category": category, "message": message}}  # as trio_server.app._error
    return lambda request: httpx.Response(status, json=body)


def raw(status: int, text: str, content_type: str = "text/html") -> Handler:
    return lambda request: httpx.Response(status, text=text, headers={"content-type": content_type})


# -- the service's own error bodies: mapped by category ---------------------------------


@pytest.mark.parametrize(
    ("status", "category", "message", "error"),
    [
        (401, "authentication", "invalid API key", trio.AuthenticationError),
        (401, "authentication", "missing API key: send 'Authorization: Bearer <key>'", trio.AuthenticationError),
        (400, "validation", "malformed JSON: Expecting value", trio.ValidationError),
        (404, "not_found", "run run-9 not found", trio.NotFoundError),
        (413, "validation", "request body of 99999999 bytes exceeds the limit of 67108864", trio.ValidationError),
        (422, "validation", "data[0].loss_fn_inputs.weights: wrong length (got list)", trio.ValidationError),
        (429, "capacity", "too many requests in flight", trio.CapacityError),
        (500, "server", "the engine failed", trio.ServerError),
        (503, "server", "the server is shutting down", trio.ServerError),
    ],
)
def test_service_error_bodies_map_by_category(mock_http, status, category, message, error):
    mock_http(service_error(status, category, message))
    with pytest.raises(trio.TrioError) as err:
        run(submit)
    assert type(err.value) is error
    assert err.value.message == message and str(err.value) == message


def test_a_validation_error_is_also_a_value_error(mock_http):
    mock_http(service_error(422, "validation", "rank: must be > 0"))
    with pytest.raises(ValueError, match="rank"):
        run(submit)


def test_service_error_bodies_keep_the_status_code(mock_http):
    mock_http(service_error(404, "not_found", "run run-9 not found"))
    with pytest.raises(trio.NotFoundError) as err:
        run(submit)
    assert err.value.status_code == 404


# -- anything else (proxies, load balancers, framework defaults): mapped by status ------


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (401, "Unauthorized", trio.AuthenticationError),
        (403, "<html><body><h1>403 Forbidden</h1></body></html>", trio.AuthenticationError),
        (404, "<html><body><h1>404 Not Found</h1>nginx</body></html>", trio.NotFoundError),
        (413, "<html><head><title>413 Request Entity Too Large</title></head></html>", trio.ValidationError),
        (429, "Too Many Requests", trio.CapacityError),
        (500, "Internal Server Error", trio.ServerError),
        (502, "<html><body><h1>502 Bad Gateway</h1></body></html>", trio.ServerError),
        (503, "<html><body><h1>503 Service Temporarily Unavailable</h1></body></html>", trio.ServerError),
        (504, "<html><body><h1>504 Gateway Time-out</h1></body></html>", trio.ServerError),
        (409, "conflict", trio.ValidationError),  # any other 4xx: the request was refused
    ],
)
def test_non_json_error_bodies_map_by_status(mock_http, status, body, error):
    mock_http(raw(status, body))
    with pytest.raises(trio.TrioError) as err:
        run(submit)
    assert type(err.value) is error
    assert err.value.status_code == status
    if body.startswith("<html"):  # a page is named, not dumped into the message
        assert err.value.message.startswith(f"{status} ") and "an HTML page, not a TRIO reply (a proxy's, or no " \
            "`trio serve` at this base URL)" in err.value.message and "<" not in err.value.message
    else:
        assert err.value.message == body


def test_json_that_is_not_a_service_error_maps_by_status(mock_http):
    mock_http(lambda request: httpx.Response(404, json={"detail": "Not Found"}))  # FastAPI's default
    with pytest.raises(trio.NotFoundError) as err:
        run(submit)
    assert err.value.status_code == 404 and "Not Found" in err.value.message


def test_an_empty_error_body_uses_the_reason_phrase(mock_http):
    mock_http(lambda request: httpx.Response(502))
    with pytest.raises(trio.ServerError) as err:
        run(submit)
    assert err.value.message == "Bad Gateway" and err.value.status_code == 502


def test_a_huge_error_page_is_truncated(mock_http):
    mock_http(raw(500, "<html>" + "x" * 100_000 + "</html>"))
    with pytest.raises(trio.ServerError) as err:
        run(submit)
    assert 0 < len(err.value.message) <= 500


@pytest.mark.parametrize(
    "operation",
    [
        lambda tr: tr.retrieve("req-1", 30.0),
        lambda tr: tr.capabilities(),
        lambda tr: tr.get_run("run-9"),
        lambda tr: tr.list_runs(),
        lambda tr: tr.list_checkpoints("run-9"),
        lambda tr: tr.delete_checkpoint("trio://run-9/weights/w"),
    ],
    ids=["retrieve", "capabilities", "get_run", "list_runs", "list_checkpoints", "delete_checkpoint"],
)
def test_every_route_maps_errors_the_same_way(mock_http, operation):
    mock_http(service_error(404, "not_found", "run run-9 not found"))
    with pytest.raises(trio.NotFoundError, match="run-9"):
        run(operation)


def test_a_failed_download_raises_and_leaves_no_file(mock_http, tmp_path):
    mock_http(service_error(404, "not_found", "checkpoint trio://run-9/weights/w not found"))
    with pytest.raises(trio.NotFoundError, match="not found"):
        run(lambda tr: tr.download_checkpoint("trio://run-9/weights/w", tmp_path, False))
    assert list(tmp_path.iterdir()) == []


# -- network failures ---------------------------------------------------------------


def test_connection_failure_maps_to_connection_error_with_the_cause_chained(mock_http):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    mock_http(refuse)
    with pytest.raises(trio.ConnectionError, match="Connection refused") as err:
        run(submit)
    assert BASE in err.value.message
    assert isinstance(err.value.__cause__, httpx.ConnectError)


def test_timeout_maps_to_the_sdk_timeout_error_with_the_cause_chained(mock_http):
    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    mock_http(hang)
    with pytest.raises(trio.TimeoutError) as err:
        run(lambda tr: tr.retrieve("req-1", 30.0))
    assert isinstance(err.value.__cause__, httpx.ReadTimeout)


def test_an_interrupted_download_says_it_can_resume(mock_http, tmp_path):
    def drop(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed connection", request=request)

    mock_http(drop)
    with pytest.raises(trio.ConnectionError, match="resume") as err:
        run(lambda tr: tr.download_checkpoint("trio://run-9/weights/w", tmp_path, False))
    assert isinstance(err.value.__cause__, httpx.RemoteProtocolError)


# -- what goes on the wire ----------------------------------------------------------


def test_submit_sends_the_key_the_idempotency_key_and_the_body(mock_http):
    seen = mock_http(lambda request: httpx.Response(200, json={"request_id": "req-42"}))
    assert run(submit) == "req-42"
    (request,) = seen
    assert request.method == "POST" and request.url == httpx.URL(f"{BASE}/api/v1/optim_step")
    assert request.headers["authorization"] == f"Bearer {KEY}"  # what trio_server.auth reads first
    assert request.headers["idempotency-key"] == "key-1"
    assert json.loads(request.content) == {"model_id": "run-1", "seq": 0}


def test_retrieve_is_a_long_poll_whose_read_timeout_outlasts_the_poll(mock_http):
    answer = {"request_id": "req-1", "status": "pending", "queue_state": "active"}
    seen = mock_http(lambda request: httpx.Response(200, json=answer))
    out = run(lambda tr: tr.retrieve("req-1", 30.0))
    assert out == t.FutureResponse(**answer)
    (request,) = seen
    assert request.url.path == "/api/v1/retrieve_future"
    assert json.loads(request.content) == {"request_id": "req-1", "timeout": 30.0}
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.extensions["timeout"]["read"] > 30.0


def test_every_request_carries_the_api_key(mock_http):
    caps = {"supported_models": ["m"], "max_tokens_per_request": 1, "max_seq_len": 1, "max_batch_size": 1,
            "max_lora_rank": 1}
    seen = mock_http(lambda request: httpx.Response(200, json=caps if "capabilities" in request.url.path else []))

    async def several(tr: HttpTransport) -> None:
        await tr.capabilities()
        await tr.list_runs()
        await tr.list_checkpoints(None)

    run(several)
    assert [r.headers.get("authorization") for r in seen] == [f"Bearer {KEY}"] * 3


def test_no_key_sends_no_authorization_header(mock_http):
    seen = mock_http(lambda request: httpx.Response(200, json={"request_id": "req-1"}))
    run(submit, api_key=None)
    assert "authorization" not in seen[0].headers


def test_service_client_takes_the_key_from_the_environment(mock_http, monkeypatch):
    monkeypatch.setenv("PYTRIO_API_KEY", "sk-from-env")
    caps = {"supported_models": ["m"], "max_tokens_per_request": 1, "max_seq_len": 1, "max_batch_size": 1,
            "max_lora_rank": 1}
    seen = mock_http(lambda request: httpx.Response(200, json=caps))
    service = trio.ServiceClient(base_url=BASE)
    try:
        assert service.get_server_capabilities().supported_models == ["m"]
    finally:
        run_sync(service._session.transport.close())
    assert seen[0].headers["authorization"] == "Bearer sk-from-env"


# -- the Session over HTTP ----------------------------------------------------------


@pytest.fixture
def no_backoff(monkeypatch) -> None:
    async def no_sleep(seconds: float) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(session_mod, "asyncio", SimpleNamespace(sleep=no_sleep, to_thread=asyncio.to_thread))


def test_a_retried_http_submit_resends_the_same_idempotency_key(mock_http, no_backoff):
    refusals = iter(range(2))

    def flaky(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/retrieve_future":
            return httpx.Response(200, json={"request_id": "req-1", "status": "done", "result": {"metrics": {}}})
        if next(refusals, None) is not None:
            raise httpx.ConnectError("Connection refused", request=request)
        return httpx.Response(200, json={"request_id": "req-1"})

    seen = mock_http(flaky)
    tc = trio.TrainingClient(Session(HttpTransport(BASE, KEY)), "run-1", "trio/tiny-llama")
    try:
        assert tc.optim_step().result(timeout=WAIT).metrics == {}
        tc.optim_step().result(timeout=WAIT)
    finally:
        run_sync(tc._session.transport.close())
    submits = [r.headers["idempotency-key"] for r in seen if r.url.path == "/api/v1/optim_step"]
    assert len(submits) == 4 and submits[0] == submits[1] == submits[2] != submits[3]


def test_an_http_error_while_retrieving_carries_the_request_id(mock_http):
    def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/retrieve_future":
            return httpx.Response(502, text="<html>502 Bad Gateway</html>")
        return httpx.Response(200, json={"request_id": "req-7"})

    mock_http(gateway)
    tc = trio.TrainingClient(Session(HttpTransport(BASE, KEY)), "run-1", "trio/tiny-llama")
    try:
        with pytest.raises(trio.ServerError) as err:
            tc.optim_step().result(timeout=WAIT)
    finally:
        run_sync(tc._session.transport.close())
    assert err.value.request_id == "req-7"


def test_retry_after_is_kept_on_the_error(mock_http):
    mock_http(lambda request: httpx.Response(429, text="Too Many Requests", headers={"retry-after": "3"}))
    with pytest.raises(trio.CapacityError) as err:
        run(submit)
    assert err.value.status_code == 429 and err.value.retry_after == 3.0


def test_a_retry_after_date_or_garbage_is_ignored(mock_http):
    mock_http(lambda request: httpx.Response(503, text="down", headers={"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}))
    with pytest.raises(trio.ServerError) as err:
        run(submit)
    assert err.value.retry_after is None
