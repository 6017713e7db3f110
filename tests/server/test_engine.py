"""LocalEngine behind the Engine protocol: snapshots coalesce, restarts resume, failures stay per item."""

from __future__ import annotations

import dataclasses

import pytest

from trio_engine import AdamConfig, Example, ForwardJob, LoraConfig, snapshot
from trio_server.engine import (
    MAX_WAITING_COPIES,
    EngineSettings,
    Failure,
    LocalEngine,
    SnapshotLost,
    snapshot_path,
)

from ..polling import wait_until

MODEL = "trio/tiny-llama"


def job(run_id, tokens=(1, 5, 9, 200, 31, 7)):
    toks = list(tokens)
    return ForwardJob(run_id, [Example(toks[:-1], {"target_tokens": toks[1:]})])


@pytest.fixture
def engine(tmp_path):
    eng = LocalEngine(MODEL, EngineSettings(snapshot_dir=str(tmp_path / "snapshots"), dtype="float32"))
    yield eng
    eng.close()



def test_asks_during_a_write_coalesce_into_one_more_write_of_the_newest_state(engine, monkeypatch):
    engine.create_adapter("run-a", LoraConfig(rank=2))
    engine.flush()
    writes: list[int] = []
    real_write = snapshot.write

    def counting_write(path, snap):
        writes.append(snap.step)
        real_write(path, snap)

    monkeypatch.setattr(snapshot, "write", counting_write)
    writer = engine.snapshots
    with engine.host.lock:  # the writer's capture waits for the lock: a write in flight
        writer._ask("run-a", None)  # a write without a copy (a failed capture's): copied when written
        wait_until(lambda: "run-a" in writer.writing, "the writer to start")
        for _ in range(5):
            writer._ask("run-a", None)
    engine.flush()
    assert len(writes) == 2, writes  # the one in flight, then one for all five asks
    for _ in range(3):  # steps while writes happen: the file ends at the newest
        engine.forward_backward([job("run-a")])
        engine.optim_step("run-a", AdamConfig(learning_rate=1e-2))
    engine.flush()
    assert snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-a")).step == 3


def test_every_change_a_client_is_told_of_is_on_disk_before_it_is_answered(engine, tmp_path):
    """A new run and a loaded state are in the run's snapshot when the call returns; a
    step once ``durable`` returns (the service answers it then), so a SIGKILL right after
    an answer keeps what it reported."""
    def on_disk() -> int:
        return snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-d")).step

    engine.create_adapter("run-d", LoraConfig(rank=2))
    assert on_disk() == 0
    engine.save_state("run-d", str(tmp_path / "step0"))
    for step in (1, 2):
        engine.forward_backward([job("run-d")])
        metrics, write = engine.optim_step("run-d", AdamConfig(learning_rate=1e-2))
        engine.durable(write)
        assert on_disk() == step == metrics["step"]
    engine.load_state("run-d", str(tmp_path / "step0"), with_optimizer=True)
    assert on_disk() == 0


def test_a_step_is_durable_once_its_write_lands_and_steps_meanwhile_share_one_write(engine, monkeypatch):
    """optim_step returns before its snapshot is written; ``durable`` waits for that write.
    Steps asked for while it is under way are kept by one more write, of the newest state."""
    from threading import Event, Thread

    engine.create_adapter("run-w", LoraConfig(rank=2))
    release, written = Event(), []
    real_write = snapshot.write

    def held_write(path, snap):
        release.wait()
        written.append(snap.step)
        real_write(path, snap)

    monkeypatch.setattr(snapshot, "write", held_write)
    engine.forward_backward([job("run-w")])
    _, first = engine.optim_step("run-w", AdamConfig(learning_rate=1e-2))
    waiter = Thread(target=engine.durable, args=(first,))
    waiter.start()
    wait_until(lambda: "run-w" in engine.snapshots.writing, "the writer to take step 1")
    for _ in range(2):  # the engine goes on while step 1's write is held up
        engine.forward_backward([job("run-w")])
        _, last = engine.optim_step("run-w", AdamConfig(learning_rate=1e-2))
    waiter.join(0.5)
    still_waiting = waiter.is_alive()
    release.set()
    assert still_waiting  # step 1 was not kept before its write landed
    waiter.join()
    engine.durable(last)
    assert written == [1, 3]
    assert snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-w")).step == 3


def test_steps_wait_for_the_writer_once_max_waiting_copies_are_held(engine, monkeypatch):
    """Each step's copy waits in memory for the writer: past ``MAX_WAITING_COPIES`` of them
    the next step waits for a write, so fast steps and a slow disk cannot exhaust memory."""
    from threading import Event, Thread

    runs = [f"run-m{k}" for k in range(MAX_WAITING_COPIES + 2)]
    for run in runs:
        engine.create_adapter(run, LoraConfig(rank=2))
        engine.forward_backward([job(run)])
    release, real_write = Event(), snapshot.write
    monkeypatch.setattr(snapshot, "write", lambda path, snap: (release.wait(), real_write(path, snap)))
    engine.optim_step(runs[0], AdamConfig(learning_rate=1e-2))
    wait_until(lambda: runs[0] in engine.snapshots.writing, "the writer to take the first copy")
    for run in runs[1:-1]:  # these copies wait for the writer
        engine.optim_step(run, AdamConfig(learning_rate=1e-2))
    last = Thread(target=engine.optim_step, args=(runs[-1], AdamConfig(learning_rate=1e-2)))
    last.start()
    last.join(0.5)
    held_back = last.is_alive()
    release.set()
    last.join()
    assert held_back  # one copy too many: the step waited for the writer
    engine.flush()
    assert [snapshot.read(snapshot_path(engine.settings.snapshot_dir, r)).step for r in runs] == [1] * len(runs)


def test_a_step_whose_state_copy_fails_stands_and_is_written_all_the_same(engine, monkeypatch):
    """The step is made before its state is copied for the snapshot: a failed copy (memory)
    must not fail the request (a retry would step twice); the writer copies the run itself."""
    engine.create_adapter("run-c", LoraConfig(rank=2))
    engine.forward_backward([job("run-c")])
    real_capture, calls = snapshot.capture, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("no room for the copy")
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(snapshot, "capture", failing_once)
    metrics, write = engine.optim_step("run-c", AdamConfig(learning_rate=1e-2))
    engine.durable(write)
    assert snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-c")).step == metrics["step"] == 1


def _writes_failing(monkeypatch, times: int) -> list[int]:
    """snapshot.write raising ENOSPC the first ``times`` calls (all: -1); the calls' steps.
    Retry pauses of 0, so the test waits for nothing."""
    import errno

    from trio_server import engine as engine_module

    monkeypatch.setattr(engine_module, "WRITE_RETRY_PAUSES", (0.0, 0.0, 0.0))
    real_write, calls = snapshot.write, []

    def failing_write(path, snap):
        calls.append(snap.step)
        if times < 0 or len(calls) <= times:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, snap)

    monkeypatch.setattr(snapshot, "write", failing_write)
    return calls


def test_a_failed_snapshot_write_is_tried_again_before_the_step_is_answered(engine, monkeypatch, caplog):
    engine.create_adapter("run-r", LoraConfig(rank=2))
    calls = _writes_failing(monkeypatch, times=2)
    engine.forward_backward([job("run-r")])
    _, write = engine.optim_step("run-r", AdamConfig(learning_rate=1e-2))
    engine.durable(write)  # returns once the third try has landed
    assert calls == [1, 1, 1]
    assert snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-r")).step == 1
    assert caplog.text.count("trying again") == 2


def test_a_write_failing_every_try_is_logged_and_the_step_still_answered(engine, monkeypatch, caplog):
    """Failing the step's answer would invite a retry that steps twice: it is answered,
    the failure logged, and the run's next write tries again."""
    engine.create_adapter("run-f", LoraConfig(rank=2))
    calls = _writes_failing(monkeypatch, times=-1)
    engine.forward_backward([job("run-f")])
    _, write = engine.optim_step("run-f", AdamConfig(learning_rate=1e-2))
    engine.durable(write)
    assert calls == [1] * 4  # the first try and one after each pause
    assert snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-f")).step == 0
    assert "a crash now would take it back to its last snapshot" in caplog.text


def test_a_restarted_engine_answers_for_its_predecessors_writes_from_the_disk(engine):
    """A restarted engine (a Ray actor after a crash) never writes what its predecessor
    was asked to: asked about such a write, it reads the run's snapshot, and says the step
    is lost unless the write had landed (then the step is kept, and a redo would apply it twice)."""
    engine.create_adapter("run-x", LoraConfig(rank=2))
    engine.forward_backward([job("run-x")])
    _, write = engine.optim_step("run-x", AdamConfig(learning_rate=1e-2))
    engine.durable(write)
    restarted = LocalEngine(MODEL, engine.settings)
    restarted.durable(write)  # landed before the restart
    with pytest.raises(SnapshotLost, match="run-x"):
        restarted.durable(dataclasses.replace(write, step=write.step + 1))  # never landed


def test_releasing_grads_never_held_keeps_them_unless_all_parts_ran(engine):
    """``release_grads`` of a key the host does not hold: after a failed part (restore) the
    run's grads stay as they are (the hold itself may have failed, touching nothing); after
    all parts ran, they are the later parts' alone (a restart in between) and are dropped."""
    engine.create_adapter("run-g", LoraConfig(rank=2))
    engine.forward_backward([job("run-g")])

    def grads():
        return [p.grad for p in engine.host.adapter_params("run-g").values()]

    assert engine.release_grads("never-held", "run-g", restore=True) is False
    assert all(g is not None for g in grads()) and any(g.any() for g in grads())  # (A's are 0 while B is)
    assert engine.release_grads("never-held", "run-g", restore=False) is False
    assert all(g is None or not g.any() for g in grads())


def test_a_new_engine_resumes_runs_from_their_snapshots(engine, tmp_path):
    engine.create_adapter("run-b", LoraConfig(rank=2, seed=4))
    for _ in range(2):
        engine.forward_backward([job("run-b")])
        engine.optim_step("run-b", AdamConfig(learning_rate=1e-2))
    engine.flush()
    want = engine.forward([job("run-b", (3, 1, 4, 1, 5, 9, 2))])[0]

    restarted = LocalEngine(MODEL, engine.settings)  # as after a crash: nothing in memory
    assert restarted.adapter_info("run-b").step == 2  # restored on first use
    got = restarted.forward([job("run-b", (3, 1, 4, 1, 5, 9, 2))])[0]
    assert got.logprobs[0] == pytest.approx(want.logprobs[0], abs=1e-6)
    missing = restarted.forward([job("never-existed")])[0]
    assert isinstance(missing, Failure) and missing.category == "not_found"


def test_one_bad_job_fails_alone_in_its_batch(engine):
    engine.create_adapter("run-c", LoraConfig(rank=2))
    bad = ForwardJob("run-c", [Example([1, 2, 3], {"target_tokens": [1, 2]})])  # wrong length
    out = engine.forward_backward([job("run-c"), bad, job("run-c")])
    assert not isinstance(out[0], Failure) and not isinstance(out[2], Failure)
    assert isinstance(out[1], Failure) and out[1].category == "validation"
    assert "data[0].loss_fn_inputs['target_tokens']" in out[1].message


def test_offload_frees_memory_and_keeps_pending_grads(engine):
    engine.create_adapter("run-d", LoraConfig(rank=2, seed=2))
    engine.forward_backward([job("run-d")])
    engine.optim_step("run-d", AdamConfig(learning_rate=1e-2))
    engine.forward_backward([job("run-d")])  # pending
    grads = {k: p.grad.clone() for k, p in engine.host.adapter_params("run-d").items()}
    engine.offload("run-d")
    assert not engine.host.has_adapter("run-d")
    assert engine.adapter_info("run-d").step == 1  # back on first use
    for k, p in engine.host.adapter_params("run-d").items():
        assert p.grad is not None and bool((p.grad == grads[k]).all()), k
    # The grads are in memory again, and the file is back at the completed step alone before
    # the restoring call goes on: a crash after the next forward_backward must not restore
    # these grads without that call's, and step on them as if nothing were lost.
    on_disk = snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-d"))
    assert on_disk.step == 1 and not any(k.startswith("grad.") for k in on_disk.tensors)


def test_a_restore_with_grads_rewrites_the_file_before_the_call_goes_on(engine, monkeypatch):
    """As above, with the snapshot writer's thread held: the rewrite is the caller's."""
    import threading

    engine.create_adapter("run-e", LoraConfig(rank=2, seed=2))
    engine.forward_backward([job("run-e")])
    engine.offload("run-e")
    held, write = threading.Event(), snapshot.write

    def writer_held(path, snap):
        if threading.current_thread() is engine.snapshots.thread:
            held.wait(30)
        write(path, snap)

    monkeypatch.setattr(snapshot, "write", writer_held)
    try:
        engine.forward_backward([job("run-e")])  # restores run-e, then adds this call's grads
        on_disk = snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-e"))
        assert not any(k.startswith("grad.") for k in on_disk.tensors)
    finally:
        held.set()


def test_a_damaged_snapshot_fails_its_run_naming_the_file_and_the_way_on(engine, tmp_path):
    engine.create_adapter("run-f", LoraConfig(rank=2, seed=2))
    engine.offload("run-f")
    path = snapshot_path(engine.settings.snapshot_dir, "run-f")
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    [failure] = engine.forward([job("run-f")])
    assert isinstance(failure, Failure) and failure.category == "server"
    assert f"run run-f: its snapshot {path} cannot be read" in failure.message and "load_state" in failure.message
    folder = str(tmp_path / "state")
    engine.create_adapter("run-g", LoraConfig(rank=2, seed=2))
    engine.save_state("run-g", folder)
    engine.load_state("run-f", folder, with_optimizer=True)  # the way on: the run works again
    assert not isinstance(engine.forward([job("run-f")])[0], Failure)


def test_a_batch_keeps_all_its_sampler_weights_loaded_and_deleted_weights_fail(engine, tmp_path):
    import dataclasses

    from trio_engine import SampleRequest, SamplingConfig
    from trio_server.engine import SampleJob

    engine.settings = dataclasses.replace(engine.settings, max_sampler_adapters=1)
    folders = []
    for k in range(3):
        engine.create_adapter(f"run-s{k}", LoraConfig(rank=2, seed=k))
        folders.append(str(tmp_path / f"weights-{k}"))
        engine.save_sampler_weights(f"run-s{k}", folders[-1])
    config = SamplingConfig(max_tokens=3, temperature=0.0)
    outs = engine.sample([SampleJob(f, SampleRequest(None, [1, 5, 9], 1, config)) for f in folders])
    assert not any(isinstance(o, Failure) for o in outs), outs
    assert len(engine.sampler_adapters) == 1  # trimmed after the batch

    import shutil

    shutil.rmtree(folders[2])
    gone = engine.sample([SampleJob(folders[2], SampleRequest(None, [1, 5, 9], 1, config))])[0]
    assert isinstance(gone, Failure) and gone.category == "not_found" and "weights-2" in gone.message


def test_saving_sampler_weights_again_frees_the_old_adapter(engine, tmp_path):
    """Each save over a folder a sampler had loaded must free the host's copy, not only
    forget it: memory would grow with every save."""
    from trio_engine import lora

    def loaded() -> tuple[int, int]:  # adapters the host knows, LoRA weight pairs in its layers
        return len(engine.host.adapters), sum(len(m.lora_A) for _, m in lora.lora_modules(engine.host.model))

    engine.create_adapter("run-r", LoraConfig(rank=2))
    folder = str(tmp_path / "latest")
    counts = []
    for _ in range(3):
        engine.save_sampler_weights("run-r", folder)
        engine.prepare_sampler(folder)
        counts.append(loaded())
    assert counts[0] == counts[1] == counts[2]
    assert counts[0][0] == 2  # the run and one sampler copy


def test_decode_keeps_the_weights_of_live_rows_until_they_finish(engine, tmp_path):
    """Continuous batching: neither the LRU of sampler weights nor a save over a sampler's
    folder frees an adapter that rows still decode on; it goes once they leave."""
    import dataclasses

    from tests.engine.helpers import randomize_adapter
    from trio_engine import SampleRequest, SamplingConfig
    from trio_server.engine import SampleJob

    engine.settings = dataclasses.replace(engine.settings, max_sampler_adapters=1)
    folder, other = str(tmp_path / "shared"), str(tmp_path / "other")
    for k, run in enumerate(("run-d", "run-e")):
        engine.create_adapter(run, LoraConfig(rank=2, seed=k))
        randomize_adapter(engine.host, run, seed=k, scale=0.3)
    engine.save_sampler_weights("run-d", folder)
    engine.save_sampler_weights("run-e", other)
    greedy = SamplingConfig(max_tokens=6, temperature=0.0, ignore_eos=True)
    request = lambda: SampleRequest(None, [1, 5, 9], 1, greedy)  # noqa: E731
    alone = engine.sample([SampleJob(folder, request())])[0].sequences[0].tokens

    update = engine.decode({"long": SampleJob(folder, request())})
    assert update.decoding == ["long"] and not update.finished
    old = engine.sampler_adapters[folder]
    update = engine.decode({"other": SampleJob(other, request())})  # LRU over its limit of 1
    assert old in engine.host.adapters
    engine.save_sampler_weights("run-e", folder)  # new weights where "long" got its own
    assert old in engine.host.adapters and folder not in engine.sampler_adapters
    finished = {}
    while update.decoding:
        update = engine.decode({})
        finished.update(update.finished)
    assert finished["long"].sequences[0].tokens == alone  # decoded to the end on its weights
    assert not isinstance(finished["other"], Failure)
    assert old not in engine.host.adapters  # freed once its rows left
    assert engine.sample([SampleJob(folder, request())])[0].sequences[0].tokens != alone  # the new weights


def test_decode_fails_a_bad_job_alone_and_a_broken_step_fails_the_batch(engine, monkeypatch):
    from trio_engine import SampleRequest, SamplingConfig
    from trio_server.engine import SampleJob

    ok = SampleJob(None, SampleRequest(None, [1, 5, 9], 1, SamplingConfig(max_tokens=4, ignore_eos=True)))
    bad = SampleJob(None, SampleRequest(None, [1, 10**8], 1, SamplingConfig(max_tokens=4)))
    update = engine.decode({"ok": ok, "bad": bad})
    assert set(update.finished) == {"bad"} and update.decoding == ["ok"]
    assert update.finished["bad"].category == "validation" and "prompt" in update.finished["bad"].message

    def broken(batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.host, "decode_step", broken)
    update = engine.decode({})
    assert update.decoding == [] and update.finished["ok"].category == "server"
    monkeypatch.undo()
    update = engine.decode({"again": ok})  # a fresh batch
    assert update.decoding == ["again"]


def test_requests_an_engine_lost_between_steps_fail_instead_of_waiting(engine, tmp_path):
    """A Ray actor that restarted between two decode steps comes back with an empty batch:
    the requests it held must fail (clearly), not wait forever."""
    import pytrio.types as t
    from trio_server.handlers import Context, decode
    from trio_server.scheduler import WorkItem

    ctx = Context(MODEL, engine, store=None, data_dir=tmp_path)  # type: ignore[arg-type]
    request = t.SampleRequest(sampler_id="s", prompt=t.ModelInput.from_ints([1, 5, 9]), num_samples=1,
                              sampling_params=t.SamplingParams(max_tokens=5, ignore_eos=True))
    item = WorkItem("req-1", "sample", request, "user", context={"sampler": {"model_path": None}})
    assert decode(ctx, [item], []) == {}  # admitted, decoding
    engine._decoding = engine.host.decode_batch()  # as after a restart: the batch is gone
    [(result, error)] = decode(ctx, [], ["req-1"]).values()
    assert result is None and error.category == "server" and "restarted" in error.message


def test_a_failed_rewrite_after_a_restore_fails_the_call_and_keeps_the_run_as_on_disk(engine, monkeypatch):
    """The restored grads must not live on in memory beside a file still holding them: a
    crash after the next forward_backward would bring back these without that call's."""
    engine.create_adapter("run-h", LoraConfig(rank=2, seed=2))
    engine.forward_backward([job("run-h")])
    engine.offload("run-h")
    write = snapshot.write

    def disk_full(path, snap):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot, "write", disk_full)
    [failure] = engine.forward_backward([job("run-h")])
    assert isinstance(failure, Failure) and "could not be rewritten" in failure.message and "try the call again" in failure.message
    assert not engine.host.has_adapter("run-h")
    monkeypatch.setattr(snapshot, "write", write)
    assert not isinstance(engine.forward_backward([job("run-h")])[0], Failure)  # the disk back: it goes on
    on_disk = snapshot.read(snapshot_path(engine.settings.snapshot_dir, "run-h"))
    assert not any(k.startswith("grad.") for k in on_disk.tensors)


ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


def test_a_lost_gpu_context_is_acted_on_once_and_out_of_memory_is_not(engine, monkeypatch):
    """After a device-side assert or an illegal access every later CUDA call fails: the process
    must end (Ray restarts it) or say so, while running out of memory is an ordinary failure."""
    from trio_server import engine as engine_module

    lost: list[BaseException] = []
    monkeypatch.setattr(engine_module, "on_device_lost", lost.append)
    engine.create_adapter("run-a", LoraConfig(rank=2))

    def broken(jobs):
        raise RuntimeError(ILLEGAL_ACCESS)

    monkeypatch.setattr(engine.host, "forward_backward", broken)
    (out,) = engine.forward_backward([job("run-a")])
    assert isinstance(out, Failure) and ILLEGAL_ACCESS in out.message
    assert [str(e) for e in lost] == [ILLEGAL_ACCESS]

    def out_of_memory(jobs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine.host, "forward_backward", out_of_memory)
    (out,) = engine.forward_backward([job("run-a")])
    assert isinstance(out, Failure) and len(lost) == 1
    # told by torch's error type, never by text a user can put in an input error, and not
    # for an error every new process meets again (a restart would only loop)
    from trio_engine import InvalidInputError
    from trio_server.engine import device_lost

    assert not device_lost(InvalidInputError(f"data[0].loss_fn_inputs: unknown key {ILLEGAL_ACCESS!r}"))
    assert not device_lost(ValueError(ILLEGAL_ACCESS))
    assert not device_lost(RuntimeError("CUDA error: no kernel image is available for execution on the device"))
    assert device_lost(RuntimeError("CUDA error: device-side assert triggered"))


def test_a_ray_host_whose_gpu_context_is_lost_ends_its_process(monkeypatch):
    """The actor exits (so Ray starts a new one) whether the error reached failure_from inside
    the engine or passed out of the engine's method; other errors travel as they are."""
    from trio_server import ray_engine

    exits: list[int] = []
    monkeypatch.setattr(ray_engine.os, "_exit", exits.append)

    class Broken:
        def optim_step(self, *args):
            raise RuntimeError(ILLEGAL_ACCESS)

        def adapter_info(self, *args):
            raise KeyError("run-x")

    actor = object.__new__(ray_engine.HostActor)
    actor.engine, actor.incarnation = Broken(), "i1"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        actor.call("i1", "optim_step", "run-a", AdamConfig())
    assert exits == [1]
    with pytest.raises(KeyError):
        actor.call("i1", "adapter_info", "run-x")
    assert exits == [1]


class FakeClock:
    """time.monotonic and time.sleep for ray_engine: waits pass at once, and are counted."""

    def __init__(self, monkeypatch):
        from trio_server import ray_engine

        self.now = 0.0
        monkeypatch.setattr(ray_engine.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(ray_engine.time, "sleep", self.advance)

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fake_ray_engine(monkeypatch, answer):
    """A RayEngine whose actor's every call is ``answer(timeout)`` (raise or return)."""
    import ray

    from trio_server import ray_engine

    class Method:
        @staticmethod
        def remote(*args):
            return "ref"

    class Actor:
        call = durable = Method

    engine = object.__new__(ray_engine.RayEngine)
    engine.base_model, engine.actor, engine.incarnation, engine.gave_up = MODEL, Actor(), None, False
    engine.asks = {"GPU": 0, "trio_node_b": 0.001}
    monkeypatch.setattr(ray_engine, "_result", lambda ref, timeout=None: answer(timeout))
    monkeypatch.setattr(ray, "cancel", lambda ref: None)
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 2.0})
    return engine


def test_once_a_ray_host_is_given_up_on_its_models_queued_calls_fail_at_once(monkeypatch):
    """An actor that does not come back (its pinned node lost): each queued call waited the
    whole restart wait anew, so a queue of n calls took n x 120 s to be told."""
    from ray.exceptions import RayActorError

    from trio_server.errors import ServiceError
    from trio_server.ray_engine import RESTART_WAIT_SECONDS

    clock, tries = FakeClock(monkeypatch), []

    def restarting(timeout):
        tries.append(clock.now)
        raise RayActorError()

    engine = fake_ray_engine(monkeypatch, restarting)
    with pytest.raises(ServiceError, match="not coming back"):
        engine.load()
    assert clock.now >= RESTART_WAIT_SECONDS and len(tries) > 100
    tries.clear()
    with pytest.raises(ServiceError, match="not coming back"):
        engine.load()  # the next queued call: one try
    assert len(tries) == 1
    monkeypatch.setattr(engine, "_placed_result", lambda ref: ("i2", {"max_seq_len": 64}))
    assert engine.load() == {"max_seq_len": 64} and not engine.gave_up  # back: the next outage waits again


def test_a_call_on_an_actor_ray_cannot_place_fails_naming_what_it_asks_for(monkeypatch):
    """A pinned node lost before the model's first call (or no GPU free): Ray holds the
    actor and its calls for good, and the model's requests waited forever, queueing every
    later one behind them. A placed actor's long call is waited for."""
    from ray.exceptions import GetTimeoutError

    from trio_server import ray_engine
    from trio_server.errors import ServiceError

    clock, state = FakeClock(monkeypatch), {"now": "PENDING_CREATION", "polls": 0}
    monkeypatch.setattr(ray_engine, "actor_state", lambda actor: state["now"])

    def never_ready(timeout):
        state["polls"] += 1
        clock.advance(timeout)
        raise GetTimeoutError("not yet")

    engine = fake_ray_engine(monkeypatch, never_ready)
    with pytest.raises(ServiceError, match=r"waits for a Ray node that offers what it asks for "
                                           r"\({'GPU': 0, 'trio_node_b': 0.001}\); none has it free"):
        engine.load()
    assert clock.now >= ray_engine.PLACEMENT_WAIT_SECONDS
    state["polls"], before = 0, clock.now
    with pytest.raises(ServiceError, match="waits for a Ray node"):
        engine.load()
    assert state["polls"] == 1 and clock.now == before  # given up on: told at once, no poll waited
    # placed, and busy with a long call: waited for, however long
    engine.gave_up, state["now"], answers = False, "ALIVE", iter([GetTimeoutError("busy")] * 50)

    def busy_then_done(timeout):
        clock.advance(timeout)
        raise_or = next(answers, None)
        if raise_or is not None:
            raise raise_or
        return "i1", {"max_seq_len": 64}

    monkeypatch.setattr(ray_engine, "_result", lambda ref, timeout=None: busy_then_done(timeout))
    assert engine.load() == {"max_seq_len": 64}


def test_a_snapshot_wait_on_a_live_actor_waits_on_and_a_dead_ones_reads_the_disk(monkeypatch, tmp_path):
    """A write slower than DURABLE_WAIT_SECONDS (a storage stall) was read as lost: the
    client was told to redo a step that stood, and the redo made it twice."""
    from ray.exceptions import GetTimeoutError

    from trio_server import ray_engine
    from trio_server.engine import Durability

    state, answers = {"now": "ALIVE"}, iter([GetTimeoutError("slow"), GetTimeoutError("slow"), None])
    monkeypatch.setattr(ray_engine, "actor_state", lambda actor: state["now"])

    def slow_write(timeout):
        if (answer := next(answers)) is not None:
            raise answer

    engine = fake_ray_engine(monkeypatch, slow_write)
    engine.snapshot_dir = str(tmp_path)  # holds no snapshot: read, the step would be lost
    write = Durability("engine-1", "run-a", write=1, step=1)
    engine.durable(write)  # waited on: no SnapshotLost
    state["now"], answers = "DEAD", iter([GetTimeoutError("gone")])
    with pytest.raises(SnapshotLost):
        engine.durable(write)


def test_ray_starts_its_own_local_instance_unless_given_an_address(monkeypatch):
    """Ray's default address joins any cluster this machine registered (a stale one hung
    start-up); TRIO joins what it is told to, else starts its own."""
    import ray

    from trio_server import ray_engine

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append((kw["address"], kw["_node_ip_address"])))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_engine.connect(None)
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    ray_engine.connect(None)
    ray_engine.connect("other:6379")
    assert calls == [("local", "127.0.0.1"), ("head:6379", None), ("other:6379", None)]
