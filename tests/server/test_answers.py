"""``worker.Answers``: a step is answered once its snapshot is on disk, each run's answers
in the order its calls ran, and a write its engine never made turns the step into an error."""

from __future__ import annotations

import collections
import threading

from trio_server.engine import Durability, SnapshotLost
from trio_server.scheduler import WorkItem
from trio_server.worker import Answers

from ..polling import wait_until


class HeldWrites:
    """An engine whose snapshot writes land when the test says (``land``, or all at once
    with ``landed``); ``lost`` ones never do."""

    def __init__(self):
        self.landed = threading.Event()
        self.each: dict[int, threading.Event] = collections.defaultdict(threading.Event)
        self.lost: set[int] = set()

    def land(self, write: int) -> None:
        self.each[write].set()

    def durable(self, write: Durability) -> None:
        if write.write in self.lost:
            raise SnapshotLost(f"run {write.run_id}: its engine restarted")
        while not (self.landed.is_set() or self.each[write.write].wait(0.01)):
            pass


STORED: list[str] = []  # request ids whose ``when_kept`` ran, in order


def item(op: str, run_id: str, seq: int, write: int | None = None) -> WorkItem:
    work = WorkItem(request_id=f"{run_id}-{seq}", op=op, request=None, user_id="u", run_id=run_id, seq=seq)
    if write is not None:
        work.context["durable"] = Durability("engine-1", run_id, write, step=write)
        work.context["when_kept"] = lambda: STORED.append(work.request_id)
    return work


def answers_to(engine: HeldWrites) -> tuple[Answers, list]:
    answered: list = []
    STORED.clear()
    return Answers("test-answers", engine, lambda i, r: answered.append((i.request_id, r[1]))), answered


def test_a_step_and_its_runs_later_calls_wait_for_its_write_and_other_runs_do_not():
    engine = HeldWrites()
    answers, answered = answers_to(engine)
    ok = (object(), None)
    answers.answer(item("optim_step", "a", 0, write=1), ok)
    answers.answer(item("forward", "a", 1), ok)
    answers.answer(item("forward", "b", 0), ok)
    assert answered == [("b-0", None)]  # run b is answered at once, from the caller's thread
    assert STORED == []  # nor is the step stored before its write lands
    engine.landed.set()
    answers.close(60)
    assert STORED == ["a-0"]
    assert [rid for rid, _ in answered] == ["b-0", "a-0", "a-1"]
    answers.answer(item("forward", "a", 2), ok)  # nothing queued for a any more: at once
    assert answered[-1] == ("a-2", None)


def test_a_run_with_answers_still_queued_keeps_queueing_its_next_ones():
    """Two steps queued: once the first is answered, the run's next call still queues
    behind the second step, however many of its answers have gone out."""
    engine = HeldWrites()
    answers, answered = answers_to(engine)
    ok = (object(), None)
    answers.answer(item("optim_step", "a", 0, write=1), ok)
    answers.answer(item("optim_step", "a", 1, write=2), ok)
    engine.land(1)
    wait_until(lambda: answered == [("a-0", None)], "the first step's answer")
    answers.answer(item("forward", "a", 2), ok)
    assert answered == [("a-0", None)]  # behind step 2, whose write has not landed
    engine.land(2)
    answers.close(60)
    assert [rid for rid, _ in answered] == ["a-0", "a-1", "a-2"]


def test_a_step_whose_write_its_engine_never_made_fails_and_says_to_run_it_again():
    engine = HeldWrites()
    engine.lost.add(1)
    engine.landed.set()
    answers, answered = answers_to(engine)
    answers.answer(item("optim_step", "a", 0, write=1), (object(), None))
    answers.close(60)
    ((rid, error),) = answered
    assert rid == "a-0" and error.status == 500 and "step is lost" in error.message
    assert "forward_backward calls again" in error.message
    assert STORED == []  # a lost step is not stored
