"""The request cycle every operation shares: submit once (idempotently), then long-poll
the future until it is done or failed, and map failures onto the SDK's errors.
Pure of I/O details: the transport moves the bytes.

A long wait is not silent: once a request has waited ``QUEUE_NOTICE_AFTER`` seconds
while queued behind others, one line goes to the ``pytrio.queue`` logger, and again
every ``QUEUE_NOTICE_EVERY`` seconds while it stays queued::

    pytrio: request req-1f2e queued: position 3, starts in ~12 s (waited 10 s)

It is logged at WARNING so that it shows with no logging set up (Python prints WARNING
and above to stderr by default; pytrio installs no handler). Silence it with
``logging.getLogger("pytrio.queue").setLevel(logging.ERROR)``. A request that is
running, not queued, prints nothing; nor does one queued only behind the same user's
earlier calls (a pipelined loop waits for itself, and knows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from .errors import CapacityError, TrioError, error_from_category, is_transient
from .errors import ConnectionError as TrioConnectionError
from .errors import TimeoutError as TrioTimeoutError
from .futures import on_background
from .transport import Transport
from .types import FutureResponse, load_tokenizer

R = TypeVar("R", bound=BaseModel)

POLL_SECONDS = 30.0
RECONNECT_SECONDS = 60.0
QUEUE_NOTICE_AFTER = 10.0  # seconds of waiting before the first "queued" line
QUEUE_NOTICE_EVERY = 30.0  # then at most one line per this many seconds

queue_log = logging.getLogger("pytrio.queue")


class QueueNotice:
    """When to say where a waiting request stands, and what to say. Pure but for the clock.

    ``poll_timeout`` shortens a long poll so that an answer comes back when a line is
    due; ``line`` turns a pending answer into that line (None: not due, or not queued).
    """

    def __init__(self, request_id: str, clock: Callable[[], float],
                 after: float = QUEUE_NOTICE_AFTER, every: float = QUEUE_NOTICE_EVERY):
        self.request_id, self.clock, self.every = request_id, clock, every
        self.started = clock()
        self.due = self.started + after

    def poll_timeout(self) -> float:
        """How long the next long poll may wait: until the next line is due, at most POLL_SECONDS."""
        return min(POLL_SECONDS, max(1.0, self.due - self.clock()))

    def line(self, state: FutureResponse) -> str | None:
        now = self.clock()
        if now < self.due:
            return None
        self.due = now + self.every
        if state.queue_position is None or state.queue_state == "running" or state.others_ahead == 0:
            return None  # running, or waiting only behind this user's own earlier calls
        eta = ("no start estimate yet" if state.starts_in_seconds is None
               else f"starts in ~{state.starts_in_seconds:.0f} s")
        return (f"pytrio: request {self.request_id} queued: position {state.queue_position}, {eta} "
                f"(waited {now - self.started:.0f} s)")


FIRST_BACKOFF_SECONDS = 0.1
MAX_BACKOFF_SECONDS = 2.0  # exponential back-off stops growing here
MAX_RETRY_AFTER_SECONDS = 30.0  # a longer Retry-After is waited only this long before asking again
JITTER = 0.25  # each wait is stretched by up to this fraction, so refused clients do not return in step


def backoff_seconds(attempt: int, retry_after: float | None, jitter: float) -> float:
    """How long to wait before resubmitting after the ``attempt``-th refusal (0-based).

    The service's ``Retry-After`` (capped at MAX_RETRY_AFTER_SECONDS) when it gave one,
    else exponential back-off capped at MAX_BACKOFF_SECONDS; then stretched by
    ``1 + JITTER * jitter`` (``jitter`` in [0, 1)), never shortened: a client never
    comes back sooner than it was asked to.
    """
    if retry_after is not None:
        base = min(max(retry_after, 0.0), MAX_RETRY_AFTER_SECONDS)
    else:
        base = min(MAX_BACKOFF_SECONDS, FIRST_BACKOFF_SECONDS * 2 ** min(attempt, 30))
    return base * (1 + JITTER * jitter)


class Session:
    """One connection to a service (a transport), shared by all clients it creates."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._tokenizers: dict[str, Any] = {}

    async def call(self, op: str, request: BaseModel, result_type: type[R]) -> R:
        """Submit ``request`` as ``op`` and wait for its result (on the SDK's loop)."""
        return await on_background(self._call(op, request, result_type))

    async def submit(self, op: str, request: BaseModel) -> str:
        """Submit only (the service answers at once); returns the request id."""
        return await on_background(self._submit(op, request.model_dump(mode="json")))

    async def result(self, request_id: str, result_type: type[R]) -> R:
        """Wait for the outcome of a submitted request."""
        return await on_background(self._result(request_id, result_type))

    async def settled(self, request_id: str) -> None:
        """Wait until a submitted request has finished, done or failed: its outcome
        (and any error in getting it) is for its own caller, not for this wait."""
        async def wait() -> None:
            while (await self._retrieve(request_id)).status == "pending":
                pass

        with contextlib.suppress(TrioError):
            await on_background(wait())

    async def _call(self, op: str, request: BaseModel, result_type: type[R]) -> R:
        request_id = await self._submit(op, request.model_dump(mode="json"))
        return await self._result(request_id, result_type)

    async def _result(self, request_id: str, result_type: type[R]) -> R:
        notice = QueueNotice(request_id, time.monotonic)
        while True:
            state = await self._retrieve(request_id, notice.poll_timeout())
            if state.status == "pending" and (line := notice.line(state)):
                queue_log.warning(line)
            if state.status == "done":
                return result_type.model_validate(state.result)
            if state.status == "failed":
                assert state.error is not None
                raise error_from_category(state.error.category, state.error.message, request_id,
                                          state.error.status_code)

    async def _retrieve(self, request_id: str, timeout: float = POLL_SECONDS) -> FutureResponse:
        """One long poll (of ``timeout`` s); rides out a service restart for up to RECONNECT_SECONDS."""
        deadline = time.monotonic() + RECONNECT_SECONDS
        delay = 0.1
        while True:
            try:
                return await self.transport.retrieve(request_id, timeout)
            except (TrioConnectionError, TrioTimeoutError) as exc:
                if time.monotonic() > deadline:
                    exc.request_id = request_id
                    raise
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
            except TrioError as exc:  # whatever else stops the wait, the caller learns which request
                exc.request_id = exc.request_id or request_id
                raise

    async def _submit(self, op: str, body: dict[str, Any]) -> str:
        """Submit, retrying what may pass on its own (unreachable, 429, 5xx) until
        RECONNECT_SECONDS have passed (``backoff_seconds`` apart; the last wait ends at
        the deadline, for one last try). Retries reuse one idempotency key, so a retried
        submit never runs twice, and one the service had accepted answers its request id.

        Raises:
            CapacityError: the service still refused it as over capacity at the deadline
                (the message says which limit, how many tries and how long).
        """
        key = uuid.uuid4().hex
        started = time.monotonic()
        deadline = started + RECONNECT_SECONDS  # ride out a service restart, or a full queue
        attempt = 0
        while True:
            try:
                return await self.transport.submit(op, body, key)
            except TrioError as exc:
                left = deadline - time.monotonic()
                if not is_transient(exc) or left <= 0:
                    if isinstance(exc, CapacityError):
                        exc.message = (f"{op}: gave up after {attempt + 1} tries over "
                                       f"{time.monotonic() - started:.0f} s: {exc.message}")
                        exc.args = (exc.message,)
                    raise
                await asyncio.sleep(min(left, backoff_seconds(attempt, exc.retry_after, random.random())))
                attempt += 1

    async def tokenizer(self, base_model: str) -> Any:
        """A Hugging Face tokenizer from files the service provides (no model hub)."""
        if base_model not in self._tokenizers:
            files = await on_background(self.transport.tokenizer_files(base_model))
            self._tokenizers[base_model] = await asyncio.to_thread(_load_tokenizer, files.contents())
        return self._tokenizers[base_model]


def _load_tokenizer(files: dict[str, bytes]) -> Any:
    """The client's copy of a tokenizer, cached under ``$TRIO_HOME/client-tokenizers``."""
    home = Path(os.environ.get("TRIO_HOME") or Path.home() / ".cache" / "trio")
    return load_tokenizer(files, home / "client-tokenizers")
