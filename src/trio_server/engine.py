"""The seam between the service and the model hosts: the ``Engine`` protocol.

The service core talks to an engine only through these methods, and only with plain,
picklable dataclasses (trio_engine's ``ForwardJob``, ``SampleRequest``, ``LoraConfig``,
``AdamConfig`` ... and the few below), so an engine can be a thread in this process
(``LocalEngine``, the default) or a Ray actor on another machine (``RayEngine``).
One engine serves one base model.

Runs are named by their run id; checkpoints and snapshots by folders and files under
the data dir, which every engine process must see (one machine, or a shared file
system). Every change of a run a client is told of is in the run's snapshot before the
client is: ``create_adapter`` and ``load_state`` write it before they return;
``optim_step`` copies the run's state and returns, its write runs beside the next calls,
and the service answers the step once ``durable`` says the write is done (see
``SnapshotWriter``). A run whose engine died comes back from its snapshot on its next
request: every answered step is in it, and a step whose write landed just before the
engine died is answered as done too (``written_before_it_died``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trio_engine import (
    AdamConfig,
    AdapterNotFoundError,
    Catalog,
    DecodeBatch,
    ForwardJob,
    ForwardResult,
    InvalidInputError,
    LoraConfig,
    ModelHost,
    ModelNotAvailableError,
    SampleRequest,
    SampleResult,
)

if TYPE_CHECKING:
    from trio_engine.snapshot import Snapshot

log = logging.getLogger("trio.engine")


@dataclass(frozen=True)
class EngineSettings:
    """How to build an engine; the same for every base model of one service."""

    snapshot_dir: str  # <data-dir>/snapshots: one file per run
    dtype: str | None = None  # None: fp32 on CPU, bf16 on CUDA (or $TRIO_DTYPE)
    device: str | None = None  # auto | cpu | cuda | cuda:N (None: $TRIO_DEVICE or auto)
    catalog: Catalog = field(default_factory=Catalog)
    max_sampler_adapters: int = 16  # LRU of loaded sampler weights
    snapshots: bool = True  # off only to measure what they cost (benchmarks/snapshot.py)


@dataclass(frozen=True)
class Durability:
    """One snapshot write asked for: ``Engine.durable`` returns once it is on disk."""

    engine: str  # the engine instance that writes it (one restarted since never will)
    run_id: str
    write: int  # the run's writes asked for, up to and including this one
    step: int  # the run's step it keeps


def written_before_it_died(snapshot_dir: str, write: Durability) -> None:
    """For a write whose engine died: return if it landed first (the run's snapshot holds
    its step), else raise ``SnapshotLost``. No later step of the run can have been written
    since: the run's next call waits for this one's answer."""
    from trio_engine import snapshot

    on_disk = snapshot.step_of(snapshot_path(snapshot_dir, write.run_id))
    if on_disk is None or on_disk < write.step:
        raise SnapshotLost(f"run {write.run_id}: its engine died before step {write.step} reached its snapshot "
                           f"(which holds step {on_disk})")


class SnapshotFault(RuntimeError):
    """A run's snapshot file is damaged, or could not be rewritten after a restore: the run
    cannot come back into memory (the message says which, and what to do)."""


class SnapshotLost(RuntimeError):
    """The engine that was to write a change died first: the change is gone."""


@dataclass
class Failure:
    """One item of a batch that failed; the others in the batch are unaffected."""

    category: str  # validation | not_found | server
    message: str


@dataclass
class SampleJob:
    """A sampling request on a sampler's weights: None (the base model) or a checkpoint folder."""

    weights: str | None
    request: SampleRequest  # its adapter_id is set by the engine


@dataclass
class DecodeUpdate:
    """What one ``Engine.decode`` call did."""

    finished: dict[str, SampleResult | Failure]  # ticket -> outcome, of requests that left the batch
    decoding: list[str]  # tickets still in the running batch


@dataclass
class AdapterInfo:
    config: LoraConfig
    step: int


class WeightsNotFoundError(FileNotFoundError):
    """A sampler's checkpoint folder is gone (deleted after the sampler was made)."""


# CUDA errors after which a process's device context is unusable: every later call fails alike
STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                      "uncorrectable ECC", "misaligned address", "illegal instruction", "hardware stack error",
                      "launch timed out", "invalid program counter", "unknown error")


def device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error after which this process's device context is
    unusable (a device-side assert, an illegal memory access, a faulty GPU). Told by the
    exception's type, torch's own CUDA errors, never by text alone (the engine's input
    errors quote users' input); and by the error: running out of memory is not one, nor
    one any new process would meet again (no kernel image for this GPU), which a restart
    would only repeat."""
    accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8
    if not (isinstance(exc, accelerator_error) or (type(exc) is RuntimeError and str(exc).startswith("CUDA error: "))):
        return False
    return any(sticky in str(exc) for sticky in STICKY_CUDA_ERRORS)


def _report_device_lost(exc: BaseException) -> None:
    log.critical("the GPU's context is lost (%s: %s): every later call on its model fails; restart the "
                 "service (its runs come back from their snapshots)", type(exc).__name__, exc)


# What this process does when its device context is lost (``device_lost``): in a Ray actor,
# exit so that Ray starts a new one (``ray_engine.HostActor``); in-process, say so loudly.
on_device_lost: Callable[[BaseException], None] = _report_device_lost


def failure_from(exc: BaseException) -> Failure:
    """The one mapping from engine exceptions to what a client is told."""
    if device_lost(exc):
        on_device_lost(exc)
    if isinstance(exc, WeightsNotFoundError):
        return Failure("not_found", str(exc))
    if isinstance(exc, AdapterNotFoundError):
        return Failure("not_found", "the run's weights are not loaded on this server and it has no "
                       "snapshot to resume from; create a client from a saved checkpoint")
    # Only the engine's own input errors are the caller's fault. Any other exception, a
    # ValueError from deep inside torch or numpy included, is ours: a 500, logged.
    if isinstance(exc, InvalidInputError | ModelNotAvailableError | FileNotFoundError):
        return Failure("validation", str(exc))
    if isinstance(exc, SnapshotFault):
        return Failure("server", str(exc))
    return Failure("server", f"{type(exc).__name__}: {exc}")


class Engine(Protocol):
    """One base model's host, wherever it runs. Every method may block: one caller at a time
    (the base model's worker thread), except ``tokenizer_files`` and ``durable``.

    A method given a run id that is not in memory (offloaded, or lost with a crashed
    process) first restores the run from its snapshot; with none, it raises
    ``AdapterNotFoundError``. A sampler's weights are named by their checkpoint folder.
    """

    def load(self) -> dict[str, Any]:
        """Load the model if not yet loaded; return model info. Raises if it cannot load."""
        ...

    def tokenizer_files(self) -> dict[str, bytes]: ...

    def create_adapter(self, run_id: str, config: LoraConfig) -> None: ...

    def forward(self, jobs: list[ForwardJob]) -> list[ForwardResult | Failure]: ...

    def forward_backward(self, jobs: list[ForwardJob]) -> list[ForwardResult | Failure]: ...

    def hold_grads(self, key: str, run_id: str) -> None:
        """Keep a copy of the run's grads, in the engine, under ``key`` (a request run as
        several passes holds them from before its first part until it ends)."""
        ...

    def release_grads(self, key: str, run_id: str, restore: bool) -> bool:
        """Free the grads held under ``key``; with ``restore``, first make them the run's
        grads again (a part failed: the request adds nothing). False: nothing was held
        under ``key`` (the host restarted since ``hold_grads``, or that failed); without
        ``restore`` the run's grads, the later parts' alone, are then dropped."""
        ...

    def drop_grads(self, run_id: str) -> None:
        """Forget the run's accumulated gradients (those of a batch a restart cut short)."""
        ...

    def optim_step(self, run_id: str, config: AdamConfig) -> tuple[dict[str, float], Durability | None]:
        """Step the run: its metrics, and the snapshot write that keeps the step (None when
        snapshots are off). The write runs on after the call: answer once ``durable``."""
        ...

    def durable(self, write: Durability) -> None:
        """Return once ``write`` is on disk. Called from another thread than the others
        (``worker.Answers``), beside them. Raises ``SnapshotLost`` if the engine died first."""
        ...

    def adapter_info(self, run_id: str) -> AdapterInfo: ...

    def save_state(self, run_id: str, folder: str) -> None: ...

    def load_state(self, run_id: str, folder: str, with_optimizer: bool) -> LoraConfig: ...

    def save_sampler_weights(self, run_id: str, folder: str) -> None: ...

    def prepare_sampler(self, weights: str | None) -> None:
        """Load a sampler's weights now, so a bad checkpoint fails at creation."""
        ...

    def sample(self, jobs: list[SampleJob]) -> list[SampleResult | Failure]: ...

    def decode(self, admit: dict[str, SampleJob], max_steps: int = 1) -> DecodeUpdate:
        """Continuous batching: add ``admit`` (ticket -> job) to the engine's running decode
        batch, then run up to ``max_steps`` decode steps, stopping after a step that
        finishes a request. An invalid job fails alone, in ``finished`` at once. A step
        that raises fails every request then in the batch, and the batch starts empty.
        The batch lives in the engine: it is lost if the engine's process dies."""
        ...

    def compute_logprobs(self, weights: str | None, tokens: list[int]) -> list[float | None]: ...

    def offload(self, run_id: str) -> None:
        """Write the run (with pending gradients) to its snapshot and free its memory."""
        ...

    def flush(self) -> None:
        """Wait until every snapshot asked for so far is on disk."""
        ...

    def watch_restarts(self, notify: Callable[[], None]) -> None:
        """Have ``notify`` called, in the worker's thread, when a call finds the host
        restarted since the last one (a Ray actor), before that call runs: the runs it held
        in memory lost their gradients (an offloaded run's are in its snapshot). An engine
        in the service's own process never restarts alone (start-up recovery covers it)."""
        ...

    def close(self) -> None: ...


def snapshot_path(snapshot_dir: str | Path, run_id: str) -> Path:
    return Path(snapshot_dir) / f"{run_id}.safetensors"


MAX_WAITING_COPIES = 2  # runs' state copies waiting for the snapshot writer (see SnapshotWriter)
# A background snapshot write that fails is tried again after each of these pauses (a
# disk full for a moment, a network volume's hiccup) while the step's answer waits.
WRITE_RETRY_PAUSES = (0.5, 2.0, 8.0)


class SnapshotWriter:
    """Writes run snapshots: atomically, at most one write per run under way at a time.

    Two ways in, by what the caller needs (and ``write_now``, for ``offload``):

    - ``commit(run)`` writes the run's state in the caller's thread and returns once it is
      on disk: a new run, a loaded state, a restored one's file back at its completed step
      (rare; their answers follow at once).
    - ``submit(run)`` copies the run's state now, under the host's lock (so the next step
      cannot change it mid-write), and writes the copy on the writer's thread; ``wait(run)``
      returns once everything submitted for the run so far is on disk. ``optim_step`` uses
      the pair: the step's answer waits in ``wait`` (``worker.Answers``) while the base
      model's worker runs other users' work instead of waiting for the disk.

    Requests for a run whose write has not started yet coalesce into one write of the
    newest state. At most ``MAX_WAITING_COPIES`` copies wait for the writer (each is the
    size of the run's snapshot): past that, ``submit`` waits for a write to start, so
    steps made faster than the disk takes them cannot fill the host's memory.

    A failed background write is tried again after each of ``WRITE_RETRY_PAUSES`` (10.5 s
    in all; the step's answer, and the writes queued behind it, wait). One that still
    fails is logged, not raised: the change is made and answered (failing it would invite
    a retry that steps twice), the run's next write tries again, and a crash before then
    returns the run to its last snapshot. ``commit`` and ``write_now`` try once: they
    run in the base model's worker, and their callers handle a failure.
    """

    def __init__(self, host: ModelHost, folder: str, enabled: bool = True):
        self.host, self.folder, self.enabled = host, folder, enabled
        self.pending: OrderedDict[str, Snapshot | None] = OrderedDict()  # run -> its copy (None: copy when written)
        self.writing: set[str] = set()
        self.asked: Counter[str] = Counter()  # run -> writes asked for so far
        self.written: Counter[str] = Counter()  # run -> of those, how many its finished writes cover
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="trio-snapshots", daemon=True)
        self.thread.start()

    def submit(self, run_id: str) -> int | None:
        """The number of the write asked for (None: snapshots are off). If the copy fails
        (memory), the writer copies the run when it gets to it: the step stands either way."""
        from trio_engine import snapshot

        if not self.enabled:
            return None
        try:
            copy = snapshot.capture(self.host, run_id)
        except Exception:
            log.exception("copying run %s for its snapshot failed; the writer copies it when it gets to it", run_id)
            copy = None
        return self._ask(run_id, copy)

    def wait(self, run_id: str, write: int) -> None:
        """Return once the run's ``write``-th write, or a later one, has finished."""
        with self.cond:
            self.cond.wait_for(lambda: self.written[run_id] >= write)

    def commit(self, run_id: str) -> None:
        if not self.enabled:
            return
        try:
            self.write_now(run_id)
        except Exception:
            _log_failed_write(run_id)

    def write_now(self, run_id: str, with_grads: bool = False) -> None:
        """Write the run's current state in this thread, in place of any pending write of
        it; raises if the write fails (``offload`` must not then free the run)."""
        with self.cond:
            self.pending.pop(run_id, None)
            self.asked[run_id] += 1
            covers = self.asked[run_id]
            self.cond.wait_for(lambda: run_id not in self.writing)
            self.writing.add(run_id)
        try:
            self._write(run_id, None, with_grads)
        finally:
            self._release(run_id, covers)

    def flush(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.pending and not self.writing)

    def _ask(self, run_id: str, copy: Snapshot | None) -> int:
        with self.cond:
            if copy is not None and self.pending.get(run_id) is None:  # one more copy to hold
                self.cond.wait_for(lambda: sum(c is not None for c in self.pending.values()) < MAX_WAITING_COPIES)
            self.asked[run_id] += 1
            self.pending[run_id] = copy  # a run already waiting keeps its place: none starves
            self.cond.notify_all()
            return self.asked[run_id]

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: any(r not in self.writing for r in self.pending))
                run_id = next(r for r in self.pending if r not in self.writing)
                copy = self.pending.pop(run_id)
                self.writing.add(run_id)
                covers = self.asked[run_id]
            try:
                self._write_retrying(run_id, copy)
            except Exception:  # a failed snapshot must not stop later ones
                _log_failed_write(run_id)
            finally:
                self._release(run_id, covers)

    def _write_retrying(self, run_id: str, copy: Snapshot | None) -> None:
        for pause in WRITE_RETRY_PAUSES:
            try:
                return self._write(run_id, copy, False)
            except Exception as exc:
                log.warning("snapshot of run %s failed (%s); trying again in %g s", run_id, exc, pause)
                time.sleep(pause)
        self._write(run_id, copy, False)

    def _write(self, run_id: str, copy: Snapshot | None, with_grads: bool) -> None:
        from trio_engine import snapshot

        if copy is None and self.host.has_adapter(run_id):  # else deleted meanwhile
            copy = snapshot.capture(self.host, run_id, with_grads)
        if copy is not None:
            snapshot.write(snapshot_path(self.folder, run_id), copy)

    def _release(self, run_id: str, covers: int) -> None:
        with self.cond:
            self.writing.discard(run_id)
            self.written[run_id] = max(self.written[run_id], covers)
            self.cond.notify_all()


def _log_failed_write(run_id: str) -> None:
    log.exception("snapshot of run %s failed; a crash now would take it back to its last snapshot", run_id)


class LocalEngine:
    """A ModelHost in this process (loaded on first use), behind the Engine protocol.

    Only the worker thread calls it (and ``tokenizer_files`` and ``load``, which only read,
    from a request thread, and ``durable``, which only waits); the snapshot writer is its
    own thread and takes the host's lock to read a run.
    """

    def __init__(self, base_model: str, settings: EngineSettings, labels: dict[str, str] | None = None):
        self.base_model = base_model
        self.settings = settings
        self.labels = labels or {}  # reported by load(), e.g. the Ray node an actor runs on
        self._host: ModelHost | None = None
        self._snapshots: SnapshotWriter | None = None
        self._load_lock = threading.Lock()
        self.sampler_adapters: OrderedDict[str, str] = OrderedDict()  # weights folder -> adapter id
        self._decoding: DecodeBatch | None = None  # the running batch of ``decode``
        self._retired: set[str] = set()  # sampler adapters replaced while live rows used them
        self.instance = secrets.token_hex(8)  # names this engine in its ``Durability`` tickets

    @property
    def host(self) -> ModelHost:
        with self._load_lock:
            if self._host is None:
                from trio_engine import ModelHost

                self._host = ModelHost(self.base_model, dtype=self.settings.dtype, catalog=self.settings.catalog,
                                       device=self.settings.device)
                self._snapshots = SnapshotWriter(self._host, self.settings.snapshot_dir, self.settings.snapshots)
            return self._host

    @property
    def snapshots(self) -> SnapshotWriter:
        self.host  # noqa: B018  (loads the model and starts the writer)
        assert self._snapshots is not None
        return self._snapshots

    def load(self) -> dict[str, Any]:
        info = self.host.info()
        return info | {"pid": os.getpid(), "node": socket.gethostname()} | self.labels

    def tokenizer_files(self) -> dict[str, bytes]:
        return self.host.tokenizer_files()

    # -- runs ---------------------------------------------------------------------------

    def _resident(self, *run_ids: str | None) -> ModelHost:
        """The host, with these runs in memory: restored from their snapshots if need be."""
        from trio_engine import snapshot

        host = self.host
        for run_id in dict.fromkeys(run_ids):
            if run_id is None or host.has_adapter(run_id):
                continue
            path = snapshot_path(self.settings.snapshot_dir, run_id)
            if path.exists():
                try:
                    snap = snapshot.read(path)
                    snapshot.restore(host, run_id, snap)
                except Exception as exc:  # named, where a bare SafetensorError said nothing of what or why
                    raise SnapshotFault(
                        f"run {run_id}: its snapshot {path} cannot be read ({type(exc).__name__}: {exc}); go on "
                        "from a checkpoint: load_state into this run, or a new client from it") from exc
                log.info("run %s restored from its snapshot at step %d", run_id, snap.step)
                if any(k.startswith("grad.") for k in snap.tensors):
                    self._drop_grads_from_snapshot(run_id)
        return host

    def _drop_grads_from_snapshot(self, run_id: str) -> None:
        """A restored run's pending grads live in memory now. Its file goes back to the
        completed step alone, before the call goes on: rewritten in the background, a crash
        after the next forward_backward could restore these grads without that call's, and
        the next optim_step would step on them as if nothing were lost. If the rewrite
        fails, the run leaves memory again (the file still holds all of it) and the call
        fails: the next one restores it and tries again."""
        if not self.snapshots.enabled:
            return
        try:
            self.snapshots.write_now(run_id)
        except Exception as exc:
            self.host.delete_adapter(run_id)
            raise SnapshotFault(f"run {run_id}: its snapshot could not be rewritten after its restore "
                                f"({type(exc).__name__}: {exc}); nothing changed, try the call again") from exc

    def create_adapter(self, run_id: str, config: LoraConfig) -> None:
        self.host.create_adapter(run_id, config)
        self.snapshots.commit(run_id)

    def forward(self, jobs: list[ForwardJob]) -> list[ForwardResult | Failure]:
        return self._forward(jobs, backward=False)

    def forward_backward(self, jobs: list[ForwardJob]) -> list[ForwardResult | Failure]:
        return self._forward(jobs, backward=True)

    def _forward(self, jobs: list[ForwardJob], backward: bool) -> list[ForwardResult | Failure]:
        host = self.host
        results: dict[int, ForwardResult | Failure] = {}
        valid = {}
        for k, job in enumerate(jobs):  # each job alone: one bad datum fails only its own request
            try:
                self._resident(job.adapter_id)
                host.validate_job(job)
                valid[k] = job
            except Exception as exc:
                results[k] = failure_from(exc)
        if valid:
            run = host.forward_backward if backward else host.forward
            try:
                outs: list[ForwardResult | Failure] = [
                    failure_from(o) if isinstance(o, Exception) else o for o in run(list(valid.values()))]
            except Exception as exc:
                log.exception("forward%s failed", "_backward" if backward else "")
                outs = [failure_from(exc)] * len(valid)
            results.update(zip(valid, outs))
        return [results[k] for k in range(len(jobs))]

    def hold_grads(self, key: str, run_id: str) -> None:
        self._resident(run_id).hold_grads(key, run_id)

    def release_grads(self, key: str, run_id: str, restore: bool) -> bool:
        host = self._resident(run_id) if restore and key in self.host.held_grads else self.host
        held = host.release_grads(key, restore)
        if not held and not restore and host.has_adapter(run_id):  # all parts ran, but the host
            host.zero_grad(run_id)  # restarted since hold_grads: the later parts' sums alone
        return held

    def drop_grads(self, run_id: str) -> None:
        self._resident(run_id).zero_grad(run_id)

    def optim_step(self, run_id: str, config: AdamConfig) -> tuple[dict[str, float], Durability | None]:
        metrics = self._resident(run_id).optim_step(run_id, config)
        write = self.snapshots.submit(run_id)
        return metrics, None if write is None else Durability(self.instance, run_id, write, int(metrics["step"]))

    def durable(self, write: Durability) -> None:
        if write.engine != self.instance or self._snapshots is None:  # asked of an engine since restarted
            written_before_it_died(self.settings.snapshot_dir, write)
        else:
            self._snapshots.wait(write.run_id, write.write)

    def adapter_info(self, run_id: str) -> AdapterInfo:
        config, step = self._resident(run_id).adapter_config(run_id)
        return AdapterInfo(config, step)

    # -- checkpoints --------------------------------------------------------------------

    def save_state(self, run_id: str, folder: str) -> None:
        self._resident(run_id).save_state(run_id, folder)
        self._forget_sampler(folder)

    def load_state(self, run_id: str, folder: str, with_optimizer: bool) -> LoraConfig:
        host = self.host
        host.load_state(run_id, folder, with_optimizer)
        self.snapshots.commit(run_id)
        return host.adapter_config(run_id)[0]

    def save_sampler_weights(self, run_id: str, folder: str) -> None:
        self._resident(run_id).save_sampler_weights(run_id, folder)
        self._forget_sampler(folder)

    def offload(self, run_id: str) -> None:
        if self._host is None or not self._host.has_adapter(run_id):
            return
        self.snapshots.write_now(run_id, with_grads=True)
        self._host.delete_adapter(run_id)

    def flush(self) -> None:
        if self._snapshots is not None:
            self._snapshots.flush()

    # -- sampling -----------------------------------------------------------------------

    def prepare_sampler(self, weights: str | None) -> None:
        self._sampler_adapter(weights)
        self._trim_samplers()

    def sample(self, jobs: list[SampleJob]) -> list[SampleResult | Failure]:
        host = self.host
        results: dict[int, SampleResult | Failure] = {}
        valid = self._valid_samples(dict(enumerate(jobs)), results)
        if valid:
            try:
                outs: list[SampleResult | Failure] = list(host.sample(list(valid.values())))
            except Exception as exc:
                log.exception("sample failed")
                outs = [failure_from(exc)] * len(valid)
            results.update(zip(valid, outs))
        self._trim_samplers()  # after the batch: its own adapters stay loaded while it runs
        return [results[k] for k in range(len(jobs))]

    def _valid_samples(self, jobs: dict[Any, SampleJob], failed: dict[Any, Any]) -> dict[Any, SampleRequest]:
        """The jobs' requests on their sampler adapters, each validated alone; failures go to ``failed``."""
        valid = {}
        for key, job in jobs.items():
            try:
                job.request.adapter_id = self._sampler_adapter(job.weights)
                self.host.validate_sample(job.request)
                valid[key] = job.request
            except Exception as exc:
                failure = failure_from(exc)
                failure.message = failure.message.removeprefix("requests[0].")
                failed[key] = failure
        return valid

    def decode(self, admit: dict[str, SampleJob], max_steps: int = 1) -> DecodeUpdate:
        host = self.host
        if self._decoding is None:
            self._decoding = host.decode_batch()
        batch = self._decoding
        finished: dict[str, SampleResult | Failure] = {}
        valid = self._valid_samples(admit, finished)
        if valid:
            try:  # a failed prefill leaves the running batch as it was
                host.admit(batch, list(valid.values()), list(valid))
            except Exception as exc:
                log.exception("prefill failed")
                finished.update(dict.fromkeys(valid, failure_from(exc)))
        for _ in range(max_steps):
            if not len(batch):
                break
            try:
                done = host.decode_step(batch)
            except Exception as exc:
                log.exception("decode step failed; failing the requests of its batch")
                finished.update(dict.fromkeys(map(str, batch.tickets), failure_from(exc)))
                self._decoding = batch = host.decode_batch()
                break
            finished.update((str(ticket), result) for ticket, result in done)
            if done:
                break
        self._trim_samplers()
        self._free_retired()
        return DecodeUpdate(finished, [str(t) for t in batch.tickets])

    def _in_use(self) -> set[str | None]:
        """Adapters of the running decode batch's live rows: not to be deleted under them."""
        return self._decoding.adapters if self._decoding is not None else set()

    def _free_retired(self) -> None:
        for adapter_id in self._retired - self._in_use():  # type: ignore[operator]
            self._retired.discard(adapter_id)
            self.host.delete_adapter(adapter_id)

    def compute_logprobs(self, weights: str | None, tokens: list[int]) -> list[float | None]:
        logprobs = self.host.compute_logprobs(self._sampler_adapter(weights), tokens)
        self._trim_samplers()
        return logprobs

    def _sampler_adapter(self, weights: str | None) -> str | None:
        """The host adapter serving some sampler weights: None for the base model."""
        if weights is None:
            return None
        folder = Path(weights)
        if not folder.exists():  # deleted since the sampler was made
            self._forget_sampler(weights)
            why = (" (unnamed sampler weights, as save_weights_and_get_sampling_client saves: a run keeps its "
                   "newest few; name them to keep them)" if folder.parent.name == "ephemeral" else "")
            raise WeightsNotFoundError(f"model_path: the checkpoint {folder.name!r} no longer exists{why}")
        cache = self.sampler_adapters
        if weights in cache:
            cache.move_to_end(weights)
            return cache[weights]
        host = self.host
        adapter_id = "sampler-" + secrets.token_hex(6)
        if (folder / "adapter_config.json").exists():
            host.load_sampler_weights(adapter_id, str(folder))
        else:
            host.load_state(adapter_id, str(folder), with_optimizer=False)
        cache[weights] = adapter_id
        return adapter_id

    def _trim_samplers(self) -> None:
        """Keep at most ``max_sampler_adapters`` loaded, least recently used out first; the
        running decode batch's adapters stay (the limit may be exceeded while they decode)."""
        in_use = self._in_use()
        while len(self.sampler_adapters) > self.settings.max_sampler_adapters:
            folder = next((f for f, a in self.sampler_adapters.items() if a not in in_use), None)
            if folder is None:
                return
            self.host.delete_adapter(self.sampler_adapters.pop(folder))

    def _forget_sampler(self, folder: str) -> None:
        """Weights in ``folder`` were replaced or deleted: a sampler on them reloads. Rows
        decoding on the old weights finish on them; the old adapter goes once they leave."""
        adapter_id = self.sampler_adapters.pop(str(folder), None)
        if adapter_id is None:
            return
        if adapter_id in self._in_use():
            self._retired.add(adapter_id)
        else:
            self.host.delete_adapter(adapter_id)

    def watch_restarts(self, notify: Callable[[], None]) -> None:
        pass  # it dies with the service

    def close(self) -> None:
        self.flush()
