"""A training client's calls reach the service in call order, numbered without gaps,
whatever the timing: a slow forward or loss in forward_backward_custom, a submit that
is retried, a loss function that raises. Nothing here waits on a timeout.

The fake service records every submit as (op, seq) and answers each request when the
test lets it (``hold``), so each test stages the exact interleaving it means.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest

import pytrio as trio
from pytrio import session as session_mod
from pytrio import types as t
from pytrio.futures import background_loop
from pytrio.ordering import SubmitOrder
from pytrio.session import Session

from ..polling import wait_until
from .fakes import OperationsOnly

MODEL = "trio/tiny-llama"
WAIT = 10.0  # a bound for broken tests, never reached by passing ones


def result_for(op: str, body: dict[str, Any]) -> dict[str, Any]:
    if op in ("forward", "forward_backward"):
        outputs = [{"logprobs": {"data": [-1.0] * len(d["loss_fn_inputs"]["target_tokens"]["data"])},
                    "elementwise_loss": {"data": [0.0] * len(d["loss_fn_inputs"]["target_tokens"]["data"])}}
                   for d in body["data"]]
        return {"loss_fn_outputs": outputs, "metrics": {"loss:sum": 0.0}}
    if op == "compute_logprobs":
        return {"logprobs": [None, -0.5]}
    if op == "get_info":
        return {"model_id": body["model_id"], "base_model": MODEL, "lora_rank": 32, "train_attn": True,
                "train_mlp": True, "train_unembed": True, "step": 0}
    return {"metrics": {"step": 1.0}}


class FakeService(OperationsOnly):
    """Submits are recorded in arrival order; ops in ``hold`` answer only when released."""

    def __init__(self, hold: set[str] = frozenset(), refuse: dict[str, threading.Event] | None = None):
        self.submits: list[tuple[str, int | None]] = []
        self.bodies: list[dict[str, Any]] = []
        self.hold, self.refuse = set(hold), refuse or {}
        self.refused: list[str] = []
        self.outcomes: dict[str, concurrent.futures.Future[dict[str, Any]]] = {}

    async def submit(self, op: str, body: dict[str, Any], idempotency_key: str) -> str:
        gate = self.refuse.get(op)
        if gate is not None and not gate.is_set():  # connection refused until the test opens it
            self.refused.append(op)
            raise trio.ConnectionError(f"POST /{op}: connection refused")
        request_id = f"req-{len(self.submits)}"
        self.submits.append((op, body.get("seq")))
        self.bodies.append(body)
        self.outcomes[request_id] = outcome = concurrent.futures.Future()
        if op not in self.hold:
            outcome.set_result(result_for(op, body))
        return request_id

    def release(self, op: str) -> None:
        for (sent_op, _), outcome, body in zip(list(self.submits), list(self.outcomes.values()), list(self.bodies)):
            if sent_op == op and not outcome.done():
                outcome.set_result(result_for(op, body))

    async def retrieve(self, request_id: str, timeout: float) -> t.FutureResponse:
        result = await asyncio.wrap_future(self.outcomes[request_id])
        return t.FutureResponse(request_id=request_id, status="done", result=result)


@pytest.fixture
def no_backoff(monkeypatch) -> None:
    async def no_sleep(seconds: float) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(session_mod, "asyncio", SimpleNamespace(sleep=no_sleep, to_thread=asyncio.to_thread))


def datum(n: int = 3) -> trio.Datum:
    tokens = list(range(1, n + 2))
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})


def total_logprob(data, logprobs):
    return -sum(lp.sum() for lp in logprobs), {"custom": 1.0}


def waiting_or_sent(tc: trio.TrainingClient, service: FakeService, op: str) -> bool:
    """``op`` was sent, or it is queued behind an earlier call (the client's submit order)."""
    order = getattr(tc, "_order", None)
    return any(o == op for o, _ in service.submits) or (order is not None and order.waiting > 0)


def test_an_async_call_takes_its_place_when_made_not_when_first_awaited():
    service = FakeService()
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)

    async def main() -> None:
        backward = asyncio.create_task(tc.forward_backward_async([datum()]))  # runs at the next await
        step = tc.optim_step()
        await asyncio.wait_for(await backward, WAIT)
        await asyncio.wait_for(step, WAIT)

    asyncio.run(main())
    assert service.submits == [("forward_backward", 0), ("optim_step", 1)]


def test_a_slow_forward_does_not_let_the_next_call_overtake_the_backward():
    service = FakeService(hold={"forward"})
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)
    custom = tc.forward_backward_custom([datum()], total_logprob)
    wait_until(lambda: service.submits == [("forward", 0)], "the forward to be sent")
    step = tc.optim_step()
    wait_until(lambda: waiting_or_sent(tc, service, "optim_step"), "the optim_step to be sent or queued")
    service.release("forward")
    assert custom.result(WAIT).metrics["custom"] == 1.0 and step.result(WAIT).metrics["step"] == 1.0
    assert service.submits == [("forward", 0), ("forward_backward", 1), ("optim_step", 2)]


def test_a_slow_loss_holds_later_calls_until_its_backward_is_sent():
    started, go = threading.Event(), threading.Event()

    def slow(data, logprobs):
        started.set()
        go.wait(WAIT)
        return total_logprob(data, logprobs)

    service = FakeService()
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)
    custom = tc.forward_backward_custom([datum()], slow)
    assert started.wait(WAIT)
    step = tc.optim_step()
    wait_until(lambda: waiting_or_sent(tc, service, "optim_step"), "the optim_step to be sent or queued")
    assert service.submits == [("forward", 0)]
    go.set()
    custom.result(WAIT), step.result(WAIT)
    assert service.submits == [("forward", 0), ("forward_backward", 1), ("optim_step", 2)]


def test_a_loss_that_raises_frees_its_place_at_once():
    def broken(data, logprobs):
        raise ZeroDivisionError("the user's bug")

    service = FakeService()
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)
    custom = tc.forward_backward_custom([datum()], broken)
    step = tc.optim_step()
    with pytest.raises(ZeroDivisionError):
        custom.result(WAIT)
    assert step.result(WAIT).metrics["step"] == 1.0
    # the backward never went, and its number was not spent: the service sees no gap
    assert service.submits == [("forward", 0), ("optim_step", 1)]


def test_a_retried_submit_is_not_overtaken(no_backoff):
    gate = threading.Event()
    service = FakeService(refuse={"forward_backward": gate})
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)
    fb = tc.forward_backward([datum()])
    wait_until(lambda: service.refused, "the forward_backward to be refused once")
    step = tc.optim_step()
    wait_until(lambda: waiting_or_sent(tc, service, "optim_step"), "the optim_step to be sent or queued")
    gate.set()
    fb.result(WAIT), step.result(WAIT)
    assert service.submits == [("forward_backward", 0), ("optim_step", 1)]


def test_the_loss_runs_off_the_sdk_loop_and_may_call_the_sdk():
    """On the loop it stalled every client's I/O, and a sync SDK call inside deadlocked."""
    service = FakeService()
    session = Session(service)
    tc = trio.TrainingClient(session, "run-1", MODEL)
    sampler = trio.SamplingClient(session, "sampler-1", MODEL)
    seen = {}

    def loss(data, logprobs):
        seen["thread"] = threading.current_thread()
        seen["logprobs"] = sampler.compute_logprobs(trio.ModelInput.from_ints([1, 2])).result(WAIT)
        return total_logprob(data, logprobs)

    tc.forward_backward_custom([datum()], loss).result(WAIT)
    assert seen["thread"] is not background_loop().thread and seen["logprobs"] == [None, -0.5]


@pytest.mark.parametrize("call", ["forward", "get_info", "save_weights_and_get_sampling_client"])
def test_the_loss_may_not_wait_for_its_own_client(call):
    """An ordered call of the same client queues behind this very backward: refused, not hung."""
    service = FakeService()
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)

    def loss(data, logprobs):
        if call == "forward":
            tc.forward([datum()]).result(WAIT)
        else:
            getattr(tc, call)()
        return total_logprob(data, logprobs)

    with pytest.raises(trio.ValidationError, match="loss_fn.*same TrainingClient"):
        tc.forward_backward_custom([datum()], loss).result(WAIT)
    tc.optim_step().result(WAIT)
    assert service.submits == [("forward", 0), ("optim_step", 1)]


def test_forward_backward_takes_a_function_as_loss_fn():
    service = FakeService()
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)
    out = tc.forward_backward([datum()], total_logprob).result(WAIT)
    assert out.metrics["custom"] == 1.0
    assert tc.forward_backward([datum()], loss_fn=total_logprob).result(WAIT).metrics["custom"] == 1.0

    async def twin():
        return await (await tc.forward_backward_async([datum()], total_logprob))

    assert asyncio.run(twin()).metrics["custom"] == 1.0
    as_list = tc.forward_backward([datum()], lambda data, lps: list(total_logprob(data, lps))).result(WAIT)
    assert as_list.metrics["custom"] == 1.0  # [loss, metrics] as well as (loss, metrics)
    assert [op for op, _ in service.submits] == ["forward", "forward_backward"] * 4
    backward = service.bodies[1]
    assert backward["loss_fn"] == "cross_entropy"
    assert backward["data"][0]["loss_fn_inputs"]["weights"]["data"] == [1.0, 1.0, 1.0]  # -d(-sum lp)/d lp


@pytest.mark.parametrize(("loss_fn", "why"), [
    (lambda data, lps: lps[0].sum(), r"must return \(loss, metrics\), got Tensor"),
    (lambda data, lps: (lps[0], {}), r"loss must be a 0-d torch tensor .* got a tensor of shape \[3\]"),
    (lambda data, lps: (1.5, {}), "loss must be a 0-d torch tensor .* got float"),
    (lambda data, lps: (lps[0].detach().sum(), {}), "does not depend on the logprobs"),
    (lambda data, lps: (lps[0].sum(), [1.0]), "metrics must be a dict of name -> number, got list"),
    (lambda data, lps: (lps[0].sum(), {"m": lps[0].detach()}), "metric 'm' must be a number"),
])
def test_a_misused_custom_loss_is_a_validation_error_and_frees_its_place(loss_fn, why):
    """Raw RuntimeError, AttributeError, TypeError and ValueError from inside the SDK
    became ValidationErrors naming what loss_fn returned; later calls still go."""
    service = FakeService()
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)
    with pytest.raises(trio.ValidationError, match=why):
        tc.forward_backward_custom([datum()], loss_fn).result(WAIT)
    tc.optim_step().result(WAIT)
    assert service.submits == [("forward", 0), ("optim_step", 1)]


def test_an_async_call_never_awaited_is_still_made_and_the_warning_names_it():
    import gc

    service = FakeService()
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)
    with pytest.warns(RuntimeWarning, match="coroutine 'TrainingClient.optim_step_async' was never awaited"):
        tc.optim_step_async()
        gc.collect()
    wait_until(lambda: service.submits == [("optim_step", 0)], "the step to be sent")


def ops_sent(service: FakeService) -> list[str]:
    return [op for op, _ in service.submits]


def test_a_cancelled_get_info_async_lets_no_later_call_overtake_the_calls_before_it():
    """A ``wait_for`` timeout on a status check cancelled the earlier call's place too: the
    next optim_step was sent before a custom loss's backward and stepped on no gradient."""
    service = FakeService(hold={"forward"})
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)

    async def main() -> None:
        custom = await tc.forward_backward_custom_async([datum()], total_logprob)  # its forward held
        info = asyncio.create_task(tc.get_info_async())
        await asyncio.sleep(0)  # the status check now waits behind the backward
        info.cancel()
        with pytest.raises(asyncio.CancelledError):
            await info
        step = await tc.optim_step_async()
        wait_until(lambda: ops_sent(service) == ["forward"], "the forward to be sent")
        service.release("forward")
        await asyncio.wait_for(custom, WAIT)
        assert (await asyncio.wait_for(step, WAIT)).metrics["step"] == 1.0

    asyncio.run(main())
    ordered = [(op, seq) for op, seq in service.submits if op != "get_info"]
    assert ordered == [("forward", 0), ("forward_backward", 1), ("optim_step", 2)]


@pytest.mark.parametrize("first", ["get_info", "save_weights"])
def test_value_returning_async_calls_take_their_place_when_made(first):
    """They were ``async def``: ``gather(tc.get_info_async(), tc.optim_step_async())`` counted
    the step, and a sampler named "before-step" sampled the weights after it."""
    service = FakeService()
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)

    async def main() -> None:
        call = tc.get_info_async() if first == "get_info" else tc.save_weights_and_get_sampling_client_async()
        _, step = await asyncio.wait_for(asyncio.gather(call, tc.optim_step_async(), return_exceptions=True), WAIT)
        await asyncio.wait_for(step, WAIT)  # the fake's answers make no sampler: an error, kept

    asyncio.run(main())
    assert ops_sent(service)[:2] == [first, "optim_step"]


def test_a_sync_call_on_a_running_loop_does_not_wait_for_a_get_info_task_of_that_loop():
    """get_info_async's place was given up by a callback on the caller's loop, which a sync
    ``.result()`` on that loop blocks: in a notebook cell both waited for ever."""
    service = FakeService(hold={"forward"})
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)

    async def main() -> float:
        custom = tc.forward_backward_custom([datum()], total_logprob)
        info = asyncio.create_task(tc.get_info_async())
        await asyncio.sleep(0)
        wait_until(lambda: ops_sent(service) == ["forward"], "the forward to be sent")
        service.release("forward")
        custom.result(WAIT)
        step = tc.optim_step().result(WAIT).metrics["step"]  # blocks this loop's thread
        await asyncio.wait_for(info, WAIT)
        return step

    assert asyncio.run(main()) == 1.0


def test_get_info_holds_its_place_until_answered():
    """It gave its place up before its own request went, so an optim_step made after it
    could reach the run first and be counted."""
    service = FakeService(hold={"get_info"})
    tc = trio.TrainingClient(Session(service), "run-1", MODEL)
    tc.forward_backward([datum()])
    info = tc.get_info_async()  # its place taken and its request on its way, unawaited
    step = tc.optim_step()
    wait_until(lambda: "get_info" in ops_sent(service), "get_info to be sent")
    assert ops_sent(service) == ["forward_backward", "get_info"]
    service.release("get_info")
    step.result(WAIT)
    assert ops_sent(service) == ["forward_backward", "get_info", "optim_step"]
    info.close()  # never awaited: its request went anyway


def test_many_losses_may_wait_on_the_sdk_at_once():
    """Losses ran on the SDK loop's default executor, whose own work (loading a tokenizer)
    they may wait for: with as many losses as its threads (6 on 2 cores) all waited for ever.
    Here one more loss than those threads each waits for all the others to be running."""
    losses = min(32, (os.cpu_count() or 1) + 4) + 1
    all_running = threading.Barrier(losses, timeout=WAIT)

    def loss(data, logprobs):
        all_running.wait()
        return total_logprob(data, logprobs)

    service = FakeService()
    session = Session(service)
    customs = [trio.TrainingClient(session, f"run-{k}", MODEL).forward_backward_custom([datum()], loss)
               for k in range(losses)]
    assert all(custom.result(2 * WAIT).metrics["custom"] == 1.0 for custom in customs)


def test_a_ticket_given_up_before_its_turn_keeps_the_order():
    """A cancelled wait cancelled the earlier ticket's release too, and giving the place up
    then let every later call go ahead of the earlier ones."""
    first, second, third = SubmitOrder().take(3)

    async def main() -> None:
        wait = asyncio.create_task(second.turn())
        await asyncio.sleep(0)
        wait.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wait
        second.release()
        assert not first.released.cancelled() and not second.released.done()
        first.release()
        await asyncio.wait_for(third.turn(), WAIT)

    asyncio.run(main())
