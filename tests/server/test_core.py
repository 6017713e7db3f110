"""The service core's worker really batches work from different runs into one pass."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_server.core import Limits, ServiceCore
from trio_server.engine import snapshot_path
from trio_server.store import requests as requests_table
from trio_server.store import runs as runs_table
from trio_server.worker import Answers, HostWorker, Sequencing

from ..polling import wait_until

MODEL = "trio/tiny-llama"


def next_token_datum(tokens: list[int]) -> trio.Datum:
    """A datum that trains ``tokens[:-1]`` to predict each next token."""
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


DATUM = next_token_datum(list(range(1, 9)))


def trainer(core: ServiceCore, user: str = "local", seed: int | None = None) -> trio.TrainingClient:
    """A rank-2 training client of the tiny model on ``core``, for ``user``."""
    return trio.ServiceClient(transport=LocalTransport(core, user)).create_lora_training_client(
        base_model=MODEL, rank=2, seed=seed)


@contextlib.contextmanager
def forward_held(worker) -> Iterator[threading.Event]:
    """The worker's forward passes wait in the engine until the block ends; the event is
    set once one is waiting (the worker is then busy: what is submitted queues)."""
    running, release = threading.Event(), threading.Event()
    real = worker.engine.forward

    def held(jobs):
        running.set()
        release.wait(60)
        return real(jobs)

    worker.engine.forward = held
    try:
        yield running
    finally:
        release.set()


def record_outcomes(worker) -> dict:
    """request id -> (result, error) of every request ``worker`` resolves from now on."""
    outcomes: dict = {}
    real_resolve = worker.answers.resolve
    worker.answers.resolve = lambda item, result: (outcomes.setdefault(item.request_id, result), real_resolve(item, result))
    return outcomes



@pytest.mark.parametrize("max_batch_tokens, passes", [(8192, [3]), (14, [2, 1])])
def test_forward_backward_of_different_runs_share_one_pass(tmp_path, max_batch_tokens, passes):
    """Three runs' 7-token requests queued together: one pass, or as many as the batch
    token limit asks (14 holds two)."""
    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(max_batch_tokens=max_batch_tokens))
    svc = trio.ServiceClient(transport=LocalTransport(core))
    runs = [svc.create_lora_training_client(base_model=MODEL, rank=2, seed=k) for k in range(3)]
    engine = core.workers[MODEL].engine
    host = engine.host
    calls: list[int] = []
    real = engine.forward_backward

    def spy(jobs):
        calls.append(len(jobs))
        return real(jobs)

    engine.forward_backward = spy
    d = DATUM
    worker = core.workers[MODEL]
    with host.lock:  # keep the worker busy so all three queue up
        blocker = runs[0].forward([d])
        wait_until(lambda: bool(worker.running), "the blocker to run")
        futures = [tc.forward_backward([d]) for tc in runs]
        wait_until(lambda: len(worker.snapshot()) == 3, "all three to queue")
    blocker.result()
    results = [f.result() for f in futures]
    assert calls == passes, calls
    assert all(r.metrics["loss:sum"] > 0 for r in results)
    core.close()


def test_idle_runs_move_to_disk_and_come_back_unchanged(tmp_path):
    d = DATUM
    offloading = ServiceCore(tmp_path / "a", dtype="float32", idle_offload_seconds=0.3)
    resident = ServiceCore(tmp_path / "b", dtype="float32")  # the reference never offloads
    runs = [trainer(core, seed=7) for core in (offloading, resident)]
    for tc in runs:
        tc.forward_backward([d])
        tc.optim_step(trio.AdamParams(learning_rate=1e-2))
        tc.forward_backward([d]).result()  # pending grads, not yet applied
    worker = offloading.workers[MODEL]
    deadline = time.monotonic() + 10
    while runs[0].model_id in worker.engine.host.adapters and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runs[0].model_id not in worker.engine.host.adapters  # offloaded
    assert snapshot_path(offloading.engine_settings.snapshot_dir, runs[0].model_id).exists()
    assert runs[1].model_id in resident.workers[MODEL].engine.host.adapters
    worker.idle_offload_seconds = 600
    for tc in runs:
        assert tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["step"] == 2.0
    a, b = (tc.forward([d]).result().loss_fn_outputs[0]["logprobs"].tolist() for tc in runs)
    assert a == b  # weights, moments and pending grads all survived the trip
    offloading.close()
    resident.close()


def test_old_futures_leave_memory_but_stay_retrievable(tmp_path, monkeypatch):
    from pytrio.futures import run_sync
    from trio_server import core as core_module

    monkeypatch.setattr(core_module, "KEEP_FINISHED_MAX", 2)
    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    transport = svc._session.transport
    first = run_sync(transport.submit("get_info", {"model_id": tc.model_id}, "key-1"))
    want = run_sync(transport.retrieve(first, 10))
    datum = trio.Datum(model_input=trio.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    body = {"model_id": tc.model_id, "seq": 0, "data": [datum.model_dump()], "loss_fn": "stable_reinforce"}
    failing = run_sync(transport.submit("forward", body, None))
    failed = run_sync(transport.retrieve(failing, 10))
    assert failed.status == "failed" and failed.error.category == "validation" and "stable_reinforce" in failed.error.message
    for _ in range(4):
        tc.get_info()
    assert first not in core.futures and failing not in core.futures  # forgotten in memory
    assert len(core.futures.keys() & {rid for _, rid, _ in core.finished}) == len(core.finished) == 2  # the last 2
    assert first not in core.owners and ("local", "key-1") not in core.idempotency  # and its owner, its key
    assert run_sync(transport.retrieve(first, 10)) == want  # the store still answers
    again = run_sync(transport.retrieve(failing, 10))  # errors too (but the store keeps no status code)
    assert (again.status, again.error.category, again.error.message) == ("failed", "validation", failed.error.message)
    assert run_sync(transport.submit("get_info", {"model_id": tc.model_id}, "key-1")) == first  # still idempotent
    core.close()


def test_a_request_left_pending_by_another_process_reads_as_failed(tmp_path):
    """A store row still pending with no future here was queued in a process that is
    gone (or another server on the same store): it cannot finish, so it reads as failed."""
    from pytrio import types as t
    from pytrio.futures import run_sync
    from trio_server.errors import RESTART_MESSAGE
    from trio_server.store import now, requests

    core = ServiceCore(tmp_path, dtype="float32")
    transport = LocalTransport(core)
    core.store.insert(requests, request_id="req-elsewhere", user_id="local", op="get_info", run_id=None,
                      seq=None, status="pending", idempotency_key=None, created_at=now())
    state = run_sync(transport.retrieve("req-elsewhere", 0))
    assert (state.status, state.error) == ("failed", t.ErrorInfo(category="server", message=RESTART_MESSAGE))
    with pytest.raises(trio.NotFoundError, match="req-nowhere"):
        run_sync(transport.retrieve("req-nowhere", 0))
    core.close()


def test_concurrent_retries_with_one_key_run_once(tmp_path):
    import concurrent.futures as cf

    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    body = {"model_id": tc.model_id, "seq": 0}
    route = core._route

    def slow_route(item):  # widen the window between the first key check and registering
        time.sleep(0.05)
        return route(item)

    core._route = slow_route
    engine = core.workers[MODEL].engine
    executed: list[str] = []
    real_step = engine.optim_step

    def counting_step(run_id, config):
        executed.append(run_id)
        return real_step(run_id, config)

    engine.optim_step = counting_step
    with cf.ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(lambda _: core.submit("local", "optim_step", body, "same-key"), range(16)))
    assert len(ids) == 1
    tc.get_info()  # ordered after the optim_step: it has run by now
    assert executed == [tc.model_id]  # one request id, and one execution
    core.close()


def test_a_refused_call_keeps_its_place_so_the_next_call_does_not_wait(tmp_path):
    """A call the core refuses after its run and seq are known (a bad body, a missing
    checkpoint) still uses its seq: the run's next call runs, with no gap to wait out."""


    from pytrio.futures import run_sync
    from trio_server.errors import ServiceError

    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(seq_gap_seconds=3600))
    svc = trio.ServiceClient(transport=LocalTransport(core))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    with pytest.raises(trio.NotFoundError):  # refused while routing: the SDK's seq 0
        tc.load_state(f"trio://{tc.model_id}/weights/missing").result(timeout=60)
    assert tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result(timeout=60).metrics["step"] == 0

    run_id = svc.create_lora_training_client(base_model=MODEL, rank=2).model_id
    bad = {"model_id": run_id, "seq": 0, "adam_params": {"learning_rate": "fast"}}
    with pytest.raises(ServiceError, match="learning_rate") as refused:  # refused while parsing
        core.submit("local", "optim_step", bad, "bad-step")
    step = core.submit("local", "optim_step", {"model_id": run_id, "seq": 1, "adam_params": {}})
    transport = svc._session.transport
    assert run_sync(transport.retrieve(step, 60)).status == "done"
    # A retry of the refused call (its answer lost on the way) finds it by its key and reads the refusal.
    rejected = core.submit("local", "optim_step", bad, "bad-step")
    outcome = run_sync(transport.retrieve(rejected, 60))
    assert (outcome.status, outcome.error.category, outcome.error.message) == (
        "failed", "validation", refused.value.message)
    with pytest.raises(ServiceError, match="already used"):  # the refused seq is spent
        core.submit("local", "optim_step", {"model_id": run_id, "seq": 0, "adam_params": {}})
    core.close()


def test_a_pending_request_reports_its_place_in_the_queue(tmp_path):
    """retrieve(timeout=0) of a request not done yet: "running", or "queued (position n)"
    with n the requests of its host that run before it (the running one, then those that
    arrived earlier), and an estimated start: queue_position and starts_in_seconds in the
    answer (through the wire model). With forward's recent batches at 5 s, the running one
    has under 5 s left and each queued one adds 5 s (slack only for the time between the
    retrieves; no sleeping)."""
    from pytrio import types as t
    from pytrio.futures import run_sync
    from trio_server.queueing import QueueInfo

    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    runs = [svc.create_lora_training_client(base_model=MODEL, rank=2, seed=k).model_id for k in range(3)]
    transport = svc._session.transport
    bob = trio.ServiceClient(transport=LocalTransport(core, "bob"))
    bobs_run, bobs = bob.create_lora_training_client(base_model=MODEL, rank=2).model_id, bob._session.transport
    datum = DATUM
    worker = core.workers[MODEL]
    worker.durations.record("forward", 5.0)

    def forward(run_id):
        return run_sync(transport.submit("forward", t.ForwardRequest(model_id=run_id, seq=0, data=[datum]), None))

    with worker.engine.host.lock:  # the first forward runs and blocks; the others wait behind it
        ids = [forward(runs[0])]
        wait_until(lambda: bool(worker.running), "the first forward to run")
        ids += [forward(run_id) for run_id in runs[1:]]
        bobs_id = run_sync(bobs.submit("forward", t.ForwardRequest(model_id=bobs_run, seq=0, data=[datum]), None))
        bobs_state = run_sync(bobs.retrieve(bobs_id, 0))
        states = [run_sync(transport.retrieve(rid, 0)) for rid in ids]
        at = worker.batch_started + 1.0  # the same at a fixed moment, 1 s into the running batch: exact
        infos = [worker.queue_info(rid, now=at) for rid in ids]
    assert [(s.status, s.queue_state, s.queue_position) for s in states] == [
        ("pending", "running", 0), ("pending", "queued (position 1)", 1), ("pending", "queued (position 2)", 2)]
    assert infos == [QueueInfo(running=True, position=0, starts_in=0.0),
                     QueueInfo(running=False, position=1, starts_in=4.0),
                     QueueInfo(running=False, position=2, starts_in=9.0)]
    assert [s.others_ahead for s in states] == [0, 0, 0]  # behind this user's own calls only
    assert (bobs_state.queue_position, bobs_state.others_ahead) == (3, 3)
    starts = [s.starts_in_seconds for s in states]
    assert starts[0] == 0.0 and 0.0 <= starts[1] <= 5.0 and 0.0 < starts[2] - starts[1] <= 5.1, starts
    assert all(run_sync(transport.retrieve(rid, 60)).status == "done" for rid in ids)
    assert run_sync(bobs.retrieve(bobs_id, 60)).status == "done"
    assert worker.queued_at == {}  # what left the queue took its queue time along (no leak)
    core.close()


def test_a_submit_that_loses_the_idempotency_race_returns_the_winner_and_leaves_no_trace(tmp_path):
    """Two submits with one key (two server processes on one store) both pass the key
    check; the store's unique key lets one insert win. The loser answers the winner's id
    and forgets its own request (future, owner, key); other keys are untouched."""
    from trio_server.store import requests

    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    earlier = core.submit("local", "get_info", {"model_id": tc.model_id}, "k0")
    real_insert, losers = core.store.insert, []

    def racing_insert(table, **row):
        if table is requests and row.get("idempotency_key") == "k1":
            core.store.insert = real_insert
            losers.append(row["request_id"])
            real_insert(table, **{**row, "request_id": "req-winner"})  # the other submit lands first
        return real_insert(table, **row)

    core.store.insert = racing_insert
    assert core.submit("local", "get_info", {"model_id": tc.model_id}, "k1") == "req-winner"
    assert losers and losers[0] not in core.futures and losers[0] not in core.owners
    assert ("local", "k1") not in core.idempotency and core.idempotency[("local", "k0")] == earlier
    # the loser is not counted as pending (k0 may still be: the counts agree either way)
    with core.lock:  # k0 may be resolving meanwhile
        assert losers[0] not in core.unfinished and core.pending_by_user.get("local", 0) == len(core.unfinished)
    assert core._queue_info("req-winner") is None  # no worker holds it: taken, finishing
    core.close()


def test_calls_queued_at_a_crash_are_on_record_for_the_next_start(tmp_path):
    """submit records a call (its run, its seq, "pending") before it runs: calls still
    queued when the process dies read as failed after the restart, and the run's order
    resumes past their seqs (the run's own next_seq knows only the calls that finished)."""
    from pytrio import types as t
    from pytrio.futures import run_sync
    from trio_server.errors import RESTART_MESSAGE

    before = ServiceCore(tmp_path, dtype="float32")
    run_id = trainer(before).model_id
    before.workers[MODEL].stop()  # nothing runs from here on: what is accepted stays queued, as at a crash
    first = before.next_seq.get(run_id, 0)
    ids = [before.submit("local", "forward_backward", {"model_id": run_id, "seq": first + k, "loss_fn": "cross_entropy",
                                                       "data": [DATUM.model_dump()]}) for k in range(3)]
    before.close()  # the process ends here; its data dir's lock goes with it

    after = ServiceCore(tmp_path, dtype="float32")
    assert after.next_seq[run_id] == first + 3
    states = [run_sync(LocalTransport(after).retrieve(rid, 0)) for rid in ids]
    assert [(s.status, s.error) for s in states] == [("failed", t.ErrorInfo(category="server", message=RESTART_MESSAGE))] * 3
    after.close()


def test_an_optim_step_whose_gradients_a_host_restart_lost_fails_and_changes_nothing(tmp_path):
    """A Ray host actor that died between forward_backward and optim_step comes back from the
    run's snapshot without its gradients: the step is refused naming the lost calls (it was
    a silent no-op answered as done), and once they are run again it steps."""
    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    for _ in range(2):
        tc.forward_backward([DATUM]).result()
    core.workers[MODEL].engine.host.zero_grad(tc.model_id)  # as on a restarted host
    with pytest.raises(trio.ServerError, match=r"gradients of the 2 forward_backward call\(s\) .* were lost"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    assert tc.get_info().step == 0
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()  # nothing pending: the usual no-op
    tc.forward_backward([DATUM]).result()
    assert tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["step"] == 1
    core.close()


def test_a_step_the_host_died_in_is_refused_when_sent_again_not_made_on_nothing(tmp_path):
    """The Ray actor died during an optim_step ("submit it again"): the step had taken its
    run's count of calls, so the step sent again found no gradients on the new actor and
    no calls counted, and was answered done having trained nothing."""
    from trio_server.errors import HostRestarted

    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    for _ in range(2):
        tc.forward_backward([DATUM]).result()
    engine = core.workers[MODEL].engine

    def dying(run_id, config):
        engine.host.zero_grad(run_id)  # the new actor holds none
        del engine.optim_step
        raise HostRestarted("optim_step")

    engine.optim_step = dying
    with pytest.raises(trio.ServerError, match="restarted during this optim_step.*next optim_step is refused; after "
                                               "that, run those calls again, then optim_step"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    with pytest.raises(trio.ServerError, match=r"gradients of the 2 forward_backward call\(s\) .* were lost"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    assert tc.get_info().step == 0
    for _ in range(2):  # as the message says: the calls again, then the step
        tc.forward_backward([DATUM]).result()
    assert tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["step"] == 1
    core.close()


def test_a_forward_backward_the_host_died_in_leaves_the_runs_next_step_refused(tmp_path):
    """Pipelined calls: a forward_backward in flight when the Ray actor died ("submit it
    again"), the next one run on the new actor, then optim_step: it was made on the second
    call's gradients alone (part of the batch) and answered done. It is refused, as when
    the calls the restart cut short had been answered."""
    from trio_server.errors import HostRestarted

    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    worker = core.workers[MODEL]
    engine = worker.engine

    def dying(jobs):
        engine.forward_backward = restarted
        raise HostRestarted("forward_backward")

    def restarted(jobs):
        del engine.forward_backward
        worker._host_restarted()  # as RayEngine._call does on hearing of the restart, before the call runs
        return engine.forward_backward(jobs)

    engine.forward_backward = dying
    cut_short, after = tc.forward_backward([DATUM]), tc.forward_backward([DATUM])
    step = tc.optim_step(trio.AdamParams(learning_rate=1e-2))
    with pytest.raises(trio.ServerError, match="restarted during this forward_backward.*next optim_step is refused"):
        cut_short.result()
    after.result()
    with pytest.raises(trio.ServerError, match=r"gradients of the 2 forward_backward call\(s\) .* \(1 made before "
                                               r"it; the 1 made since are dropped"):
        step.result()
    assert tc.get_info().step == 0
    for _ in range(2):  # as the message said: after that refusal, the calls again, then the step
        tc.forward_backward([DATUM]).result()
    assert tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["step"] == 1
    core.close()


def test_a_refusal_cut_short_by_the_host_leaves_the_next_step_refused(tmp_path):
    """The refusal of a step after a restart drops the run's gradients on the host; the host
    dying in that call took the run's counts with it, and the step sent again was answered
    done having stepped on nothing."""
    from trio_server.errors import HostRestarted

    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    for _ in range(2):
        tc.forward_backward([DATUM]).result()
    worker = core.workers[MODEL]
    worker.engine.host.zero_grad(tc.model_id)
    worker._host_restarted()  # as on hearing of a restart: the run's 2 calls are lost

    def dying(run_id):
        del worker.engine.drop_grads
        raise HostRestarted("drop_grads")

    worker.engine.drop_grads = dying
    with pytest.raises(trio.ServerError, match="restarted"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    with pytest.raises(trio.ServerError, match=r"gradients of the 2 forward_backward call\(s\) .* were lost"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    assert tc.get_info().step == 0
    core.close()


def test_a_step_whose_snapshot_landed_but_not_its_record_is_answered_done_after_a_restart(tmp_path):
    """A crash after a step's snapshot is written and before its record is stored (a
    PostgreSQL blip holds the record up to a minute) leaves the step made and its request
    pending. It is answered done with its metrics; failed as in flight ("submit it again"),
    the client would have applied the batch twice, and the next step been refused for
    "lost" calls that the landed step had consumed."""
    before = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(before)
    tc.forward_backward([DATUM]).result()
    step = tc.optim_step(trio.AdamParams(learning_rate=1e-2))
    answer = step.result()
    stepped = tc.forward([DATUM]).result().loss_fn_outputs[0]["logprobs"].tolist()
    request_id = before.store.select(requests_table, run_id=tc.model_id, op="optim_step")[0]["request_id"]
    before.close()
    # the store as the crash left it: the step's record (step 1, the answer) never written
    before.store.update(runs_table, "run_id", tc.model_id, step=0)
    before.store.update(requests_table, "request_id", request_id, status="pending", result=None)

    from pytrio.futures import run_sync

    after = ServiceCore(tmp_path, dtype="float32")
    state = run_sync(LocalTransport(after).retrieve(request_id, 0))
    assert state.status == "done" and state.result == answer.model_dump()
    assert answer.metrics["grad_norm"] > 0
    tc._session.transport = LocalTransport(after)
    assert tc.get_info().step == 1
    assert tc.forward([DATUM]).result().loss_fn_outputs[0]["logprobs"].tolist() == stepped
    tc.forward_backward([DATUM]).result()
    assert tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["step"] == 2  # nothing "lost"
    after.close()


def test_a_snapshot_ahead_by_a_load_answers_no_step_that_did_not_run(tmp_path):
    """load_state with the optimizer moves the snapshot to the checkpoint's step; a crash
    before the load's record leaves the snapshot ahead of the store with an optim_step
    queued behind the load. That step never ran: it fails as in flight, with the load."""
    from pytrio.futures import run_sync

    core = ServiceCore(tmp_path, dtype="float32")
    a = trainer(core)
    for _ in range(3):
        a.forward_backward([DATUM]).result()
        a.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    path = a.save_state("s3").result().path
    b = trainer(core, seed=1)
    b.load_state_with_optimizer(path).result()
    [load] = core.store.select(requests_table, run_id=b.model_id, op="load_weights")
    core.close()
    core.store.update(runs_table, "run_id", b.model_id, step=0)  # the load's record never written
    core.store.update(requests_table, "request_id", load["request_id"], status="pending", result=None)
    core.store.insert(requests_table, request_id="req-queued-step", user_id=load["user_id"], op="optim_step",
                      run_id=b.model_id, seq=load["seq"] + 1, status="pending", created_at=load["created_at"])

    after = ServiceCore(tmp_path, dtype="float32")
    states = [run_sync(LocalTransport(after).retrieve(rid, 0)) for rid in (load["request_id"], "req-queued-step")]
    assert [s.status for s in states] == ["failed", "failed"]
    assert after.store.get(runs_table, run_id=b.model_id)["step"] == 3  # the snapshot's, as loaded
    after.close()


def test_a_graceful_stop_keeps_pending_gradients_for_the_next_step(tmp_path):
    """A SIGTERM (``close``) after forward_backward calls and before their step: the run
    goes to disk with its gradients, and the restarted service's step equals the one the
    first would have made (it was refused, the calls counted as lost)."""
    reference = ServiceCore(tmp_path / "ref", dtype="float32")
    ref = trainer(reference)
    stopped = ServiceCore(tmp_path / "run", dtype="float32")
    tc = trainer(stopped)
    for client in (ref, tc):
        for _ in range(2):
            client.forward_backward([DATUM]).result()
    want = ref.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics
    want_logprobs = ref.forward([DATUM]).result().loss_fn_outputs[0]["logprobs"].tolist()
    reference.close()
    stopped.close()

    after = ServiceCore(tmp_path / "run", dtype="float32")
    tc._session.transport = LocalTransport(after)
    got = tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics
    assert got["step"] == 1 and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    assert tc.forward([DATUM]).result().loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(want_logprobs, abs=1e-6)
    after.close()


def test_a_call_after_a_restart_lost_others_makes_no_step_on_part_of_a_batch(tmp_path):
    """A crash lost the gradients of two answered calls; the loop resubmits the call the
    crash failed, then steps. That step would have used the one call's gradient alone and
    said nothing: it is refused, and the new call's gradient dropped with the lost ones, so
    the batch run again gives the step it would have made."""
    reference = ServiceCore(tmp_path / "ref", dtype="float32")
    ref = trainer(reference)
    for _ in range(3):
        ref.forward_backward([DATUM]).result()
    want = ref.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm"]
    reference.close()

    before = ServiceCore(tmp_path / "run", dtype="float32")
    tc = trainer(before)
    for _ in range(2):
        tc.forward_backward([DATUM]).result()
    before.workers[MODEL].engine.host.zero_grad(tc.model_id)  # a crash: the gradients in memory are gone
    before.close()

    after = ServiceCore(tmp_path / "run", dtype="float32")
    tc._session.transport = LocalTransport(after)
    tc.forward_backward([DATUM]).result()  # the call the crash failed, resubmitted
    with pytest.raises(trio.ServerError, match=r"gradients of the 3 forward_backward call\(s\) .* were lost when the "
                                               r"service or its model host restarted \(2 made before it; the 1 made since are dropped"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    assert tc.get_info().step == 0
    for _ in range(3):
        tc.forward_backward([DATUM]).result()
    got = tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics
    assert got["step"] == 1 and got["grad_norm"] == pytest.approx(want, rel=1e-6)  # the whole batch, once
    after.close()


def test_an_optim_step_after_a_service_restart_lost_its_gradients_is_refused_too(tmp_path):
    """A restart of the whole service loses the gradients in memory as an actor restart
    does: the calls since the run's last step are counted from the store at start-up, and
    the next step is refused naming them (it was a silent no-op), not the calls before."""
    before = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(before)
    tc.forward_backward([DATUM]).result()
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    for _ in range(3):
        tc.forward_backward([DATUM]).result()
    failed = tc.forward_backward([trio.Datum(model_input=trio.ModelInput.from_ints([1, 2]),
                                             loss_fn_inputs={"target_tokens": [5]})])  # refused: not counted
    with pytest.raises(trio.TrioError):
        failed.result()
    before.workers[MODEL].engine.host.zero_grad(tc.model_id)  # a crash: the gradients in memory are gone
    before.close()

    after = ServiceCore(tmp_path, dtype="float32")
    tc._session.transport = LocalTransport(after)  # the same client carries on, as over HTTP
    with pytest.raises(trio.ServerError, match=r"gradients of the 3 forward_backward call\(s\) .* were lost"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    tc.forward_backward([DATUM]).result()
    assert tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["step"] == 2
    after.close()


def test_a_checkpoint_that_expired_while_the_service_was_down_goes_at_its_start(tmp_path):
    from trio_server.store import checkpoints

    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    path = tc.save_state("brief", ttl_seconds=60).result().path
    folder = core.checkpoint_dir(tc.model_id, "weights", "brief")
    core.store.update(checkpoints, "path", path, expires_at="2000-01-01T00:00:00.000+00:00")  # time passed
    core.close()
    assert folder.exists()
    ServiceCore(tmp_path, dtype="float32").close()
    assert not folder.exists()


def test_a_data_dir_has_one_owner_and_shared_users_leave_its_requests_alone(tmp_path):
    """A second service on a data dir in use is refused, naming the holder (it would fail
    the first one's requests at start-up and delete its sampler weights). A shared one (the
    embedded service's CLI beside a training script) starts without that recovery. A
    crash's leftover snapshot temporaries go at the owner's next start."""
    import sqlalchemy as sa

    from trio_server.errors import DataDirInUse

    first = ServiceCore(tmp_path, dtype="float32")
    run_id = trainer(first).model_id
    first.workers[MODEL].stop()  # what is accepted from here on stays queued
    queued = first.submit("local", "forward", {"model_id": run_id, "seq": first.next_seq.get(run_id, 0), "data": [DATUM.model_dump()]})
    with pytest.raises(DataDirInUse, match=rf"data dir {tmp_path} is in use by another TRIO service \(pid {os.getpid()} "):
        ServiceCore(tmp_path, dtype="float32")
    shared = ServiceCore(tmp_path, dtype="float32", share_data_dir=True)
    assert not shared.owns_data_dir
    assert shared.store.get(requests_table, request_id=queued)["status"] == "pending"  # not failed as a restart's
    shared.close()
    first.close()

    # Sharers (embedded scripts): the first alone recovers, then all share; while any is
    # alive a server is refused, and so its recovery cannot fail their requests.
    sharers = [ServiceCore(tmp_path, dtype="float32", share_data_dir=True) for _ in range(2)]
    assert [c.owns_data_dir for c in sharers] == [True, False]
    sharers[0].close()
    with pytest.raises(DataDirInUse):
        ServiceCore(tmp_path, dtype="float32")
    sharers[1].close()

    with pytest.raises(sa.exc.OperationalError):  # a start that fails after taking the lock gives it back
        ServiceCore(tmp_path, db_url="sqlite:////nonexistent/x.db", dtype="float32")
    leftover = tmp_path / "snapshots" / f".{run_id}.safetensors.1.2.tmp"
    leftover.write_bytes(b"partial")
    ServiceCore(tmp_path, dtype="float32").close()
    assert not leftover.exists() and (tmp_path / "snapshots" / f"{run_id}.safetensors").exists()


def test_a_call_the_store_cannot_record_is_refused_and_leaves_no_trace(tmp_path):
    """The database down at submit (past Store.retry_seconds): the call is not accepted,
    and nothing of it stays behind: it holds no place in its user's pending count, and a
    retry with its key is a new call, which runs."""
    import sqlalchemy as sa

    from pytrio.futures import run_sync
    from trio_server.store import requests

    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(max_pending_per_user=1))
    tc = trainer(core)
    transport, body, real_insert = LocalTransport(core), {"model_id": tc.model_id}, core.store.insert

    def database_down(table, **row):
        if table is not requests:  # not a submit's record (the worker's own)
            return real_insert(table, **row)
        core.store.insert = real_insert  # down for this one submit
        raise sa.exc.OperationalError("INSERT INTO requests", {}, ConnectionRefusedError("database is down"))

    core.store.insert = database_down
    with pytest.raises(sa.exc.OperationalError):
        core.submit("local", "get_info", body, "info-1")
    alone = core.submit("local", "get_info", body)  # the only pending call: the refused one took no place
    assert run_sync(transport.retrieve(alone, 30)).status == "done"
    retried = core.submit("local", "get_info", body, "info-1")
    assert run_sync(transport.retrieve(retried, 30)).status == "done"
    core.close()


def test_a_restart_fails_in_flight_requests_drops_ephemeral_weights_and_resumes_seqs(tmp_path, caplog):
    from pytrio import types as t
    from pytrio.futures import run_sync
    from trio_server.errors import RESTART_MESSAGE
    from trio_server.store import checkpoints, now, requests

    before = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(before)
    named = tc.save_weights_for_sampler("kept").result().path
    tc.save_weights_and_get_sampling_client()  # unnamed: ephemeral weights
    (row,) = before.store.select(checkpoints, kind="ephemeral")
    folder = before.checkpoint_dir(row["run_id"], row["kind"], row["name"])
    assert folder.exists()
    (kept,) = before.store.select(checkpoints, name="kept")
    kept_dir = before.checkpoint_dir(kept["run_id"], kept["kind"], "kept")
    moved_aside = kept_dir.with_name(".kept.old-1-2")
    kept_dir.rename(moved_aside)  # a crash between the two renames of rewriting "kept"
    before.store.insert(requests, request_id="req-in-flight", user_id="local", op="optim_step", run_id=tc.model_id,
                        seq=5, status="pending", idempotency_key=None, created_at=now())
    before.close()

    with caplog.at_level("WARNING", logger="trio.server"):
        after = ServiceCore(tmp_path, dtype="float32")
    assert "marked 1 in-flight requests failed" in caplog.text  # operators see what a restart cost
    state = run_sync(LocalTransport(after).retrieve("req-in-flight", 0))
    assert (state.status, state.error) == ("failed", t.ErrorInfo(category="server", message=RESTART_MESSAGE))
    assert after.store.select(checkpoints, kind="ephemeral") == [] and not folder.exists()
    assert [c.path for c in after.list_checkpoints("local")] == [named]  # named weights outlive restarts
    assert kept_dir.is_dir() and not moved_aside.exists()  # the interrupted rewrite was undone at start-up
    assert after.next_seq[tc.model_id] == 6  # past every seq the store has seen, not the run's next_seq (1)
    after.close()


def test_a_step_stored_whose_snapshot_write_a_crash_cut_is_undone_at_start(tmp_path):
    """The store and the snapshot can disagree on a run's step after a crash (a failed
    write is counted as done; a crash can fall between a write and the store's update):
    the run resumes from its snapshot's step, and so does the store."""
    from trio_server.store import runs

    before = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(before)
    tc.forward_backward([DATUM])
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    before.store.update(runs, "run_id", tc.model_id, step=2)  # step 2 stored, its write never landed
    damaged = trainer(before)
    before.close()
    snapshot_path(tmp_path / "snapshots", damaged.model_id).write_bytes(b"\xff" * 64)  # one damaged file

    after = ServiceCore(tmp_path, dtype="float32")  # starts all the same
    assert after.get_run("local", tc.model_id).step == 1
    assert after.get_run("local", damaged.model_id).step == 0
    after.close()


def test_a_recently_used_run_is_not_offloaded(tmp_path):
    core = ServiceCore(tmp_path, dtype="float32", idle_offload_seconds=3600)
    tc = trainer(core)
    tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
    worker = core.workers[MODEL]
    worker._offload_runs()  # the worker calls it after each batch and when idle; here at once
    assert tc.model_id in worker.last_used and tc.model_id in worker.engine.host.adapters
    core.close()  # (test_idle_runs_move_to_disk_and_come_back_unchanged: after the window, it goes)


class _OffloadRecorder:
    """An engine that only records which runs were sent to disk (those in ``failing``
    raise instead, as when a snapshot cannot be written)."""

    def __init__(self) -> None:
        self.offloaded: list[str] = []
        self.failing: set[str] = set()
        self.restarted = False  # the next call finds the host restarted (as RayEngine._call does)
        self.notify: Any = None

    def offload(self, run_id: str) -> None:
        if self.restarted:
            self.restarted = False
            self.notify()
        if run_id in self.failing:
            raise OSError(f"no space left writing the snapshot of {run_id}")
        self.offloaded.append(run_id)

    def watch_restarts(self, notify) -> None:
        self.notify = notify

    def close(self) -> None:
        pass


def _stopped_worker(idle_offload_seconds: float, max_resident_runs: int | None, ages: dict[str, float],
                    queued: tuple[str, ...] = ()) -> HostWorker:
    """A worker whose thread has ended (so nothing else offloads), its runs last used
    ``ages`` seconds ago, with a request queued for each run in ``queued``."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(engine=_OffloadRecorder(), base_model="m")
    worker = HostWorker(ctx, lambda item, result: None, Sequencing({}, threading.RLock(), 30.0),  # type: ignore[arg-type]
                        idle_offload_seconds, max_resident_runs=max_resident_runs)
    worker.stop()
    now = time.monotonic()
    worker.last_used = {run_id: now - age for run_id, age in ages.items()}
    worker.pending = [SimpleNamespace(run_id=run_id) for run_id in queued]  # type: ignore[misc]
    return worker


def test_past_max_resident_runs_the_least_recently_used_leave_memory():
    worker = _stopped_worker(600, 2, {"c": 1, "a": 3, "d": 0, "b": 2}, queued=("a",))
    worker._offload_runs()
    assert worker.engine.offloaded == ["b", "c"]  # a is older but has a request queued
    assert set(worker.last_used) == {"a", "d"}
    worker._offload_runs()
    assert worker.engine.offloaded == ["b", "c"]  # two resident: none over the limit


def test_a_run_whose_offload_fails_stays_counted_and_the_next_goes_instead():
    worker = _stopped_worker(600, 2, {"a": 3, "b": 2, "c": 1, "d": 0})
    worker.engine.failing = {"a"}
    worker._offload_runs()
    assert worker.engine.offloaded == ["b", "c"]  # still two over the limit after a failed
    assert set(worker.last_used) == {"a", "d"}  # a is still in memory: tracked, tried again later
    assert worker.last_used["a"] > worker.last_used["d"]  # ... once the others have had their turn


def test_a_host_restart_found_by_an_offload_marks_every_resident_run_and_the_loop_goes_on():
    """The offload was the first call after the restart: the run it was sending out had left
    the resident map first, so it was not marked (its next step made on the calls since
    alone), and the next run's removal raised KeyError in the worker's thread."""
    from collections import Counter
    from types import SimpleNamespace

    worker = _stopped_worker(60, None, {"a": 120, "b": 119})
    worker.ctx = SimpleNamespace(unstepped=Counter({"a": 2, "b": 3}), lost=Counter())  # type: ignore[assignment]
    worker.engine.restarted = True
    worker._offload_runs()
    assert worker.ctx.lost == {"a": 2, "b": 3}
    assert worker.engine.offloaded == ["a"] and worker.last_used == {}  # b was not resident any more


def test_with_no_run_resident_there_is_nothing_to_offload():
    worker = _stopped_worker(10, 2, {})  # e.g. a host that has only sampled
    worker._offload_runs()
    assert worker.engine.offloaded == [] and worker.last_used == {}


def test_the_pass_budget_is_short_only_while_the_host_is_shared():
    """max_pass_tokens (7) while another user is queued or seen recently, or samples
    decode; max_batch_tokens (100) for one user alone."""
    from types import SimpleNamespace

    from trio_server import worker as worker_module

    worker = HostWorker(SimpleNamespace(engine=_OffloadRecorder(), base_model="m"),  # type: ignore[arg-type]
                        lambda item, result: None, Sequencing({}, threading.RLock(), 30.0), 600,
                        max_batch_tokens=100, max_pass_tokens=7)
    worker.stop()
    assert worker.pass_tokens() == 100  # nobody yet
    worker.seen_at = {"a": time.monotonic()}
    assert worker.pass_tokens() == 100  # one user: alone
    worker.seen_at["b"] = time.monotonic()
    assert worker.pass_tokens() == 7
    worker.seen_at["a"] -= worker_module.SHARING_SECONDS + 1  # a left
    assert worker.pass_tokens() == 100 and worker.seen_at.keys() == {"b"}
    worker.seen_at = {"a": time.monotonic()}
    worker.pending = [SimpleNamespace(user_id="b", op="forward_backward")]  # type: ignore[list-item]
    assert worker.pass_tokens() == 7  # queued, however long ago
    worker.pending = [SimpleNamespace(user_id="a", op="forward_backward")]  # type: ignore[list-item]
    assert worker.pass_tokens() == 100
    worker.pending.append(SimpleNamespace(user_id="a", op="sample"))  # type: ignore[arg-type]
    assert worker.pass_tokens() == 7  # its own samples will decode between the passes
    worker.pending.pop()
    worker.decoding = {"s1": SimpleNamespace(user_id="a")}  # type: ignore[dict-item]
    assert worker.pass_tokens() == 7  # ... and do
    worker.decoding, worker.slice_alone = {}, True
    assert worker.pass_tokens() == 7
    worker.max_pass_tokens = None
    assert worker.pass_tokens() is None  # never split
    worker.seen_at["a"] -= worker_module.SHARING_SECONDS + 1
    worker._done(SimpleNamespace(request_id="r", user_id="c"))  # type: ignore[arg-type]
    assert worker.seen_at.keys() == {"c"}  # a user gone is forgotten, whatever the budget


def test_the_worker_splits_whole_requests_by_the_budget_and_leaves_parts_to_their_split():
    """A queued request is cut by the pass budget when the worker schedules; a part queued
    under a larger budget stays one part (its split re-cuts only what comes after it)."""
    from types import SimpleNamespace

    from pytrio import types as t
    from trio_server.scheduler import WorkItem
    from trio_server.splitting import maybe_split, split_of

    worker = HostWorker(SimpleNamespace(engine=_OffloadRecorder(), base_model="m"),  # type: ignore[arg-type]
                        lambda item, result: None, Sequencing({}, threading.RLock(), 30.0), 600,
                        max_batch_tokens=100, max_pass_tokens=12)
    worker.stop()
    toks = list(range(1, 8))
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})

    def request(rid: str, user: str) -> WorkItem:
        return WorkItem(rid, "forward_backward", t.ForwardRequest(model_id=f"run-{user}", seq=0, data=[datum] * 8),
                        user, f"run-{user}", 0)

    whole, part = request("r1", "a"), maybe_split(request("r2", "b"), 24)  # a part of 4 datums (24 tokens)
    worker.pending = [whole, part]
    worker._next_work()  # two users queued: passes of 12 tokens
    assert worker.pending[1] is part and len(part.request.data) == 4
    split = split_of(worker.pending[0])
    assert split is not None and split.whole is whole and split.starts == [0, 2, 4, 6]
    worker.max_pass_tokens, worker.max_batch_tokens = None, 60  # never split: batches still bounded
    worker.pending = [request("r3", "a"), request("r4", "b")]  # 48 tokens each
    assert [item.request_id for item in worker._next_work().batch] == ["r3"]


def test_max_resident_runs_is_at_least_one():
    with pytest.raises(ValueError, match="max_resident_runs"):
        Limits(max_resident_runs=0)
    assert Limits(max_resident_runs=None).max_resident_runs is None


def test_runs_unused_past_the_idle_window_leave_memory_unless_queued():
    worker = _stopped_worker(10, None, {"a": 20, "b": 11, "c": 5, "d": 30}, queued=("d",))
    worker._offload_runs()
    assert worker.engine.offloaded == ["a", "b"]
    assert set(worker.last_used) == {"c", "d"}
    worker._offload_runs()
    assert worker.engine.offloaded == ["a", "b"]  # none idle, no limit: none leave


def test_each_worker_gets_the_cores_scheduling_and_memory_limits(tmp_path):
    limits = Limits(max_batch_tokens=99, max_pass_tokens=7, max_resident_runs=3, slice_alone=True)
    core = ServiceCore(tmp_path, dtype="float32", limits=limits, idle_offload_seconds=42)
    trainer(core)
    worker = core.workers[MODEL]
    assert (worker.max_batch_tokens, worker.max_pass_tokens, worker.max_resident_runs) == (99, 7, 3)
    assert worker.slice_alone
    assert worker.idle_offload_seconds == 42
    core.close()


def test_a_busy_server_keeps_at_most_max_resident_runs_in_memory(tmp_path):
    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(max_resident_runs=1))
    svc = trio.ServiceClient(transport=LocalTransport(core))
    first, second = (svc.create_lora_training_client(base_model=MODEL, rank=2, seed=s) for s in (1, 2))
    for tc in (first, second):
        tc.forward_backward([DATUM])
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    adapters = core.workers[MODEL].engine.host.adapters
    assert first.model_id not in adapters and second.model_id in adapters
    first.forward_backward([DATUM])  # back from disk
    assert first.optim_step(trio.AdamParams(learning_rate=1e-2)).result().metrics["step"] == 2.0
    assert first.model_id in adapters and second.model_id not in adapters
    core.close()


def test_an_unknown_operation_is_not_found_and_request_ids_have_one_form(tmp_path):
    import re

    from trio_server.errors import ServiceError

    core = ServiceCore(tmp_path, dtype="float32")
    with pytest.raises(ServiceError) as refused:
        core.submit("local", "train_faster", {})
    assert (refused.value.category, refused.value.status) == ("not_found", 404)
    assert "'train_faster'" in refused.value.message
    request_id = core.submit("local", "create_model", {"base_model": MODEL, "lora_config": {"rank": 2}})
    assert re.fullmatch(r"req-[0-9a-f]{16}", request_id), request_id  # the form the docs and logs show
    core.close()


def test_a_retried_submit_answers_its_first_request_even_if_it_would_now_be_refused(tmp_path):
    """The key decides before anything else: a retry whose checkpoint was deleted
    meanwhile still answers the original (done) request, not a new not_found."""
    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    path = tc.save_weights_for_sampler("s").result().path
    body = {"model_path": path}
    first = core.submit("local", "create_sampler", body, "sampler-key")
    wait_until(lambda: core._stored_outcome("local", first).status == "done", "the sampler to be created")
    core.delete_checkpoint("local", path)
    assert core.submit("local", "create_sampler", body, "sampler-key") == first
    core.close()


def test_a_seq_still_queued_cannot_be_submitted_twice(tmp_path):
    from trio_server.errors import ServiceError

    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(seq_gap_seconds=3600))
    run_id = trainer(core).model_id
    waiting = core.submit("local", "optim_step", {"model_id": run_id, "seq": 1, "adam_params": {}})  # waits for seq 0
    with pytest.raises(ServiceError, match="seq: 1 was already used") as refused:
        core.submit("local", "optim_step", {"model_id": run_id, "seq": 1, "adam_params": {}})
    assert refused.value.status == 409
    core.submit("local", "optim_step", {"model_id": run_id, "seq": 0, "adam_params": {}})
    wait_until(lambda: core._stored_outcome("local", waiting).status == "done", "seq 1 to run after seq 0")
    core.close()


def test_a_seq_running_cannot_be_submitted_twice(tmp_path):
    """A copy of a running request's seq was accepted (only queued ones were looked at);
    once the first was answered its seq was behind the run's next, so the copy stayed
    pending for good, holding a slot of the user's queue bound and keeping the run's
    later missing seqs from being skipped."""
    from trio_server.errors import ServiceError

    core = ServiceCore(tmp_path, dtype="float32")
    run_id = trainer(core).model_id
    body = {"model_id": run_id, "seq": 0, "loss_fn": "cross_entropy", "data": [DATUM.model_dump()]}
    with forward_held(core.workers[MODEL]) as running:
        first = core.submit("local", "forward", body)
        assert running.wait(60)
        with pytest.raises(ServiceError, match="seq: 0 was already used") as refused:
            core.submit("local", "forward", body)
        assert refused.value.status == 409
    wait_until(lambda: core._stored_outcome("local", first).status == "done", "the first to finish")
    wait_until(lambda: not core.pending_by_user, "nothing left pending")
    core.close()


def test_a_load_of_a_checkpoint_expired_or_deleted_after_it_was_accepted_is_a_404(tmp_path):
    """Accepted while the checkpoint was there, run after: an expired one loaded all the
    same, and a deleted one failed naming the server's folder (as a validation error)."""
    from trio_server.store import checkpoints

    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    expiring, deleted = (tc.save_state(name).result().path for name in ("expiring", "deleted"))
    with forward_held(core.workers[MODEL]) as running:
        held = tc.forward([DATUM])
        assert running.wait(60)
        load = core.submit("local", "load_weights", {"model_id": tc.model_id, "seq": 3, "path": expiring})  # after the forward
        from_state = core.submit("local", "create_model_from_state", {"path": deleted, "with_optimizer": False})
        sampler = core.submit("local", "create_sampler", {"model_path": expiring})
        core.store.update(checkpoints, "path", expiring, expires_at="2000-01-01T00:00:00.000+00:00")
        core.delete_checkpoint("local", deleted)
    held.result()
    from pytrio.futures import run_sync

    for request_id, path in ((load, expiring), (from_state, deleted), (sampler, expiring)):
        outcome = run_sync(LocalTransport(core).retrieve(request_id, 60))
        assert outcome.status == "failed" and outcome.error.category == "not_found", outcome
        assert f"checkpoint '{path}' no longer exists" in outcome.error.message
        assert str(tmp_path) not in outcome.error.message
    core.close()


def test_a_run_records_its_next_seq_and_last_request_time(tmp_path):
    """What restarts and `trio runs list` read: the run's row, not only memory."""
    from trio_server.store import runs

    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    assert core.get_run("local", tc.model_id).last_request_at is None
    for _ in range(3):
        tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
    assert core.store.get(runs, run_id=tc.model_id)["next_seq"] == 3
    assert core.get_run("local", tc.model_id).last_request_at is not None
    core.close()


def test_the_worker_is_a_named_daemon_thread(tmp_path):
    """Named for stack dumps and profilers; a daemon, so it never holds a process open."""
    core = ServiceCore(tmp_path, dtype="float32")
    trainer(core)
    thread, answers = core.workers[MODEL].thread, core.workers[MODEL].answers.thread
    assert (thread.name, thread.daemon) == (f"trio-worker-{MODEL}", True)
    assert (answers.name, answers.daemon) == (f"trio-answers-{MODEL}", True)
    core.close()


def test_answers_run_on_a_daemon_thread_whichever_thread_makes_them():
    """The worker's Answers is made on whatever thread first needs the worker; a thread
    made without ``daemon`` takes its maker's, so test one made on this (non-daemon) one."""
    answers = Answers("trio-answers-test", engine=None, resolve=lambda item, result: None)  # type: ignore[arg-type]
    try:
        assert answers.thread.daemon
    finally:
        answers.close(5)


def test_a_request_has_left_running_when_it_is_resolved(tmp_path):
    """Batches and decode steps alike: whoever sees a request done never sees it running
    (tests and the queue position wait on ``running`` naming the request that runs next)."""
    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    worker = core.workers[MODEL]
    still_running: list[tuple[str, bool]] = []
    real_resolve = worker.answers.resolve

    def spying_resolve(item, result):
        with worker.cond:
            still_running.append((item.op, item.request_id in worker.running))
        real_resolve(item, result)

    worker.answers.resolve = spying_resolve
    tc.forward([DATUM]).result()
    params = trio.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    svc.create_sampling_client(base_model=MODEL).sample(trio.ModelInput.from_ints([1, 5, 9]), 1, params).result()
    assert {op for op, _ in still_running} >= {"forward", "sample"}
    assert not any(running for _, running in still_running), still_running
    core.close()


def test_a_users_sample_joins_a_decode_batch_full_of_anothers(tmp_path):
    """Alice's long samples fill every slot (MAX_DECODING); Bob's short one joins the next
    step all the same (it waited for all of hers: 12.8 s for a 4-token sample), and
    another of Alice's does not."""
    from trio_server.scheduler import MAX_DECODING

    core = ServiceCore(tmp_path, dtype="float32")
    alice, bob = (trio.ServiceClient(transport=LocalTransport(core, user)).create_sampling_client(base_model=MODEL)
                  for user in ("alice", "bob"))
    worker = core.workers[MODEL]
    permits, real_decode = threading.Semaphore(0), worker.engine.decode
    admitted: list[set[str]] = []  # who joined at each step

    def gated_decode(admit, max_steps=1):
        admitted.append({core.owners[rid] for rid in admit})
        permits.acquire()
        return real_decode(admit, max_steps)

    released = [0]

    def step_until(condition, what: str) -> None:
        """Let the worker take one decode step each time it is waiting for one, until ``condition``."""
        def check() -> bool:
            if condition():
                return True
            if len(admitted) > released[0]:
                permits.release()
                released[0] += 1
            return False
        wait_until(check, what)

    worker.engine.decode = gated_decode
    prompt = trio.ModelInput.from_ints([1, 5, 9, 200])
    params = trio.SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    hers = [alice.sample(prompt, 1, params) for _ in range(MAX_DECODING)]
    step_until(lambda: len(worker.decoding) == MAX_DECODING, "Alice's samples to fill the decode batch")
    more, his = alice.sample(prompt, 1, params), bob.sample(prompt, 1, trio.SamplingParams(max_tokens=4))
    step_until(lambda: "bob" in admitted[-1], "Bob's sample to join")
    assert len(worker.decoding) == MAX_DECODING + 1 and admitted[-1] == {"bob"} and released[0] < 25
    permits.release(1000)
    assert len(his.result().sequences[0].tokens) == 4
    assert all(len(f.result().sequences[0].tokens) == 30 for f in [*hers, more])
    core.close()


def test_a_short_sample_joins_a_running_decode_and_finishes_first(tmp_path):
    """Continuous batching in the worker: a sample request submitted while a long one decodes
    joins its batch and is resolved as soon as it is done, and a training call queued meanwhile
    runs between decode steps. Each decode step waits for a permit, so the order is exact."""
    import threading

    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    sampler = svc.create_sampling_client(base_model=MODEL)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
    worker = core.workers[MODEL]
    permits = threading.Semaphore(0)
    steps: list[list[str]] = []  # requests still decoding after each step
    real_decode, real_resolve = worker.engine.decode, worker.answers.resolve
    resolved: list[str] = []

    entered: list[int] = []

    def gated_decode(admit, max_steps=1):
        entered.append(len(admit))
        permits.acquire()
        update = real_decode(admit, max_steps)
        steps.append(update.decoding)
        return update

    def spying_resolve(item, result):
        sample = item.op == "sample"
        resolved.append(f"sample-{item.request.sampling_params.max_tokens}" if sample else item.op)
        real_resolve(item, result)

    worker.engine.decode, worker.answers.resolve = gated_decode, spying_resolve
    prompt = trio.ModelInput.from_ints([1, 5, 9, 200])
    long_id = lambda w: next(iter(w.decoding))  # noqa: E731
    params = lambda n: trio.SamplingParams(max_tokens=n, temperature=1.0, seed=n, ignore_eos=True)  # noqa: E731
    long = sampler.sample(prompt, 2, params(40))
    permits.release()
    wait_until(lambda: len(entered) == 2, "the long request's second step to wait for its permit")
    assert steps == [[long_id(worker)]]
    short = sampler.sample(prompt, 1, params(3))
    fwd = tc.forward([DATUM])
    wait_until(lambda: len(worker.snapshot()) == 2, "both to queue behind the gated step")
    permits.release(100)
    short_out, long_out, fwd_out = short.result(), long.result(), fwd.result()
    assert [len(s.tokens) for s in short_out.sequences] == [3]
    assert [len(s.tokens) for s in long_out.sequences] == [40, 40]
    assert fwd_out.loss_fn_outputs
    assert resolved[-3:] == ["forward", "sample-3", "sample-40"]  # not behind the long one
    assert max(len(live) for live in steps) == 2  # short shared the long one's batch
    assert worker.decode_steps == len(steps) < 40 + 3  # not one batch after the other
    core.close()


def test_a_next_turn_reports_the_prompt_tokens_it_reused(tmp_path):
    """Multi-turn through the SDK: turn 2 extends turn 1 (prompt + sampled tokens + more), and
    its response says how many prompt tokens came from the prefix cache."""
    core = ServiceCore(tmp_path, dtype="float32")
    sampler = trio.ServiceClient(transport=LocalTransport(core)).create_sampling_client(base_model=MODEL)
    params = trio.SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    turn1 = [1, 5, 9, 200, 31]
    first = sampler.sample(trio.ModelInput.from_ints(turn1), 1, params).result()
    assert first.prompt_cache_hit_tokens == 0
    turn2 = turn1 + first.sequences[0].tokens + [7, 8]
    second = sampler.sample(trio.ModelInput.from_ints(turn2), 1, params).result()
    assert second.prompt_cache_hit_tokens == len(turn1) + 5 - 1  # all but the last sampled token
    core.close()


def test_no_user_reuses_another_users_prompt_from_the_prefix_cache(tmp_path):
    """Bob sent Alice's prompt and its first sampled tokens: his answer counted the tokens
    the base model's cache held for her (one entry space for everyone), so by guessing on
    he could read her prompts and samples token by token. Each user reuses their own."""
    core = ServiceCore(tmp_path, dtype="float32")
    alice, bob = (trio.ServiceClient(transport=LocalTransport(core, user)).create_sampling_client(base_model=MODEL)
                  for user in ("alice", "bob"))
    params = trio.SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    secret = trio.ModelInput.from_ints([1, 5, 9, 200, 31, 7, 7, 300, 44, 12, 3, 18])
    alice.sample(secret, 1, params).result()
    assert bob.sample(secret, 1, params).result().prompt_cache_hit_tokens == 0
    assert alice.sample(secret, 1, params).result().prompt_cache_hit_tokens == 11  # all but the last
    core.close()


def test_a_submit_past_a_queue_bound_is_refused_before_anything_changes_and_a_retry_still_answers(tmp_path):
    from pytrio import types as t
    from trio_server.errors import ServiceError

    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(max_pending_per_user=1, max_pending_total=2,
                                                                retry_after_seconds=2.5))
    caps = core.capabilities()
    assert (caps.max_pending_per_user, caps.max_pending_total) == (1, 2)
    runs = {u: trainer(core, u) for u in "abc"}
    d = DATUM

    def forward(user: str, seq: int = 0) -> t.ForwardRequest:
        return t.ForwardRequest(model_id=runs[user].model_id, seq=seq, data=[d])

    worker = core.workers[MODEL]
    with worker.engine.host.lock:  # the worker stays busy with a's first request
        held = core.submit("a", "forward", forward("a"), "key-a")
        wait_until(lambda: bool(worker.running), "a's request to run")
        rows = len(core.store.select(requests_table))
        with pytest.raises(ServiceError) as refused:
            core.submit("a", "forward", forward("a", 1), "key-a2")
        assert (refused.value.status, refused.value.category, refused.value.retry_after) == (429, "capacity", 2.5)
        assert "max_pending_per_user: 1 requests of this user pending, the limit is 1" in refused.value.message
        assert core.submit("a", "forward", forward("a"), "key-a") == held  # a retry of an accepted one: its id
        queued = core.submit("b", "forward", forward("b"), "key-b")  # b has its own bound
        with pytest.raises(ServiceError, match="max_pending_total: 2 requests pending, the limit is 2") as full:
            core.submit("c", "forward", forward("c"), "key-c")
        assert full.value.status == 429
        assert len(core.store.select(requests_table)) == rows + 1  # only b's; nothing of the refused
        assert len(worker.snapshot()) == 1 and core.request_for_key("a", "key-a2") is None
    for request_id, user in ((held, "a"), (queued, "b")):  # nothing accepted was dropped
        wait_until(lambda r=request_id, u=user: core._stored_outcome(u, r).status == "done", "the held requests")
    wait_until(lambda: not core.unfinished, "the counts to drain")
    assert core.pending_by_user == {}
    assert core.submit("c", "forward", forward("c"), "key-c")  # room again
    core.close()


def test_a_bug_escaping_a_decode_step_fails_the_requests_decoding_not_the_worker(tmp_path, monkeypatch):
    """The step that admits a second request (the first one live) raises: both fail with a
    server error naming the bug, nothing stays decoding, and the next request samples."""
    from trio_server import worker as worker_module

    core = ServiceCore(tmp_path, dtype="float32")
    sampler = trio.ServiceClient(transport=LocalTransport(core)).create_sampling_client(base_model=MODEL)
    worker = core.workers[MODEL]
    real_decode = worker_module.decode

    def broken_once_both_decode(ctx, admit, live):
        if admit and live:
            monkeypatch.setattr(worker_module, "decode", real_decode)
            raise RuntimeError("a bug in a decode step")
        return real_decode(ctx, admit, live)

    outcomes = record_outcomes(worker)
    monkeypatch.setattr(worker_module, "decode", broken_once_both_decode)
    prompt = trio.ModelInput.from_ints([1, 5, 9, 200])
    params = trio.SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True)
    with worker.engine.host.lock:  # the first admission waits, so the second queues behind it
        futures = [sampler.sample(prompt, 1, params)]
        wait_until(lambda: bool(worker.decoding), "the first request to be admitted")
        futures.append(sampler.sample(prompt, 1, params))
        wait_until(lambda: len(worker.snapshot()) == 1, "the second request to queue")
    for future in futures:
        with pytest.raises(trio.ServerError, match="internal error while sampling: RuntimeError: a bug in a decode step"):
            future.result(timeout=120)
    assert len(outcomes) == 2 and all(
        (out, err.category, err.status) == (None, "server", 500) for out, err in outcomes.values())
    assert not worker.decoding and worker.thread.is_alive()
    assert len(sampler.sample(prompt, 1, params).result(timeout=120).sequences[0].tokens) == 30
    core.close()


def test_a_bug_escaping_execute_fails_that_batch_not_the_worker(tmp_path, monkeypatch, caplog):
    """A forward (a batch of one) and then two runs' forward_backward (one batch of two) hit
    a bug in execute: each request fails with a 500 naming the op and the bug, the log line
    names the batch's request ids, the failed batches' times still feed the queue estimates,
    and the worker goes on to run the next call."""
    from trio_server import worker as worker_module

    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    runs = [svc.create_lora_training_client(base_model=MODEL, rank=2, seed=k) for k in range(2)]
    worker = core.workers[MODEL]
    real_execute, release, failed = worker_module.execute, threading.Event(), []

    def buggy(ctx, batch):
        if len(failed) < 2:
            if not failed:
                release.wait(timeout=120)  # hold the worker while the next two calls queue
            failed.append([item.request_id for item in batch])
            raise RuntimeError("a bug in execute")
        return real_execute(ctx, batch)

    outcomes = record_outcomes(worker)
    monkeypatch.setattr(worker_module, "execute", buggy)
    d = DATUM
    started = time.monotonic()
    with caplog.at_level("ERROR", logger="trio"):
        forward = runs[0].forward([d])
        wait_until(lambda: bool(worker.running), "the forward to run")
        pair = [tc.forward_backward([d]) for tc in runs]
        wait_until(lambda: len(worker.snapshot()) == 2, "both forward_backward calls to queue")
        release.set()
        for future, op in [(forward, "forward"), *((f, "forward_backward") for f in pair)]:
            with pytest.raises(trio.ServerError, match=f"^internal error running {op}: RuntimeError: a bug in execute "):
                future.result(timeout=120)
    elapsed = time.monotonic() - started
    assert [len(ids) for ids in failed] == [1, 2]
    assert sorted(outcomes) == sorted(failed[0] + failed[1]) and all(
        (out, err.category, err.status) == (None, "server", 500) for out, err in outcomes.values())
    logged = [r.getMessage() for r in caplog.records if "unexpected error" in r.getMessage()]
    assert [m.split()[0] for m in logged] == [f"requests={','.join(ids)}" for ids in failed], logged
    times = {op: list(worker.durations.recent[op]) for op in ("forward", "forward_backward")}
    assert all(len(t) == 1 and 0 < t[0] <= elapsed for t in times.values()), (times, elapsed)
    assert worker.thread.is_alive() and runs[1].forward_backward([d]).result(timeout=120).metrics["loss:sum"] > 0
    core.close()


def test_a_sample_records_its_step_times_and_logs_its_time_in_the_batch(tmp_path, caplog):
    """Each decode step's time goes into the host's recent "sample" durations (queue
    estimates); the finished request's log line gives its time from admission in ms, which
    spans all its steps and no more than the wait for its result."""
    import re

    core = ServiceCore(tmp_path, dtype="float32")
    sampler = trio.ServiceClient(transport=LocalTransport(core)).create_sampling_client(base_model=MODEL)
    worker = core.workers[MODEL]
    params = trio.SamplingParams(max_tokens=20, temperature=1.0, seed=2, ignore_eos=True)
    with caplog.at_level("INFO", logger="trio"):
        started = time.monotonic()
        sampler.sample(trio.ModelInput.from_ints([1, 5, 9, 200]), 1, params).result(timeout=120)
        waited = time.monotonic() - started
    steps = list(worker.durations.recent["sample"])
    assert len(steps) == worker.decode_steps >= 20 and all(s > 0 for s in steps)
    [ms] = [float(m.group(1)) for r in caplog.records if (m := re.search(r"op=sample ms=(\d+)", r.getMessage()))]
    assert 1000 * sum(steps) - 0.5 <= ms <= 1000 * waited + 0.5, (ms, sum(steps), waited)
    core.close()


def test_a_user_who_used_the_host_waits_behind_one_who_did_not(tmp_path):
    """Fair queueing remembers between batches: user a ran a long request, so a's next
    request, queued before b's, runs after it (with no memory, arrival order would win)."""
    core = ServiceCore(tmp_path, dtype="float32")
    a, b, c = (trainer(core, user) for user in "abc")
    long = list(range(1, 200))
    a.forward([next_token_datum(long)]).result()
    worker, order = core.workers[MODEL], []
    real_resolve = worker.answers.resolve
    worker.answers.resolve = lambda item, result: (order.append(item.user_id), real_resolve(item, result))
    d = DATUM
    with worker.engine.host.lock:  # c's request runs and blocks; a's then b's queue behind it
        blocker = c.forward([d])
        wait_until(lambda: bool(worker.running), "c's request to run")
        queued = [a.forward([d]), b.forward_backward([d])]  # two ops: two batches, in fair order
        wait_until(lambda: len(worker.snapshot()) == 2, "a's and b's requests to queue")
    blocker.result()
    for future in queued:
        future.result()
    assert order == ["c", "b", "a"], order
    core.close()


def test_a_script_that_never_closes_its_core_stops_its_workers_at_exit(tmp_path):
    """Embedded users rarely close: at exit the core stops its workers (and their snapshot
    threads) before the interpreter tears down; a thread left inside torch then could abort
    the process ("terminate called without an active exception", seen 1 run in 6)."""
    import os
    import subprocess
    import sys

    script = (
        "import pytrio as trio\n"
        "from pytrio.transport.local import LocalTransport\n"
        "from trio_server import worker\n"
        "from trio_server.core import ServiceCore\n"
        "real_stop = worker.HostWorker.stop\n"
        "def stop(self):\n"
        "    real_stop(self)\n"
        "    print('worker stopped, thread alive:', self.thread.is_alive(), flush=True)\n"
        "worker.HostWorker.stop = stop\n"
        f"core = ServiceCore({str(tmp_path)!r}, dtype='float32')\n"
        f"trio.ServiceClient(transport=LocalTransport(core)).create_lora_training_client(base_model={MODEL!r}, rank=2)\n"
        "print('exiting', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["exiting", "worker stopped, thread alive: False"], done.stdout


def test_a_checkpoint_being_saved_holds_up_no_other_checkpoint_work_and_is_not_swept(tmp_path, monkeypatch):
    """A save writes without holding the checkpoints' lock: listing, deleting another
    checkpoint and sweeping expired ones go on meanwhile (they used to wait for the whole
    write, on the server's event loop); the path being written is skipped by a sweep and
    refused to a delete (409) until its record is in."""
    from trio_server.errors import ServiceError
    from trio_server.handlers import remove_checkpoint
    from trio_server.store import checkpoints

    core = ServiceCore(tmp_path, dtype="float32")
    try:
        svc = trio.ServiceClient(transport=LocalTransport(core))
        tc = svc.create_lora_training_client(base_model=MODEL, rank=2)
        other = tc.save_state("other").result().path
        path = tc.save_state("slow").result().path
        core.store.update(checkpoints, "path", path, expires_at="2000-01-01T00:00:00.000+00:00")  # expired
        engine = core.workers[MODEL].engine
        started, release = threading.Event(), threading.Event()
        real = engine.save_state

        def held(run_id, folder):
            started.set()
            release.wait(60)
            return real(run_id, folder)

        monkeypatch.setattr(engine, "save_state", held)
        saving = tc.save_state("slow")  # an expired name is free again: written over
        assert started.wait(60)
        assert {c.path for c in core.list_checkpoints("local")} == {other}  # the sweep skipped "slow"
        assert core.checkpoint_dir(tc.model_id, "weights", "slow").exists()
        with pytest.raises(ServiceError, match="is being saved"):
            remove_checkpoint(core.store, core.data_dir, core.store.get(checkpoints, path=path))
        core.delete_checkpoint("local", other)  # another checkpoint: at once
        release.set()
        assert saving.result().path == path
        assert [c.path for c in core.list_checkpoints("local")] == [path]
    finally:
        core.close()


def test_expired_checkpoints_take_no_room_in_the_byte_quota(tmp_path):
    from trio_server.store import checkpoints

    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(max_checkpoint_bytes_per_user=1))
    try:
        tc = trainer(core)
        path = tc.save_state("first").result().path  # at the quota from now on
        with pytest.raises(trio.ValidationError, match="max_checkpoint_bytes_per_user"):
            tc.save_state("second").result()
        core.store.update(checkpoints, "path", path, expires_at="2000-01-01T00:00:00.000+00:00")
        assert tc.save_state("third").result().path.endswith("/third")
    finally:
        core.close()


def test_a_steps_snapshot_write_holds_up_its_answer_not_other_users(tmp_path, monkeypatch):
    """While one run's step is being written to its snapshot, the worker serves another
    user; the step is answered (and stored) once the write lands, and the same run's next
    call runs only then (a crash before it would undo the step the call built on)."""
    from trio_engine import snapshot
    from trio_server.store import runs

    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    alice, bob = (svc.create_lora_training_client(base_model=MODEL, rank=2, seed=k) for k in range(2))
    release, real_write = threading.Event(), snapshot.write
    monkeypatch.setattr(snapshot, "write", lambda path, snap: (release.wait(), real_write(path, snap)))
    answered: list[str] = []
    real_resolve = core.workers[MODEL].answers.resolve
    core.workers[MODEL].answers.resolve = lambda item, r: (answered.append(item.op), real_resolve(item, r))
    try:
        alice.forward_backward([DATUM])
        step = alice.optim_step(trio.AdamParams(learning_rate=1e-2))
        after = alice.forward([DATUM])
        bob.forward_backward([DATUM]).result(timeout=120)  # not held up by alice's write
        wait_until(lambda: [i.op for i in core.workers[MODEL].pending] == ["forward"], "alice's forward to queue")
        held = not step.done() and core.store.get(runs, run_id=alice.model_id)["step"] == 0
    finally:
        release.set()
    assert held  # neither answered nor stored, and alice's forward waits for it
    assert step.result().metrics["step"] == 1.0 and after.result() is not None
    assert core.store.get(runs, run_id=alice.model_id)["step"] == 1
    assert answered[-2:] == ["optim_step", "forward"]
    core.close()


def test_a_runs_next_call_runs_as_soon_as_its_held_step_is_answered(tmp_path, monkeypatch):
    """A step is answered from the answers' thread once its snapshot is written; the run's
    next call, already queued, must run then, not when the idle worker next wakes (made
    an hour here, so a worker left asleep fails the test instead of slowing every loop)."""
    from trio_server import worker as worker_module

    monkeypatch.setattr(worker_module, "IDLE_WAKE_SECONDS", 3600.0)
    core = ServiceCore(tmp_path, dtype="float32")
    tc = trainer(core)
    steps = []
    for _ in range(3):  # sent at once, each waiting for the answer before it
        tc.forward_backward([DATUM])
        steps.append(tc.optim_step(trio.AdamParams(learning_rate=1e-2)))
    assert [s.result(timeout=120).metrics["step"] for s in steps] == [1.0, 2.0, 3.0]
    core.close()


def test_a_call_behind_a_held_step_is_not_taken_for_one_after_a_missing_seq(tmp_path, monkeypatch):
    """The call after a step whose answer waits for its snapshot write is queued, not
    stalled: however long the write takes (past ``seq_gap_seconds`` here, which is 0), the
    worker must not skip the step's seq as never sent and run the call before the answer."""
    from trio_engine import snapshot

    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(seq_gap_seconds=0.0))
    tc = trainer(core)
    worker = core.workers[MODEL]
    release, real_write = threading.Event(), snapshot.write
    monkeypatch.setattr(snapshot, "write", lambda path, snap: (release.wait(), real_write(path, snap)))
    skips = []
    real_skip = worker._skip_missing_seqs
    monkeypatch.setattr(worker, "_skip_missing_seqs", lambda: (skips.append(1), real_skip()))
    try:
        tc.forward_backward([DATUM])
        step = tc.optim_step(trio.AdamParams(learning_rate=1e-2))
        after = tc.forward([DATUM])
        wait_until(lambda: [i.op for i in worker.pending] == ["forward"], "the forward to queue")
        seen = len(skips)
        wait_until(lambda: len(skips) >= seen + 2, "the idle worker to look for missing seqs")
        still_queued = [i.op for i in worker.pending] == ["forward"] and not step.done()
    finally:
        release.set()
    assert still_queued
    assert step.result().metrics["step"] == 1.0 and after.result() is not None
    core.close()
