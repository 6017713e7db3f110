"""Queue state of a pending request: its position on its model host, and when it should start.

Pure functions and one small record of recent execution times; the worker feeds them
(``HostWorker.queue_info``) and the core puts the answer in a pending future's response.

    position   the requests of the same model host that run before it: those running
               now plus those queued earlier (arrival order). 0 for a request that is
               next, or is running itself.
    others_ahead  of those, other users' (the SDK tells a wait behind others apart from
               one behind the user's own pipelined calls).
    starts_in  seconds until it should start: what remains of the running batch's
               expected time, plus the expected time of each earlier queued request.
               An operation's expected time is the mean of its last ``KEEP`` batches on
               this host; an operation not seen yet takes the mean of all operations
               seen; with no history at all there is no estimate (None).

It is an estimate, and simple on purpose: requests ahead that will share one batch
(``forward_backward`` of several runs, samples) are counted one by one, so it leans
high when many batchable requests wait; a run's requests waiting for an earlier sequence
number, and the scheduler's choices, can make the real order differ from arrival order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

KEEP = 20  # batches per operation remembered


@dataclass(frozen=True)
class QueueInfo:
    running: bool
    position: int
    starts_in: float | None  # seconds; None: no estimate
    others_ahead: int = 0  # of ``position``, other users' requests (the rest are this user's own)


class OpDurations:
    """The recent execution times of each operation on one model host."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.recent: dict[str, deque[float]] = {}

    def record(self, op: str, seconds: float) -> None:
        self.recent.setdefault(op, deque(maxlen=self.keep)).append(seconds)

    def expected(self, op: str) -> float | None:
        """The mean of ``op``'s recent times; of all operations' if ``op`` has none; else None."""
        times = self.recent.get(op) or [s for q in self.recent.values() for s in q]
        return sum(times) / len(times) if times else None


def estimate_start(durations: OpDurations, ahead: Iterable[str], running_op: str | None,
                   running_for: float) -> float | None:
    """Seconds until a request starts, with ``ahead`` (the operations queued before it) and
    a batch of ``running_op`` (None: nothing running) that has run for ``running_for`` s."""
    total = 0.0
    if running_op is not None:
        expected = durations.expected(running_op)
        if expected is None:
            return None
        total += max(0.0, expected - running_for)
    for op in ahead:
        expected = durations.expected(op)
        if expected is None:
            return None
        total += expected
    return total


def describe(info: QueueInfo) -> str:
    """The ``queue_state`` text of a pending future."""
    return "running" if info.running else f"queued (position {info.position})"
