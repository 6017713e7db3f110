"""One worker thread per base model: schedule -> execute -> resolve, over one engine.

The worker owns its queue and the fair-queueing state between users.
``scheduler.next_work`` (pure) picks what runs next and bills it to its users,
``handlers.execute`` runs it on the engine, and the core's ``resolve`` stores each
outcome and wakes its waiters: through ``Answers``, which holds a step's answer until its
snapshot is on disk without holding up the worker.

Sampling is continuous batching: the worker keeps a decode batch running in the engine.
Each turn of the loop admits the sample requests that arrived (``scheduler.next_work``),
runs at most one other batch (training etc.), then one decode step
(``handlers.decode``), and resolves every request that finished in that step at once, so
a short request never waits for a long one it shares the batch with.

A large forward or forward_backward request runs one part at a time
(``splitting.py``; split by the pass budget when queued, and again if the budget changes
before it runs): after each part the worker queues the next (due by its user's tag,
so other users may go first), and resolves the request once, when its last part is done
or one failed (``handlers.finish_split`` then merges the parts' results, or rolls the
run's grads back to before the first part). On every turn of its loop, the worker
lets runs leave memory (``Engine.offload``: to their snapshot, back on their next
request): those whose client went quiet, and beyond ``max_resident_runs`` the least
recently used, so a busy server's memory stays bounded however many runs its users
leave behind. When idle, it also lets a run continue past a sequence number that never
arrived.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .engine import Engine, SnapshotLost
from .errors import ServiceError
from .handlers import Context, Result, decode, execute, finish_split, log_outcome
from .queueing import OpDurations, QueueInfo, estimate_start
from .scheduler import Fairness, Work, WorkItem, next_work, stalled_runs
from .splitting import Split, maybe_split, merge_elapsed, split_of

log = logging.getLogger("trio.server")

IDLE_WAKE_SECONDS = 1.0  # how often an idle worker wakes for housekeeping (missing seqs, offloading)
SHARING_SECONDS = 10.0  # a user with a request queued or answered this recently shares the host


@dataclass
class Sequencing:
    """The core's per-run order, shared by all workers: the next seq each run may run."""

    next_seq: dict[str, int]
    lock: threading.RLock
    gap_seconds: float  # how long a run's later requests wait for a missing one


class Answers:
    """Answers a worker's requests, each run's in the order they ran, none before the
    change it reports is on disk.

    An ``optim_step`` leaves its snapshot being written (``Engine.optim_step``): its answer
    (and the storing of the step, ``when_kept``) waits for the write on this class's
    thread, while the worker runs other users' work. The run's own next calls wait for the
    answer (its ``next_seq`` moves on when it is resolved), so nothing they do, a checkpoint
    of the new weights say, can outlive a crash that undoes the step. Answers of runs with
    nothing held go out at once, from the worker's thread; a run's later answer queues
    behind a held one.
    """

    def __init__(self, name: str, engine: Engine, resolve: Callable[[WorkItem, Result], None]):
        self.engine, self.resolve = engine, resolve
        self.queue: queue.SimpleQueue[tuple[WorkItem, Result] | None] = queue.SimpleQueue()
        self.queued: Counter[str] = Counter()  # run id -> its answers in ``queue``
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def answer(self, item: WorkItem, result: Result) -> None:
        """Called by the worker's thread alone, in the order the requests ran."""
        run_id = item.run_id
        if run_id is None:
            self.resolve(item, result)
            return
        with self.lock:
            held = bool(self.queued[run_id]) or _to_keep(item, result)
            if held:
                self.queued[run_id] += 1
        if held:
            self.queue.put((item, result))
        else:
            self.resolve(item, result)

    def holds(self, run_id: str) -> bool:
        """Whether an answer of the run is queued here."""
        with self.lock:
            return bool(self.queued[run_id])

    def close(self, timeout: float) -> None:
        """Answer what is queued, then stop (what is left after ``timeout`` fails at the next start)."""
        self.queue.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        while (entry := self.queue.get()) is not None:
            item, result = entry
            if _to_keep(item, result):
                result = self._kept(item, result)
            try:
                self.resolve(item, result)
            except Exception:  # never the thread: every later answer waits on it
                log.exception("request=%s: answering it failed", item.request_id)
            run_id = item.run_id
            assert run_id is not None  # only runs' answers queue
            with self.lock:
                self.queued[run_id] -= 1
                if not self.queued[run_id]:
                    del self.queued[run_id]

    def _kept(self, item: WorkItem, result: Result) -> Result:
        """``result`` once its change is on disk and stored, or the error saying it is lost."""
        try:
            self.engine.durable(item.context["durable"])
        except SnapshotLost as exc:
            log.error("request=%s: %s", item.request_id, exc)
            return None, ServiceError("server", "the model host restarted before this step reached the run's "
                                      "snapshot, so the step is lost; run its forward_backward calls again, "
                                      "then optim_step", 500)
        except Exception as exc:
            log.exception("request=%s: waiting for its snapshot failed", item.request_id)
            return None, ServiceError("server", f"internal error saving the step: {type(exc).__name__}: {exc}", 500)
        try:
            item.context["when_kept"]()
        except Exception:  # on disk, so done: the store catches up at the next start (_reconcile_step)
            log.exception("request=%s: storing its step failed", item.request_id)
        return result


def _to_keep(item: WorkItem, result: Result) -> bool:
    """A done request whose change is still being written to its run's snapshot."""
    return result[1] is None and item.context.get("durable") is not None


KEY_REVOKED = ServiceError("authentication", "this request's API key was revoked after the request was queued; "
                           "it did not run", 401)
# failure_from's messages start with the exception's type (what a user's input cannot write)
OUT_OF_MEMORY = ("OutOfMemoryError: ", "MemoryError: ", "RuntimeError: CUDA error: out of memory",
                 "AcceleratorError: CUDA error: out of memory", "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED")
PASS_OPS = ("forward", "forward_backward")  # a failed pass changes nothing: it may run again


def out_of_memory(error: ServiceError | None) -> bool:
    """Whether a request failed for want of memory (``torch.OutOfMemoryError`` on a GPU): a
    server error that ``engine.failure_from`` named by that type, never a message that just
    says so (a validation error quotes a user's input)."""
    return error is not None and error.category == "server" and error.message.startswith(OUT_OF_MEMORY)


class HostWorker:
    def __init__(self, ctx: Context, resolve: Callable[[WorkItem, Result], None], order: Sequencing,
                 idle_offload_seconds: float, max_batch_tokens: int | None = None,
                 max_pass_tokens: int | None = None, max_resident_runs: int | None = None,
                 slice_alone: bool = False):
        self.ctx = ctx
        self.engine = ctx.engine
        self.answers = Answers(f"trio-answers-{ctx.base_model}", ctx.engine, self._resolve(resolve))
        self.order = order
        self.idle_offload_seconds = idle_offload_seconds
        self.max_resident_runs = max_resident_runs  # None: only idleness sends runs to disk
        self.pending: list[WorkItem] = []
        self.running: dict[str, str] = {}  # request id -> its user
        self.running_op = ""  # the op of the running batch (when ``running``)
        self.cond = threading.Condition()
        self._stopped = False
        self.last_used: dict[str, float] = {}  # run id -> when a request last touched it (resident runs)
        self.queued_at: dict[str, float] = {}  # request id -> when it was queued
        self.durations = OpDurations()  # recent batch times per op, for queue estimates
        self.batch_started = 0.0  # when the running batch started (monotonic)
        self.max_batch_tokens = max_batch_tokens
        self.max_pass_tokens = max_pass_tokens  # pass budget while users share the host (pass_tokens)
        self.slice_alone = slice_alone  # that budget for a user alone too
        self.seen_at: dict[str, float] = {}  # user id -> when a request of theirs was last queued or answered
        self.fair = Fairness()  # fair queueing between users (scheduler.py), advanced per batch
        self.decoding: dict[str, WorkItem] = {}  # request id -> sample request in the decode batch
        self.admitted_at: dict[str, float] = {}  # request id -> when it joined the decode batch
        self.decode_steps = 0  # decode steps run so far (tests and metrics watch it)
        self.cut_at = self.pass_tokens()  # the pass budget the queued requests are split by
        self.engine.watch_restarts(self._host_restarted)
        self.thread = threading.Thread(target=self._loop, name=f"trio-worker-{ctx.base_model}", daemon=True)
        self.thread.start()

    def _resolve(self, resolve: Callable[[WorkItem, Result], None]) -> Callable[[WorkItem, Result], None]:
        """``resolve``, then wake the worker: a held answer moves its run's ``next_seq`` on
        from the answers' thread, and the run's next call, queued already, is now ready."""
        def resolve_and_wake(item: WorkItem, result: Result) -> None:
            resolve(item, result)
            with self.cond:
                self.cond.notify()
        return resolve_and_wake

    def enqueue(self, item: WorkItem) -> None:
        """Queue a request: itself, or its first part if over the queue's pass budget
        (``cut_at``; if the budget changes before it runs, ``_next_work`` cuts it again)."""
        with self.cond:
            self._seen([item.user_id])
            item = maybe_split(item, self.cut_at)
        self._queue(item)

    def _queue(self, item: WorkItem) -> None:
        with self.cond:
            self.queued_at[item.request_id] = time.monotonic()
            self.pending.append(item)
            self.cond.notify()

    def pass_tokens(self) -> int | None:
        """The most tokens a forward(_backward) pass holds now (call under ``cond``).

        Time-slicing is for a shared host: a pass cannot be interrupted, so while sample
        requests decode (a decode step runs between two passes) or more than one user has
        a request queued, or queued or answered within ``SHARING_SECONDS``, passes hold
        ``max_pass_tokens``, and the choice between users is made again after each. One
        user training alone (with one run or several) gets passes of up to
        ``max_batch_tokens``: short passes each read every weight once more, which on the
        CPU cost a lone 8 x 128 step of the bundled model 1.25x its time in 128-token
        passes. ``slice_alone`` keeps ``max_pass_tokens`` for a user alone too.
        """
        if self.max_pass_tokens is None or self.slice_alone or self._shared():
            return self.max_pass_tokens
        return self.max_batch_tokens

    def _shared(self) -> bool:
        """Whether passes share the host now (see ``pass_tokens``)."""
        if self.decoding or any(item.op == "sample" for item in self.pending):
            return True
        self._forget_users_gone()
        return len(self.seen_at.keys() | {item.user_id for item in self.pending}) > 1

    def _seen(self, users: Iterable[str]) -> None:
        """Note users' requests queued or answered now (under ``cond``)."""
        now = time.monotonic()
        self.seen_at.update((user, now) for user in users)
        self._forget_users_gone()

    def _forget_users_gone(self) -> None:
        since = time.monotonic() - SHARING_SECONDS
        for user in [u for u, seen in self.seen_at.items() if seen < since]:
            del self.seen_at[user]

    def snapshot(self) -> list[WorkItem]:
        with self.cond:
            return list(self.pending)

    def queue_info(self, request_id: str, now: float | None = None) -> QueueInfo | None:
        """Where a request of this host stands (see queueing.py); None if not here."""
        with self.cond:
            if request_id in self.running:
                return QueueInfo(running=True, position=0, starts_in=0.0)
            item = next((i for i in self.pending if i.request_id == request_id), None)
            if item is None:
                return None
            earlier = [i for i in self.pending if i.arrival < item.arrival]
            ahead = [i.op for i in earlier]
            running_op, running_for = None, 0.0  # nothing running: nothing left of it
            if self.running:
                running_op = self.running_op
                running_for = (time.monotonic() if now is None else now) - self.batch_started
            others = sum(user != item.user_id for user in [*self.running.values(), *(i.user_id for i in earlier)])
            return QueueInfo(running=False, position=len(self.running) + len(ahead),
                             starts_in=estimate_start(self.durations, ahead, running_op, running_for),
                             others_ahead=others)

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            self.cond.notify()
        self.thread.join(30)
        self.answers.close(60)
        if not self.thread.is_alive():  # else a batch still runs: its runs are not ours to move
            self._keep_pending_gradients()
        self.engine.close()

    def _keep_pending_gradients(self) -> None:
        """At a graceful stop, a run holding the gradients of forward_backward calls since
        its last step goes to disk with them, as an idle one does, so the restarted service
        steps on them (it used to drop them and refuse the run's next step as lost)."""
        for run_id in list(self.last_used):
            if self.ctx.unstepped.get(run_id):
                try:
                    self.engine.offload(run_id)
                except Exception as exc:  # the next step says what was lost, as after a crash
                    log.warning("run %s: its pending gradients could not be kept at stop: %s", run_id, exc)

    def _host_restarted(self) -> None:
        """The host (a Ray actor) restarted: every run resident there lost the gradients of
        its calls since its last step (an offloaded run's are in its snapshot), and its next
        step is refused naming them, also when calls are made before it (a step on part of
        a batch). The runs come back from their snapshots on their next calls."""
        for run_id in self.last_used:
            if calls := self.ctx.unstepped.get(run_id):
                self.ctx.lost[run_id] = calls
        self.last_used.clear()

    def _loop(self) -> None:
        while True:
            work = self._schedule()
            if work is None:
                return
            admit, batch = self._unrevoked(*work)
            if batch:
                self._run_batch(batch)
            if admit or self.decoding:
                self._decode(admit)
            elif not batch:
                self._skip_missing_seqs()
            self._offload_runs()

    def _unrevoked(self, admit: list[WorkItem], batch: list[WorkItem]) -> tuple[list[WorkItem], list[WorkItem]]:
        """``admit`` and ``batch`` less the requests of users whose key was revoked since they
        were queued (a stolen key's queue, say): those end here, unrun and counting nothing.
        One read per user of the turn."""
        revoked = {user for user in {item.user_id for item in admit + batch} if self._revoked(user)}
        for item in (item for item in admit + batch if item.user_id in revoked):
            self._done(item)
            split = split_of(item)
            if split is None:
                self.answers.answer(item, (None, KEY_REVOKED))
            else:
                self._part_done(split, (None, KEY_REVOKED))
        return ([item for item in admit if item.user_id not in revoked],
                [item for item in batch if item.user_id not in revoked])

    def _revoked(self, user_id: str) -> bool:
        try:
            return self.ctx.store.revoked(user_id)
        except Exception as exc:  # the database down past its retries: its requests fail on their own
            log.warning("could not read whether user %s's key is revoked: %s", user_id, exc)
            return False

    def _run_batch(self, batch: list[WorkItem]) -> None:
        results = self._execute(batch)
        short = [k for k, (_, error) in enumerate(results) if out_of_memory(error)]
        if short and batch[0].op in PASS_OPS and self._make_room(batch):
            # once more, the requests that ran short alone: a failed pass left their runs' gradients as they were
            for k, result in zip(short, self._execute([batch[k] for k in short])):
                results[k] = result
        with self.cond:
            self.durations.record(batch[0].op, time.monotonic() - self.batch_started)
        for item in batch:
            run_id = item.run_id or item.context.get("run_id")  # create_model names its run here
            if run_id is not None:
                self.last_used[run_id] = time.monotonic()
        for item, result in zip(batch, results):
            self._done(item)  # out of ``running`` before its caller can see it resolved
            split = split_of(item)
            if split is None:
                self.answers.answer(item, result)
            else:
                self._part_done(split, result)

    def _decode(self, admit: list[WorkItem]) -> None:
        """Admit new sample requests, run one decode step, resolve those that finished."""
        live = list(self.decoding)
        started = time.monotonic()
        for item in admit:
            self.decoding[item.request_id] = item
            self.admitted_at[item.request_id] = started
        try:
            results = decode(self.ctx, admit, live)
        except Exception as exc:  # a bug: fail the batch's requests, keep the thread (see _execute)
            log.exception("decode step failed unexpectedly; failing its requests")
            error = ServiceError("server", f"internal error while sampling: {type(exc).__name__}: {exc}", 500)
            results = dict.fromkeys(self.decoding, (None, error))
        self.decode_steps += 1
        with self.cond:  # a queued sample waits about one step to join (queueing.py)
            self.durations.record("sample", time.monotonic() - started)
        finished = [self.decoding.pop(rid) for rid in results if rid in self.decoding]
        for item in finished:
            result = results[item.request_id]
            log_outcome(item, result, (time.monotonic() - self.admitted_at.pop(item.request_id)) * 1000)
            self._done(item)
            self.answers.answer(item, result)

    def _done(self, item: WorkItem) -> None:
        """Take ``item`` out of ``running`` and note its user seen, before it is resolved: no
        caller sees a request done yet still running (a test waiting for its next request to
        run would take the last one's id for it). Never after: a user noted then would count
        as sharing the host after its caller saw the request done (``pass_tokens``).

        Nothing raises past ``_execute`` and ``decode``'s catch but a bug in answering, which
        ends the worker's thread: what it leaves in ``running`` is moot then."""
        with self.cond:
            self.running.pop(item.request_id, None)
            self._seen([item.user_id])

    def _part_done(self, split: Split, result: Result) -> None:
        """Queue the request's next part, or resolve the request: all parts done, or one failed."""
        merge_elapsed(result[0], split)
        error = result[1]
        if error is None and not split.last:
            with self.cond:
                split.advance(self.pass_tokens())
            self._queue(split.part())  # due by its user's tag, like any request: others may go first
            return
        try:
            outcome = finish_split(self.ctx, split, error)
        except Exception as exc:  # a bug merging must fail this request, not end the thread
            log.exception("request=%s: unexpected error finishing its parts", split.whole.request_id)
            outcome = (None, ServiceError("server", f"internal error merging parts: {type(exc).__name__}: {exc}", 500))
        self.answers.answer(split.whole, outcome)

    def _execute(self, batch: list[WorkItem]) -> list[Result]:
        """``execute``, except that a bug escaping it fails this batch's requests with a server
        error instead of ending the thread (which would leave every later request waiting)."""
        try:
            return execute(self.ctx, batch)
        except Exception as exc:
            ids = ",".join(item.request_id for item in batch)
            log.exception("requests=%s op=%s: unexpected error; failing the batch", ids, batch[0].op)
            error = ServiceError("server", f"internal error running {batch[0].op}: {type(exc).__name__}: {exc}", 500)
            return [(None, error)] * len(batch)

    def _schedule(self) -> tuple[list[WorkItem], list[WorkItem]] | None:
        """(sample requests to admit, the next other batch); both empty after a second of
        nothing to do (at once while requests decode); None once stopped."""
        with self.cond:
            if self._stopped:
                return None
            work = self._next_work()
            if not work.admit and not work.batch and not self.decoding:
                self.cond.wait(timeout=IDLE_WAKE_SECONDS)
                work = self._next_work()
            self.fair = work.fair
            for item in work.admit + work.batch:
                self.pending.remove(item)
                self.queued_at.pop(item.request_id, None)
                self.running[item.request_id] = item.user_id
            if work.batch:
                self.running_op, self.batch_started = work.batch[0].op, time.monotonic()
            return work.admit, work.batch

    def _next_work(self) -> Work:
        budget = self.pass_tokens()
        if budget != self.cut_at:  # sharing began or ended: cut the queue by the new budget
            # (only then: a scan of every queued request cost 3.4 ms a turn at 1000 queued)
            self.pending = [maybe_split(item, budget) if split_of(item) is None else item for item in self.pending]
            self.cut_at = budget
        return next_work(self.pending, self.order.next_seq, len(self.decoding), self.fair,
                         max_tokens=self.max_batch_tokens, max_pass_tokens=budget,
                         decoding_users={item.user_id for item in self.decoding.values()})

    def _skip_missing_seqs(self) -> None:
        with self.cond:
            stalled = stalled_runs(self.pending, self.order.next_seq, self.queued_at, time.monotonic(),
                                   self.order.gap_seconds)
        for run_id, seq in stalled.items():
            if self.answers.holds(run_id):  # its next seq ran: the answer waits for a snapshot write
                continue
            log.warning("run %s: requests %d..%d never arrived; continuing at %d",
                        run_id, self.order.next_seq.get(run_id, 0), seq - 1, seq)
            with self.order.lock:
                self.order.next_seq[run_id] = seq

    def _make_room(self, batch: list[WorkItem]) -> bool:
        """After a pass ran out of memory (a GPU holds far fewer runs than ``max_resident_runs``
        allows on a CPU host): offload the least recently used half of the resident runs the
        batch does not use, for one more try. False if there were none to offload."""
        with self.cond:
            keep = {item.run_id for item in batch} | {item.run_id for item in self.pending}
        idle = [run_id for _, run_id in sorted((used, run_id) for run_id, used in self.last_used.items())
                if run_id not in keep]
        freed = sum(self._offload(run_id) for run_id in idle[: -(-len(idle) // 2)])
        log.warning("%s ran out of memory; offloaded %d idle runs of %d resident and trying it once more",
                    batch[0].op, freed, len(self.last_used) + freed)
        return freed > 0

    def _offload_runs(self) -> None:
        """Send to disk the runs unused for ``idle_offload_seconds`` and, while more than
        ``max_resident_runs`` are resident, the least recently used; a run with a queued
        request (the next part of a split one, say) stays. Called on every turn of the loop,
        so it returns at once when there is nothing to do."""
        cutoff = time.monotonic() - self.idle_offload_seconds
        excess = len(self.last_used) - self.max_resident_runs if self.max_resident_runs is not None else 0
        if excess <= 0 and min(self.last_used.values(), default=cutoff) >= cutoff:
            return
        with self.cond:
            queued = {item.run_id for item in self.pending}
        for used, run_id in sorted((used, run_id) for run_id, used in self.last_used.items()):
            if used >= cutoff and excess <= 0:
                return
            if run_id in queued or run_id not in self.last_used:  # gone: a host restart emptied the map
                continue
            if self._offload(run_id):
                excess -= 1
                log.info("offloaded run %s to disk (unused for %.0f s)", run_id, time.monotonic() - used)

    def _offload(self, run_id: str) -> bool:
        """Send one run to disk; False if it stays (counted resident, tried again later)."""
        try:  # resident until it is out: a host restart found here marks it like the others
            self.engine.offload(run_id)
        except Exception as exc:  # e.g. its snapshot could not be written
            self.last_used[run_id] = time.monotonic()
            log.warning("run %s not offloaded: %s", run_id, exc)
            return False
        self.last_used.pop(run_id, None)
        return True
