"""APIFuture and the ``*_async`` twins, through the real SDK stack over an in-memory
transport: ``result(timeout)`` raises the SDK's TimeoutError, ``done()`` flips when the
operation ends, a future can be awaited from the user's own event loop, and every
``*_async`` twin returns something awaitable. No network, no model, no server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from typing import Any

import pytest

import pytrio as trio
from pytrio import types as t
from pytrio.futures import APIFuture, background_loop
from pytrio.rest import RestClient
from pytrio.sampling import SamplingClient
from pytrio.session import Session
from pytrio.transport import Transport

from .fakes import OperationsOnly

MODEL = "trio/tiny-llama"
WAIT = 5.0  # seconds; a bound for broken tests, never reached by passing ones
RESULTS: dict[str, dict[str, Any]] = {
    "create_model": {"model_id": "run-1", "base_model": MODEL},
    "optim_step": {"metrics": {"step": 1.0}},
    "sample": {"sequences": [{"tokens": [5], "logprobs": [-0.5], "text": "x", "stop_reason": "length"}]},
    "compute_logprobs": {"logprobs": [None, -0.25]},
}


class GatedTransport(OperationsOnly):
    """The Transport protocol in memory. Every operation stays pending until
    ``release()``; then it completes with ``RESULTS[op]``, or fails with
    ``failures[op] = (category, message)``."""

    def __init__(self, failures: dict[str, tuple[str, str]] | None = None):
        self.failures = failures or {}
        self.gate = threading.Event()
        self.ops: dict[str, str] = {}  # request id -> op

    def release(self) -> None:
        self.gate.set()

    async def submit(self, op: str, body: dict[str, Any], idempotency_key: str) -> str:
        request_id = f"req-{len(self.ops)}"
        self.ops[request_id] = op
        return request_id

    async def retrieve(self, request_id: str, timeout: float) -> t.FutureResponse:
        for _ in range(10):  # a short long-poll: wait a little for the gate, else "pending"
            if self.gate.is_set():
                op = self.ops[request_id]
                if op in self.failures:
                    category, message = self.failures[op]
                    error = t.ErrorInfo(category=category, message=message)
                    return t.FutureResponse(request_id=request_id, status="failed", error=error)
                return t.FutureResponse(request_id=request_id, status="done", result=RESULTS[op])
            await asyncio.sleep(0.002)
        return t.FutureResponse(request_id=request_id, status="pending", queue_state="active")


def trainer(transport: Transport) -> trio.TrainingClient:
    return trio.TrainingClient(Session(transport), "run-1", MODEL)


def test_result_timeout_raises_the_sdk_timeout_error_and_the_future_lives_on():
    raw: concurrent.futures.Future[int] = concurrent.futures.Future()
    fut = APIFuture(raw)
    assert not fut.done()
    with pytest.raises(trio.TimeoutError, match="0.01") as err:
        fut.result(timeout=0.01)
    assert type(err.value) is trio.TimeoutError and isinstance(err.value, trio.TrioError)
    assert not fut.done() and not raw.cancelled()  # timing out a wait does not cancel the work
    raw.set_result(7)
    assert fut.done() and fut.result(timeout=0.01) == 7 and fut.result() == 7


def test_done_and_result_timeout_through_a_client():
    transport = GatedTransport()
    fut = trainer(transport).optim_step(trio.AdamParams(learning_rate=1e-3))
    assert isinstance(fut, trio.APIFuture)
    assert not fut.done()
    with pytest.raises(trio.TimeoutError):
        fut.result(timeout=0.05)
    assert not fut.done()
    transport.release()
    out = fut.result(timeout=WAIT)
    assert isinstance(out, trio.OptimStepResponse) and out.metrics == {"step": 1.0}
    assert fut.done()


def test_a_failed_operation_is_done_and_raises_its_error_with_the_request_id():
    transport = GatedTransport(failures={"optim_step": ("not_found", "run run-1 not found")})
    fut = trainer(transport).optim_step()
    assert not fut.done()
    transport.release()
    with pytest.raises(trio.NotFoundError, match="run run-1 not found") as err:
        fut.result(timeout=WAIT)
    assert err.value.request_id == "req-0"
    assert fut.done()


def test_await_a_future_from_the_users_own_event_loop():
    transport = GatedTransport(failures={"sample": ("capacity", "sampler queue full")})
    tc = trainer(transport)
    sampler = SamplingClient(Session(transport), "s-1", MODEL)

    async def main() -> trio.OptimStepResponse:
        assert asyncio.get_running_loop() is not background_loop().loop
        fut = tc.optim_step()
        failing = sampler.sample(trio.ModelInput.from_ints([1, 2]), 1, trio.SamplingParams(max_tokens=2))
        await asyncio.sleep(0.02)
        assert not fut.done()
        transport.release()
        out = await asyncio.wait_for(fut, WAIT)  # an APIFuture is awaitable as is
        with pytest.raises(trio.CapacityError, match="queue full") as err:
            await asyncio.wait_for(failing, WAIT)
        assert transport.ops[err.value.request_id] == "sample"
        assert fut.done() and failing.done()
        return out

    first_loop_fut = tc.optim_step()
    assert asyncio.run(main()).metrics == {"step": 1.0}
    # a future made outside any loop is awaitable in a later, different loop too
    assert asyncio.run(asyncio.wait_for(_await(first_loop_fut), WAIT)).metrics == {"step": 1.0}


def test_cancelling_an_await_abandons_the_wait_not_the_operation():
    """``wait_for``'s timeout cancels the task awaiting the future; the request was sent
    and runs on, so its future must still give the result (it used to raise
    CancelledError forever, while the service ran the request anyway)."""
    transport = GatedTransport()
    tc = trainer(transport)

    async def main() -> None:
        fut = tc.optim_step()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut, 0.05)
        assert not fut.done()
        transport.release()
        assert (await asyncio.wait_for(fut, WAIT)).metrics == {"step": 1.0}
        assert fut.result(timeout=WAIT).metrics == {"step": 1.0}

    asyncio.run(main())


def test_an_abandoned_wait_on_an_operation_that_fails_logs_nothing(caplog):
    """The shielded wait's copy of the outcome is read even when nobody awaits it any more:
    an operation failing after a wait_for timeout logged "Future exception was never
    retrieved" when the copy was collected."""
    import gc

    async def main() -> None:  # the future is main's alone: gone with it, as a user's dropped one
        raw: concurrent.futures.Future[int] = concurrent.futures.Future()
        try:  # (not pytest.raises: its traceback would keep the copy alive past the check)
            await asyncio.wait_for(APIFuture(raw), 0.05)
        except asyncio.TimeoutError:
            pass
        raw.set_exception(trio.ServerError("it went wrong"))
        await asyncio.sleep(0.05)  # the copy takes the outcome

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def _await(fut: APIFuture[Any]) -> Any:
    return await fut


def test_async_twins_return_awaitables():
    transport = GatedTransport()
    transport.release()
    service = trio.ServiceClient(transport=transport)

    async def main() -> None:
        pending = service.create_lora_training_client_async(base_model=MODEL, rank=4)
        assert inspect.isawaitable(pending)
        tc = await asyncio.wait_for(pending, WAIT)
        assert isinstance(tc, trio.TrainingClient) and tc.model_id == "run-1"

        pending_future = tc.optim_step_async(trio.AdamParams())
        assert inspect.isawaitable(pending_future)
        fut = await pending_future
        assert isinstance(fut, trio.APIFuture)  # awaiting the twin gives the future ...
        assert (await asyncio.wait_for(fut, WAIT)).metrics == {"step": 1.0}  # ... awaiting that, the result

        sampler = SamplingClient(Session(transport), "s-1", MODEL)
        sample_future = await sampler.sample_async(trio.ModelInput.from_ints([1, 2]), num_samples=1,
                                                   sampling_params=trio.SamplingParams(max_tokens=2))
        assert (await asyncio.wait_for(sample_future, WAIT)).sequences[0].tokens == [5]

    asyncio.run(main())
    # the blocking twin of a value-returning method returns the value itself
    tc = service.create_lora_training_client(base_model=MODEL, rank=4)
    assert isinstance(tc, trio.TrainingClient) and tc.model_id == "run-1"


@pytest.mark.parametrize("cls", [trio.ServiceClient, trio.TrainingClient, SamplingClient, RestClient])
def test_every_async_twin_is_a_coroutine_function_next_to_its_sync_method(cls):
    twins = [name for name in vars(cls) if name.endswith("_async") and not name.startswith("_")]
    assert twins, f"{cls.__name__} has no *_async methods"
    for name in twins:
        sync_name = name.removesuffix("_async")
        async_fn, sync_fn = getattr(cls, name), getattr(cls, sync_name, None)
        # an async def, or a twin that makes its call at once (async_twin, begun_at_call)
        assert inspect.iscoroutinefunction(async_fn) or async_fn.calls_at_once, f"{cls.__name__}.{name}"
        assert sync_fn is not None and not inspect.iscoroutinefunction(sync_fn), f"{cls.__name__}.{sync_name}"
        assert async_fn.__name__ == name and sync_fn.__name__ == sync_name


def test_sampling_twins_give_a_result_with_one_await_or_two():
    """The user docs await twice (``fut = await sc.sample_async(...); res = await fut``);
    Tinker code awaits once (``(await sc.sample_async(...)).sequences``). Both work: the
    sampling twins return the result, and the result awaits to itself."""
    transport = GatedTransport()
    transport.release()
    sampler = SamplingClient(Session(transport), "s-1", MODEL)
    prompt, params = trio.ModelInput.from_ints([1, 2]), trio.SamplingParams(max_tokens=2)

    async def main() -> None:
        assert (await sampler.sample_async(prompt, 1, params)).sequences[0].tokens == [5]
        fut = await sampler.sample_async(prompt=prompt, sampling_params=params, num_samples=1)
        res = await fut
        assert res.sequences[0].text == "x" and fut.done() and fut.result(timeout=WAIT) is res
        assert (await sampler.compute_logprobs_async(prompt))[1] == -0.25
        assert await (await sampler.compute_logprobs_async(prompt)) == [None, -0.25]
        with pytest.raises(trio.ValidationError, match="max_tokens"):
            await sampler.sample_async(prompt, 1)

    asyncio.run(main())
