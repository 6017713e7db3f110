"""A client's life around its calls: closing it, a forked child, waits that time out."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pytrio as trio
from pytrio.futures import APIFuture
from pytrio.transport.http import HttpTransport

from .test_ordering import WAIT, FakeService


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


FORKED = """
import atexit, os, sys
from types import SimpleNamespace
import pytrio as trio
from pytrio.session import Session
from pytrio.transport import local
from tests.sdk.test_ordering import MODEL, FakeService

def closed_at_exit():  # the parent's embedded core closes at its exit (ServiceCore registers it so)
    print("closed in", "the child" if os.getpid() != parent else "the parent", flush=True)

parent = os.getpid()
tc = trio.TrainingClient(Session(FakeService()), "run-1", MODEL)
tc.optim_step().result(10)  # the parent's loop runs
local._cores["/the/parent/data/dir"] = SimpleNamespace(close=closed_at_exit)
atexit.register(closed_at_exit)
if os.fork() == 0:  # the child exits as any script does, running its exit handlers
    child = trio.TrainingClient(Session(FakeService()), "run-2", MODEL)
    print("child stepped", child.optim_step().result(10).metrics["step"], "cores", len(local._cores), flush=True)
    sys.exit(0)
os.wait()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_forked_child_can_use_the_sdk_and_leaves_the_parents_core_alone():
    """The SDK's loop thread (and the embedded service's core) do not survive a fork: every
    call in a child, on a client made there, waited for ever (multiprocessing forks on
    Linux); and the parent's core, closed at the child's exit, wrote stale snapshots. In a
    process of its own: a fork of pytest's would run pytest's exit handlers too."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", FORKED], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])})
    assert run.stdout.splitlines() == ["child stepped 1.0 cores 0", "closed in the parent"], run.stderr


def test_a_wait_that_times_out_is_the_builtin_timeout_error_and_an_operations_own_is_kept():
    never: concurrent.futures.Future[int] = concurrent.futures.Future()
    with pytest.raises(TimeoutError, match="no result within 0.01 s"):
        APIFuture(never).result(0.01)
    own: concurrent.futures.Future[int] = concurrent.futures.Future()
    own.set_exception(trio.TimeoutError("POST /sample: timed out", request_id="req-7"))
    with pytest.raises(trio.TimeoutError) as raised:
        APIFuture(own).result(WAIT)
    assert raised.value.request_id == "req-7"  # not rewritten as this wait's


class DoneAsTheWaitEnds(concurrent.futures.Future):
    def result(self, timeout=None):
        if timeout is not None and not self.done():
            self.set_result(7)
            raise TimeoutError
        return super().result(timeout)


def test_a_result_that_arrives_as_the_wait_times_out_is_returned():
    assert APIFuture(DoneAsTheWaitEnds()).result(0.01) == 7
