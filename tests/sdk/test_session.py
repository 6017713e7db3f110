"""Session's request cycle over a flaky in-memory transport: retried submits reuse their
idempotency key (so a retry never runs twice), transient failures are ridden out for
RECONNECT_SECONDS and then raised with the request id, other errors are not retried.

Time is faked: Session's clock and sleep are replaced by a clock that advances only when
Session sleeps, so the tests take no real time and do not depend on timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

import pytrio as trio
from pytrio import session as session_mod
from pytrio import types as t
from pytrio.errors import ConnectionError as TrioConnectionError
from pytrio.errors import TimeoutError as TrioTimeoutError
from pytrio.session import Session

from .fakes import OperationsOnly

MODEL = "trio/tiny-llama"
WAIT = 5.0  # real seconds; a bound for broken tests, never reached by passing ones
FOREVER = 10**9


class FlakyTransport(OperationsOnly):
    """The Transport protocol in memory, with the service's idempotency: a submit whose
    key was seen before answers the first request id and does not run again.

    Args:
        refused: submits that fail before reaching the service (connection refused).
        lost_replies: submits that reach the service but whose reply is lost.
        retrieve_down: polls that fail with ``retrieve_error`` before one gets through.
        pending: polls answered "pending" before the outcome.
        outcome: ("done", result) or ("failed", (category, message)).
        outage: while this returns True, submits are refused as well.
        submit_error / retrieve_raises: a non-transient error to raise on every call.
        queued: the queue fields of the "pending" answers (default: queue_state "active").
        long_poll: called with the timeout of each poll answered "pending" (a long poll
            that found nothing waited that long: a fake clock advances by it).
    """

    def __init__(
        self,
        refused: int = 0,
        outage: Callable[[], bool] = lambda: False,
        lost_replies: int = 0,
        retrieve_down: int = 0,
        retrieve_error: type[trio.TrioError] = TrioConnectionError,
        pending: int = 0,
        outcome: tuple[str, Any] = ("done", {"metrics": {"step": 1.0}}),
        submit_error: trio.TrioError | None = None,
        retrieve_raises: trio.TrioError | None = None,
        queued: dict[str, Any] | None = None,
        long_poll: Callable[[float], None] = lambda timeout: None,
    ):
        self.queued, self.long_poll = queued or {"queue_state": "active"}, long_poll
        self.refused, self.outage, self.lost_replies = refused, outage, lost_replies
        self.retrieve_down, self.retrieve_error, self.pending = retrieve_down, retrieve_error, pending
        self.outcome, self.submit_error, self.retrieve_raises = outcome, submit_error, retrieve_raises
        self.attempts: list[tuple[str, dict[str, Any], str]] = []  # every submit call: (op, body, key)
        self.by_key: dict[str, str] = {}  # idempotency key -> request id, as the service stores it
        self.executed: list[str] = []  # request ids the "service" accepted to run
        self.polls: list[tuple[str, float]] = []  # every retrieve call: (request id, timeout)

    async def submit(self, op: str, body: dict[str, Any], idempotency_key: str) -> str:
        self.attempts.append((op, body, idempotency_key))
        if self.submit_error is not None:
            raise self.submit_error
        if self.refused or self.outage():
            self.refused = max(0, self.refused - 1)
            raise TrioConnectionError(f"POST /{op}: cannot reach http://trio.test (connection refused)")
        if idempotency_key not in self.by_key:
            self.by_key[idempotency_key] = request_id = f"req-{len(self.by_key)}"
            self.executed.append(request_id)
        if self.lost_replies:
            self.lost_replies -= 1
            raise TrioConnectionError(f"POST /{op}: cannot reach http://trio.test (connection reset)")
        return self.by_key[idempotency_key]

    async def retrieve(self, request_id: str, timeout: float) -> t.FutureResponse:
        self.polls.append((request_id, timeout))
        if self.retrieve_raises is not None:
            raise self.retrieve_raises
        if self.retrieve_down:
            self.retrieve_down -= 1
            raise self.retrieve_error("POST /retrieve_future: service unavailable")
        if self.pending:
            self.pending -= 1
            self.long_poll(timeout)
            return t.FutureResponse(request_id=request_id, status="pending", **self.queued)
        status, payload = self.outcome
        if status == "failed":
            category, message = payload
            error = t.ErrorInfo(category=category, message=message)
            return t.FutureResponse(request_id=request_id, status="failed", error=error)
        return t.FutureResponse(request_id=request_id, status="done", result=payload)


class FakeClock:
    """Session's ``time.monotonic`` and ``asyncio.sleep``: sleeping advances the clock."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)  # still yield to the loop, as a real sleep would


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    # Replace only the session module's references, never the real time/asyncio modules
    # (the SDK's event loop itself runs on time.monotonic).
    fake = FakeClock()
    monkeypatch.setattr(session_mod, "time", SimpleNamespace(monotonic=fake.monotonic))
    monkeypatch.setattr(session_mod, "asyncio", SimpleNamespace(sleep=fake.sleep, to_thread=asyncio.to_thread))
    return fake


def optim_step(transport: FlakyTransport) -> trio.OptimStepResponse:
    """One operation through the public client, as a user makes it."""
    tc = trio.TrainingClient(Session(transport), "run-1", MODEL)
    return tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result(timeout=WAIT)


def keys(transport: FlakyTransport) -> list[str]:
    return [key for _, _, key in transport.attempts]


def test_a_retried_submit_reuses_its_idempotency_key(clock):
    transport = FlakyTransport(refused=3)
    assert optim_step(transport).metrics == {"step": 1.0}
    assert len(transport.attempts) == 4
    assert len(set(keys(transport))) == 1 and keys(transport)[0]
    assert all(body == transport.attempts[0][1] for _, body, _ in transport.attempts)
    assert transport.attempts[0][1]["model_id"] == "run-1"
    assert len(clock.sleeps) == 3  # it waited between attempts instead of hammering


def test_a_submit_whose_reply_was_lost_runs_once(clock):
    """The case the key exists for: the service got the request, the client did not hear."""
    transport = FlakyTransport(lost_replies=2)
    optim_step(transport)
    assert len(transport.attempts) == 3 and len(set(keys(transport))) == 1
    assert transport.executed == ["req-0"]
    assert {request_id for request_id, _ in transport.polls} == {"req-0"}


def test_two_submits_carry_different_keys(clock):
    transport = FlakyTransport(refused=1)
    optim_step(transport)
    transport.refused = 1
    optim_step(transport)
    first, second = keys(transport)[:2], keys(transport)[2:]
    assert len(first) == 2 and len(second) == 2
    assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]
    assert transport.executed == ["req-0", "req-1"]


def test_backoff_grows_and_is_capped(clock, monkeypatch):
    monkeypatch.setattr(session_mod, "random", SimpleNamespace(random=lambda: 0.0))  # no jitter
    optim_step(FlakyTransport(refused=12))
    assert len(clock.sleeps) == 12
    assert all(0 < s <= 2.0 for s in clock.sleeps)
    assert clock.sleeps == sorted(clock.sleeps) and clock.sleeps[-1] > clock.sleeps[0]


def test_backoff_honours_retry_after_caps_it_and_jitter_only_stretches_it():
    from pytrio.session import JITTER, MAX_BACKOFF_SECONDS, MAX_RETRY_AFTER_SECONDS, backoff_seconds

    assert [backoff_seconds(k, None, 0.0) for k in range(3)] == [0.1, 0.2, 0.4]
    assert backoff_seconds(40, None, 0.0) == MAX_BACKOFF_SECONDS
    assert backoff_seconds(0, 7.0, 0.0) == 7.0  # Retry-After, not the exponential step
    assert backoff_seconds(0, 1e6, 0.0) == MAX_RETRY_AFTER_SECONDS
    assert backoff_seconds(0, -3.0, 0.5) == 0.0
    assert backoff_seconds(2, None, 0.999) == pytest.approx(0.4 * (1 + JITTER * 0.999))
    assert backoff_seconds(0, 7.0, 0.5) == 7.0 * (1 + JITTER * 0.5)


def test_submit_gives_up_after_the_reconnect_window(clock, monkeypatch):
    monkeypatch.setattr(session_mod, "RECONNECT_SECONDS", 5.0)
    transport = FlakyTransport(refused=FOREVER)
    start = clock.now
    with pytest.raises(trio.ConnectionError, match="connection refused") as err:
        optim_step(transport)
    waited = clock.now - start
    assert waited == pytest.approx(5.0)  # the whole window: the last wait ends at the deadline, for one last try
    assert len(transport.attempts) > 2 and len(set(keys(transport))) == 1
    assert err.value.request_id is None  # the service never assigned one
    assert transport.executed == []


def test_submit_rides_out_a_whole_restart_window(clock):
    """With the real RECONNECT_SECONDS: a service down for 50 s (fake time) is ridden out."""
    back_at = clock.now + 50.0
    transport = FlakyTransport(outage=lambda: clock.now < back_at)
    assert optim_step(transport).metrics == {"step": 1.0}
    assert clock.now >= back_at and len(transport.attempts) > 10
    assert len(set(keys(transport))) == 1 and transport.executed == ["req-0"]


@pytest.mark.parametrize("error", [TrioConnectionError, TrioTimeoutError])
def test_retrieve_rides_out_transient_failures_without_resubmitting(clock, error):
    transport = FlakyTransport(retrieve_down=4, retrieve_error=error)
    assert optim_step(transport).metrics == {"step": 1.0}
    assert len(transport.attempts) == 1 and transport.executed == ["req-0"]
    assert [request_id for request_id, _ in transport.polls] == ["req-0"] * 5
    assert len(clock.sleeps) == 4


@pytest.mark.parametrize("error", [TrioConnectionError, TrioTimeoutError])
def test_retrieve_gives_up_after_the_reconnect_window_with_the_request_id(clock, monkeypatch, error):
    monkeypatch.setattr(session_mod, "RECONNECT_SECONDS", 5.0)
    transport = FlakyTransport(retrieve_down=FOREVER, retrieve_error=error)
    start = clock.now
    with pytest.raises(error, match="service unavailable") as err:
        optim_step(transport)
    assert type(err.value) is error
    assert err.value.request_id == "req-0" and "req-0" in str(err.value)
    assert 5.0 < clock.now - start <= 5.0 + 2.0
    assert len(transport.polls) > 2 and len(transport.attempts) == 1


def test_pending_polls_again_at_once_with_the_long_poll_timeout(clock):
    """The first poll is cut to QUEUE_NOTICE_AFTER, so a long wait is reported on time."""
    transport = FlakyTransport(pending=3, long_poll=clock.advance)
    optim_step(transport)
    assert transport.polls == [("req-0", session_mod.QUEUE_NOTICE_AFTER)] + [("req-0", session_mod.POLL_SECONDS)] * 3
    assert clock.sleeps == []  # the service's long poll is the wait; no client-side sleep


def test_a_long_queued_wait_logs_its_position_and_start_once_then_every_30_s(clock, caplog):
    """Broken on purpose once (line() always None): no lines, and this test failed."""
    queued = {"queue_state": "queued (position 3)", "queue_position": 3, "starts_in_seconds": 12.4, "others_ahead": 1}
    transport = FlakyTransport(pending=4, queued=queued, long_poll=clock.advance)
    with caplog.at_level("WARNING", logger="pytrio.queue"):
        optim_step(transport)
    lines = [r.getMessage() for r in caplog.records if r.name == "pytrio.queue"]
    assert lines == [f"pytrio: request req-0 queued: position 3, starts in ~12 s (waited {s} s)"
                     for s in (10, 40, 70, 100)]


def test_a_running_request_a_short_wait_or_one_behind_the_users_own_calls_logs_nothing(clock, caplog):
    running = {"queue_state": "running", "queue_position": 0, "starts_in_seconds": 0.0}
    own = {"queue_state": "queued (position 3)", "queue_position": 3, "starts_in_seconds": 12.4, "others_ahead": 0}
    with caplog.at_level("WARNING", logger="pytrio.queue"):
        optim_step(FlakyTransport(pending=3, queued=running, long_poll=clock.advance))
        optim_step(FlakyTransport(pending=4, queued=own, long_poll=clock.advance))  # a pipelined loop's wait
        optim_step(FlakyTransport(pending=3, queued={"queue_state": "queued (position 1)", "queue_position": 1}))
    assert [r for r in caplog.records if r.name == "pytrio.queue"] == []  # the second: no time passed


def test_queue_notice_is_due_after_its_delay_and_says_when_there_is_no_estimate():
    now = [0.0]
    notice = session_mod.QueueNotice("req-9", lambda: now[0], after=10.0, every=30.0)
    state = t.FutureResponse(request_id="req-9", status="pending", queue_state="queued (position 0)",
                             queue_position=0)
    assert notice.poll_timeout() == 10.0 and notice.line(state) is None
    now[0] = 9.9
    assert notice.line(state) is None and notice.poll_timeout() == pytest.approx(1.0)  # never below 1 s
    now[0] = 10.0
    assert notice.line(state) == "pytrio: request req-9 queued: position 0, no start estimate yet (waited 10 s)"
    assert notice.line(state) is None and notice.poll_timeout() == 30.0
    now[0] = 35.0
    assert notice.poll_timeout() == 5.0


@pytest.mark.parametrize(
    ("category", "error"),
    [("validation", trio.ValidationError), ("not_found", trio.NotFoundError), ("capacity", trio.CapacityError),
     ("server", trio.ServerError), ("something_new", trio.ServerError)],
)
def test_a_failed_outcome_raises_its_category_with_the_request_id(clock, category, error):
    transport = FlakyTransport(outcome=("failed", (category, "it went wrong")))
    with pytest.raises(error, match="it went wrong") as err:
        optim_step(transport)
    assert type(err.value) is error and err.value.request_id == "req-0"


def test_errors_that_are_not_transient_are_not_retried(clock):
    transport = FlakyTransport(submit_error=trio.ValidationError("data[0].weights: wrong length"))
    with pytest.raises(trio.ValidationError, match="weights"):
        optim_step(transport)
    assert len(transport.attempts) == 1

    transport = FlakyTransport(retrieve_raises=trio.NotFoundError("request req-0 not found"))
    with pytest.raises(trio.NotFoundError):
        optim_step(transport)
    assert len(transport.polls) == 1
    assert clock.sleeps == []


def test_any_error_while_retrieving_carries_the_request_id(clock):
    transport = FlakyTransport(retrieve_raises=trio.ServerError("502 Bad Gateway", status_code=502))
    with pytest.raises(trio.ServerError) as err:
        optim_step(transport)
    assert err.value.request_id == "req-0"


# -- overload and server errors at submit: retried with back-off, Retry-After honoured ----


class Refusing(FlakyTransport):
    """Submits answered with ``errors`` (one per attempt) before one is accepted."""

    def __init__(self, errors: list[trio.TrioError]):
        super().__init__()
        self.errors = errors

    async def submit(self, op: str, body: dict[str, Any], idempotency_key: str) -> str:
        if self.errors:
            self.attempts.append((op, body, idempotency_key))
            raise self.errors.pop(0)
        return await super().submit(op, body, idempotency_key)


def test_a_submit_refused_with_429_or_5xx_is_retried_with_the_same_key(clock):
    busy = trio.CapacityError("too many requests in flight", status_code=429)
    transport = Refusing([busy, trio.ServerError("Bad Gateway", status_code=502),
                          trio.ServerError("Service Unavailable", status_code=503)])
    assert optim_step(transport).metrics == {"step": 1.0}
    assert len(transport.attempts) == 4 and len(set(keys(transport))) == 1
    assert transport.executed == ["req-0"] and len(clock.sleeps) == 3


def test_a_submit_waits_as_long_as_retry_after_says(clock):
    busy = trio.CapacityError("slow down", status_code=429)
    busy.retry_after = 7.0
    transport = Refusing([busy])
    optim_step(transport)
    assert len(clock.sleeps) == 1 and 7.0 <= clock.sleeps[0] <= 7.0 * (1 + session_mod.JITTER)


def test_a_submit_over_capacity_until_the_deadline_raises_capacity_error_naming_the_call(clock, monkeypatch):
    monkeypatch.setattr(session_mod, "RECONNECT_SECONDS", 10.0)
    # A fixed jitter (waits of 3 * 1.225 s): with random draws, three short waits can fit
    # before the 10 s deadline and make a fifth try (about 4 runs in 10 failed that way).
    monkeypatch.setattr(session_mod, "random", SimpleNamespace(random=lambda: 0.9))
    refusals = []
    for _ in range(100):
        busy = trio.CapacityError("capacity max_pending_per_user: 1 requests of this user pending, the limit is 1",
                                  status_code=429)
        busy.retry_after = 3.0
        refusals.append(busy)
    transport = Refusing(refusals)
    start = clock.now
    with pytest.raises(trio.CapacityError, match=r"optim_step: gave up after 4 tries over 10 s: capacity "
                                                  r"max_pending_per_user: .* the limit is 1") as err:
        optim_step(transport)
    assert clock.now - start == pytest.approx(10.0)  # 3 waits of 3-3.75 s, the last cut to the deadline
    assert all(3.0 <= s <= 3.75 for s in clock.sleeps[:-1]) and len(clock.sleeps) == 3
    assert err.value.status_code == 429 and err.value.request_id is None
    assert len(set(keys(transport))) == 1 and transport.executed == []


def test_a_retry_after_beyond_the_deadline_is_cut_to_it_and_the_submit_tried_once_more(clock, monkeypatch):
    monkeypatch.setattr(session_mod, "RECONNECT_SECONDS", 5.0)
    busy = trio.CapacityError("queue full", status_code=429)
    busy.retry_after = 25.0
    transport = Refusing([busy])
    assert optim_step(transport).metrics == {"step": 1.0}
    assert clock.sleeps == [pytest.approx(5.0)] and transport.executed == ["req-0"]


def test_a_submit_refused_for_good_gives_up_after_the_window(clock, monkeypatch):
    monkeypatch.setattr(session_mod, "RECONNECT_SECONDS", 5.0)
    transport = Refusing([trio.ServerError("Service Unavailable", status_code=503) for _ in range(100)])
    with pytest.raises(trio.ServerError, match="Unavailable") as err:
        optim_step(transport)
    assert err.value.status_code == 503 and 2 < len(transport.attempts) < 100
