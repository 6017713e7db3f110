"""A client's life around its calls: closing it, a forked child, waits that time out."""

from __future__ import annotations

import concurrent.futures
import os

import pytest

import pytrio as trio
from pytrio.futures import APIFuture
from pytrio.session import Session
from pytrio.transport import local
from pytrio.transport.http import HttpTransport

from .test_ordering import MODEL, WAIT, FakeService


class Closing(FakeService):
    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


def test_a_service_client_closes_its_connections_and_is_a_context_manager():
    transport = Closing()
    with trio.ServiceClient(transport=transport) as service:
        assert isinstance(service, trio.ServiceClient)
    assert transport.closed == 1

    async def main() -> None:
        async with trio.ServiceClient(transport=transport):
            pass

    import asyncio

    asyncio.run(main())
    assert transport.closed == 2


def test_a_closed_http_transport_opens_a_new_connection_pool_on_its_next_call():
    from pytrio.futures import run_sync

    transport = HttpTransport("http://127.0.0.1:9", None)
    first = transport.client
    run_sync(transport.close())
    assert first.is_closed and transport.client is not first and not transport.client.is_closed
    run_sync(transport.close())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_forked_child_can_use_the_sdk(monkeypatch):
    """The SDK's loop thread (and the embedded service's core) do not survive a fork: every
    call in a child, on a client made there, waited for ever (multiprocessing forks on Linux)."""
    tc = trio.TrainingClient(Session(FakeService()), "run-1", MODEL)
    assert tc.optim_step().result(WAIT).metrics["step"] == 1.0  # the parent's loop runs
    monkeypatch.setitem(local._cores, "/a/parent/data/dir", object())
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only an exit code
        code = 3
        try:
            child = trio.TrainingClient(Session(FakeService()), "run-2", MODEL)
            stepped = child.optim_step().result(WAIT).metrics["step"] == 1.0
            code = 0 if stepped and not local._cores else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_wait_that_times_out_is_the_builtin_timeout_error_and_an_operations_own_is_kept():
    never: concurrent.futures.Future[int] = concurrent.futures.Future()
    with pytest.raises(TimeoutError, match="no result within 0.01 s"):
        APIFuture(never).result(0.01)
    own: concurrent.futures.Future[int] = concurrent.futures.Future()
    own.set_exception(trio.TimeoutError("POST /sample: timed out", request_id="req-7"))
    with pytest.raises(trio.TimeoutError) as raised:
        APIFuture(own).result(WAIT)
    assert raised.value.request_id == "req-7"  # not rewritten as this wait's
