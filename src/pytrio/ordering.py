"""A training run's submit order: calls are sent in the order they are made, and each
gets its sequence number only when it is sent.

The service runs a run's requests strictly by sequence number. Numbering at call time
made the order depend on timing: ``forward_backward_custom`` reserved its backward's
number at call time but could send it only after its forward came back and the loss
ran, and a submit retried through a restart arrived late too. Meanwhile the next call
(typically ``optim_step``) had already been sent with a higher number, and the service,
which skips a number that has not arrived after ``seq_gap_seconds``, ran it first and
then refused the late one. Here no timeout is involved:

- ``take()``, at call time in the caller's thread, queues a ``Ticket``: call order is
  ticket order.
- The call's coroutine ``await ticket.turn()``: that returns once every earlier ticket
  is released. It then takes ``ticket.number()``, submits, and ``release()``s the
  ticket, which lets the next call be sent (it does not wait for the result, so calls
  still pipeline: ``forward_backward`` and ``optim_step`` back to back is two quick
  submits, then both run on the service).
- A reservation is a ticket held: ``forward_backward_custom`` takes two at once, and
  holds its backward's while the forward and the loss run; later calls wait for it,
  in the client. A ticket released without a number (the forward failed, the loss
  raised) costs nothing: the next call goes at once with the next number. Nor does a
  call the service refused unread (a body over its size limit: ``seq_unused``): its
  number is given back, and the next call takes it.

So the service sees each live client's numbers in order and without gaps. Its gap-skip
is left for one case only: a submit the client gave up on after retrying for the whole
reconnect window (the service stayed unreachable). That number was spent (the request
may have arrived, its reply lost), and it can never arrive afterwards, so skipping it
cannot reorder anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading


class SubmitOrder:
    """The tickets of one TrainingClient; thread-safe ``take``, numbers from 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: concurrent.futures.Future[None] | None = None  # released by the newest ticket
        self._next_number = 0  # touched only by the ticket whose turn it is
        self.waiting = 0  # tickets awaiting their turn (for tests and debugging)

    def take(self, count: int = 1) -> list[Ticket]:
        """``count`` consecutive tickets: nothing taken meanwhile can come between them."""
        with self._lock:
            tickets = []
            for _ in range(count):
                ticket = Ticket(self, self._last)
                self._last = ticket.released
                tickets.append(ticket)
            return tickets

    def _number(self) -> int:
        number, self._next_number = self._next_number, self._next_number + 1
        return number


class Ticket:
    """One call's place in the order."""

    def __init__(self, order: SubmitOrder, previous: concurrent.futures.Future[None] | None):
        self._order, self._previous = order, previous
        self.released: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def turn(self) -> None:
        """Wait until every earlier call was sent (or gave up its place).

        Shielded: a cancelled wait leaves the earlier ticket's ``released`` as it was
        (``wrap_future`` alone cancelled it, and every later call overtook the earlier ones)."""
        if self._previous is None or self._previous.done():
            return
        self._order.waiting += 1
        try:
            await asyncio.shield(asyncio.wrap_future(self._previous))
        finally:
            self._order.waiting -= 1

    def number(self) -> int:
        """The next sequence number; call it once, during this ticket's turn."""
        assert self._previous is None or self._previous.done(), "not this ticket's turn"
        return self._order._number()

    def give_back_number(self) -> None:
        """The number this ticket took was never seen by the service: the next call takes it."""
        assert self._previous is None or self._previous.done(), "not this ticket's turn"
        self._order._next_number -= 1

    def release(self) -> None:
        """Let the next call go once every earlier one has; safe to call more than once.
        A ticket given up before its turn came (its wait cancelled) passes its place on
        only when the calls before it have gone, so none is overtaken."""
        if self._previous is not None and not self._previous.done():
            self._previous.add_done_callback(lambda _: self._set_released())
        else:
            self._set_released()

    def _set_released(self) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # released already
            self.released.set_result(None)
