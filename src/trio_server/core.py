"""The service core: sessions of work for many users over shared model hosts. No HTTP.

``submit`` validates a request and queues it, answering a request id at once;
``retrieve`` waits (up to a timeout) for its result. One ``HostWorker`` thread per base
model runs the loop  schedule -> execute -> resolve  (scheduler.next_batch decides).
Results are serialized once, stored, and returned as stored. Waiters are woken through
in-process futures, never by polling the database.

Both transports use this same object: the SDK's local transport in-process (the
embedded default) and the FastAPI app behind ``trio serve``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import pydantic
import sqlalchemy as sa

from pytrio import types as t
from pytrio.errors import describe_validation_error

from . import checkpoints as ckpt
from .engine import Engine, EngineSettings, LocalEngine, snapshot_path
from .errors import (
    RESTART_MESSAGE,
    DataDirInUse,
    ServiceError,
    check_quota,
    not_found,
    over_capacity,
)
from .handlers import (
    Context,
    check_checkpoint_bytes,
    expired,
    remove_checkpoint,
    remove_expired_checkpoints,
    set_expiry,
)
from .queueing import QueueInfo, describe
from .scheduler import WorkItem
from .store import Store, dumps, later, now
from .store import checkpoints as checkpoints_table
from .store import requests as requests_table
from .store import runs as runs_table
from .store import samplers as samplers_table
from .usage import COUNTED_OPS, check_budget, tokens_of, usage_response
from .worker import HostWorker, Sequencing

log = logging.getLogger("trio.server")

KEEP_FINISHED_SECONDS = 600.0
KEEP_FINISHED_MAX = 10_000

M = TypeVar("M", bound=pydantic.BaseModel)


@dataclass(frozen=True)
class Limits:
    """Per-request limits and per-user quotas, reported by get_server_capabilities.

    Quotas (None: none) are checked when a request is submitted, before anything changes:
    ``max_runs_per_user`` counts a user's runs plus their queued create requests;
    ``max_checkpoint_bytes_per_user`` refuses a named save once the user's checkpoints
    (ephemeral sampler weights included) already hold that many bytes. A checkpoint's size
    is known only once written, so the last save allowed may overshoot by its own size.
    Ephemeral saves are not refused: they are bounded by ``ephemeral_samplers_per_run``.

    Queue bounds (None: none): ``max_pending_per_user`` and ``max_pending_total`` count
    requests accepted and not yet finished (queued or running). A submit past either is
    refused with 429 and ``Retry-After: retry_after_seconds`` before anything changes, so
    what was accepted is never dropped to make room. ``max_batch_tokens`` is the
    scheduler's token budget per batch (see ``scheduler.py``); a forward or
    forward_backward request over ``max_pass_tokens`` runs as several passes of at most
    that many tokens while several users share the host, so no user waits long for
    another's pass (see ``splitting.py``; None: never split); a user alone gets passes of
    up to ``max_batch_tokens`` unless ``slice_alone``. ``max_resident_runs`` bounds the training runs each base model's
    host keeps in memory: past it, the least recently used without a queued request is
    written to its snapshot and freed between batches (see ``worker.py``).
    """

    max_tokens_per_request: int = 131_072
    max_seq_len: int = 8192
    max_batch_size: int = 1024
    max_lora_rank: int = 256
    max_samples_per_request: int = 256
    max_sampler_adapters: int = 16  # LRU of loaded sampler weights per host
    max_resident_runs: int | None = 64  # training runs in memory per host; the least recently used go to disk
    seq_gap_seconds: float = 30.0  # how long a run's later requests wait for a missing one
    ephemeral_samplers_per_run: int = 8  # unnamed sampler weights a run keeps (older ones are removed)
    max_runs_per_user: int | None = None
    max_checkpoint_bytes_per_user: int | None = None
    max_pending_per_user: int | None = 256
    max_pending_total: int | None = 4096
    retry_after_seconds: float = 1.0
    max_batch_tokens: int = 8192
    max_pass_tokens: int | None = 64  # benchmarks/fairness.py: 64 meets its target on a 2-core CPU, 128 did not
    slice_alone: bool = False  # max_pass_tokens also for a user alone on the host (worker.HostWorker.pass_tokens)

    def __post_init__(self) -> None:
        if self.max_resident_runs is not None and self.max_resident_runs < 1:  # 0 would offload every run each batch
            raise ValueError(f"max_resident_runs: must be at least 1 (or None: no limit), got {self.max_resident_runs}")


@dataclass
class Outcome:
    """A request's state as stored: status, serialized result or error."""

    status: str  # done | failed | pending
    result_json: str | None = None
    error: t.ErrorInfo | None = None
    queue_state: str | None = None
    queue_position: int | None = None
    starts_in_seconds: float | None = None
    others_ahead: int | None = None

    @classmethod
    def pending(cls, info: QueueInfo | None) -> Outcome:
        """Not finished: running, or queued at a position (None: taken, finishing)."""
        if info is None:
            return cls("pending", queue_state="running")
        starts_in = None if info.starts_in is None else round(info.starts_in, 1)
        return cls("pending", queue_state=describe(info), queue_position=info.position, starts_in_seconds=starts_in,
                   others_ahead=info.others_ahead)

    def to_json(self, request_id: str) -> str:
        """The FutureResponse body, splicing in the result exactly as it was stored."""
        head: dict[str, Any] = {"request_id": request_id, "status": self.status, "queue_state": self.queue_state,
                "error": self.error.model_dump() if self.error else None}
        if self.status == "pending":
            head.update(queue_position=self.queue_position, starts_in_seconds=self.starts_in_seconds,
                        others_ahead=self.others_ahead)
        body = dumps(head)
        return body[:-1] + ',"result":' + (self.result_json or "null") + "}"

    def response(self, request_id: str) -> t.FutureResponse:
        return t.FutureResponse.model_validate_json(self.to_json(request_id))


class ServiceCore:
    def __init__(
        self,
        data_dir: str | Path,
        db_url: str | None = None,
        catalog: Any = None,
        dtype: str | None = None,
        limits: Limits = Limits(),
        idle_offload_seconds: float = 600.0,
        engine: str = "local",
        device: str | None = None,
        ray_address: str | None = None,
        ray_placement: dict[str, str] | None = None,
        ray_gpus_per_model: float = 1.0,
        share_data_dir: bool = False,
    ):
        """Args:
            data_dir: database (SQLite by default), checkpoints, run snapshots.
            db_url: a SQLAlchemy URL instead of SQLite in the data dir.
            catalog: model names -> sources (default ``trio_engine.Catalog()``).
            dtype, device: of every model host (None: see ``trio_engine.ModelHost``).
            engine: ``local`` (a thread per base model in this process) or ``ray``
                (a Ray actor per base model; see ``ray_engine.py``).
            ray_address: join this Ray cluster (None: start a local Ray instance).
            ray_placement: base model -> a Ray custom resource its actor needs.
            ray_gpus_per_model: the share of a GPU each model's actor asks Ray for, on a
                cluster with GPUs: 0.25 puts four small models on one GPU.
            share_data_dir: if other services use the data dir, work beside them without
                the start-up recovery (which would fail their requests and delete their
                sampler weights) instead of raising ``DataDirInUse`` (see
                ``lock_data_dir``). For the embedded service: a ``trio checkpoints list``,
                or a second script, while a script trains.
        """
        from trio_engine import Catalog

        self.data_dir = Path(data_dir).absolute()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.catalog = catalog or Catalog()
        self.limits = limits
        self.idle_offload_seconds = idle_offload_seconds
        self.engine_settings = EngineSettings(
            snapshot_dir=str(self.data_dir / "snapshots"), dtype=dtype, device=device, catalog=self.catalog,
            max_sampler_adapters=limits.max_sampler_adapters,
        )
        self.engine_kind = engine
        self.ray_address = ray_address
        self.ray_placement = ray_placement or {}
        if not (0 < ray_gpus_per_model <= 1 or (ray_gpus_per_model > 1 and float(ray_gpus_per_model).is_integer())):
            raise ValueError(f"ray_gpus_per_model: a fraction of one GPU or a whole number of GPUs, "
                             f"got {ray_gpus_per_model!r}")
        self.ray_gpus_per_model = ray_gpus_per_model
        self.gpu_shares: dict[str, float] = {}  # base model -> the share of a GPU its Ray actor holds
        if engine not in ("local", "ray"):
            raise ValueError(f"engine: must be 'local' or 'ray', got {engine!r}")
        if engine == "local":  # a device this machine lacks fails now, not at the first request
            from trio_engine.device import resolve_device

            resolve_device(device)
        if engine == "ray":  # join (or start) Ray now: a bad address or placement fails at start-up
            from .ray_engine import check_cluster, connect

            connect(ray_address)
            check_cluster(device, self.ray_placement)
        self.lock = threading.RLock()
        self.workers: dict[str, HostWorker] = {}
        self.contexts: dict[str, int] = {}  # base model -> context_length
        self.futures: dict[str, concurrent.futures.Future[Outcome]] = {}
        self.owners: dict[str, str] = {}  # request_id -> user_id, for in-memory futures
        self.idempotency: dict[tuple[str, str], str] = {}
        self.next_seq: dict[str, int] = {}
        # run id -> forward_backward calls whose gradients the last crash lost (``_recover``)
        self.lost_calls: Counter[str] = Counter()
        self.calls_since_step: Counter[str] = Counter()  # run id -> calls since its last step, at start-up
        self.finished: deque[tuple[float, str, str | None]] = deque()  # (when, request id, idempotency key)
        self.arrivals = itertools.count()
        self.pending_by_user: Counter[str] = Counter()  # accepted, unfinished requests (queue bounds)
        # their request ids -> the (run, seq) each holds in its run's order (None: none)
        self.unfinished: dict[str, tuple[str, int] | None] = {}
        # False: other services use the data dir (``share_data_dir``), so no start-up recovery
        self._data_dir_lock, self.owns_data_dir = lock_data_dir(self.data_dir, share_data_dir)
        try:
            self.store = Store(db_url or f"sqlite:///{self.data_dir / 'trio.db'}")
            if self.owns_data_dir:
                if holder := self.store.claim(f"trio pid {os.getpid()} on {socket.gethostname()}"):
                    raise DataDirInUse(f"the database is in use by another TRIO service ({holder}); stop it, or "
                                       "give this one another database")
                self._recover()
                if share_data_dir and self._data_dir_lock is not None:
                    share_lock(self._data_dir_lock)  # recovered: later sharers may join
        except BaseException:  # a failed start holds nothing
            self._unlock_data_dir()
            raise
        # Stop the workers before the interpreter tears down: a worker thread still inside
        # torch while C++ statics are destroyed aborts the process ("terminate called
        # without an active exception"), and scripts rarely close an embedded service.
        atexit.register(self.close)

    # -- start-up ---------------------------------------------------------------------

    def _recover(self) -> None:
        """After a crash: in-flight requests fail clearly; runs resume at their next seq."""
        self._answer_landed_steps()  # before the rest fail and the lost calls are counted
        failed = self.store.fail_pending(RESTART_MESSAGE)
        if failed:
            log.warning("marked %d in-flight requests failed after restart", len(failed))
        for row in self.store.select(checkpoints_table, kind="ephemeral"):  # they live one service lifetime
            remove_checkpoint(self.store, self.data_dir, row)
        from trio_engine import snapshot
        from trio_engine.checkpoint import recover_folders

        recover_folders(self.data_dir / "checkpoints")  # a checkpoint write the crash interrupted
        ckpt.remove_served_links(self.data_dir / "archives")  # downloads the crash cut short
        snapshot.remove_partial_writes(self.engine_settings.snapshot_dir)
        remove_expired_checkpoints(self.store, self.data_dir)  # after: a recovered folder of one goes too
        # Calls since a run's last step: their gradients were in the crashed process's memory,
        # unless the run went to disk with them (offloaded, or a graceful stop), whose file
        # then holds the gradients of every one of them (a restore rewrites it without).
        self.calls_since_step.update(self.store.calls_since_last_step())
        self.lost_calls.update({run_id: n for run_id, n in self.calls_since_step.items()
                                if not snapshot.holds_grads(snapshot_path(self.engine_settings.snapshot_dir, run_id))})
        max_seq = self.store.max_seq_by_run()
        for run in self.store.select(runs_table):  # again: a landed step's answer moved its step
            self.next_seq[run["run_id"]] = max(run["next_seq"], max_seq.get(run["run_id"], -1) + 1)
            self._reconcile_step(run)

    def _answer_landed_steps(self) -> None:
        """A step is answered, its number stored with the answer, once its snapshot is
        written: a crash between the write and the answer leaves the step made but its
        request pending. Failed as in flight ("submit it again"), the client would apply
        its batch twice, and the calls before it would count as lost. A run's next call
        runs only once its step is answered, so only the run's first pending request can
        have run: if it is an optim_step and the snapshot is one step ahead of the store,
        it landed, and is answered done with the metrics the snapshot kept. (A snapshot
        ahead after a load_weights is the load's: that request fails as in flight, and the
        store takes the snapshot's step, ``_reconcile_step``.) One query for all runs' pending
        requests; a snapshot's header is read only for a run whose first one is a step."""
        first: dict[str, dict] = {}  # run id -> its pending request of the lowest seq
        for row in sorted(self.store.select(requests_table, status="pending"), key=lambda r: -1 if r["seq"] is None else r["seq"]):
            if row["run_id"] is not None:
                first.setdefault(row["run_id"], row)
        for run_id, request in first.items():
            if request["op"] == "optim_step" and (run := self.store.get(runs_table, run_id=run_id)) is not None:
                self._answer_landed_step(run, request)

    def _answer_landed_step(self, run: dict, request: dict) -> None:
        """``request``, the run's first pending one, an optim_step: answered done if the
        run's snapshot is one step ahead of the store (``_answer_landed_steps``)."""
        from trio_engine import snapshot

        landed = snapshot.last_step(snapshot_path(self.engine_settings.snapshot_dir, run["run_id"]))
        if landed is None or landed[0] != run["step"] + 1:
            return
        step, metrics = landed
        answer = t.OptimStepResponse(metrics=metrics or {"step": float(step)})
        self.store.update_together((requests_table, "request_id", request["request_id"],
                                    {"status": "done", "result": answer.model_dump_json()}),
                                   (runs_table, "run_id", run["run_id"], {"step": step}))
        log.warning("run %s: optim_step %s (step %d) was made before the restart: answered done",
                    run["run_id"], request["request_id"], step)

    def _reconcile_step(self, run: dict) -> None:
        """The run's step is stored once its snapshot is written: a crash between the two
        leaves the store a step behind, and a failed write (logged) leaves it ahead. The
        run resumes from its snapshot, so the store takes the snapshot's step."""
        from trio_engine import snapshot

        step = snapshot.step_of(snapshot_path(self.engine_settings.snapshot_dir, run["run_id"]))
        if step is not None and step != run["step"]:
            log.warning("run %s: back at step %d, its snapshot's (the store said %d)", run["run_id"], step, run["step"])
            self.store.update(runs_table, "run_id", run["run_id"], step=step)

    # -- submit / retrieve ------------------------------------------------------------

    def submit(self, user_id: str, op: str, body: Any, idempotency_key: str | None = None,
               refusal: ServiceError | None = None) -> str:
        """Validate and queue one operation; returns its request id at once.

        ``refusal``: a front door could not translate this call (its body names the run
        and seq); the call is refused with it, but still takes its place in the run's order.
        """
        if op not in t.OPERATIONS:
            raise ServiceError("not_found", f"unknown operation {op!r}", 404)
        if idempotency_key:
            existing = self._idempotent(user_id, idempotency_key)
            if existing:
                return existing
        rejection: ServiceError | None = None
        try:
            if refusal is not None:
                raise refusal
            item = WorkItem(request_id="req-" + secrets.token_hex(8), op=op, request=self._parse(op, body),
                            user_id=user_id)
            base_model = self._route(item)
            self._check_budget(item)
            self._check_servable(base_model)  # no GPU room: refused before anything is kept
        except ServiceError as exc:
            if (place := self._place_of_refused(user_id, body)) is None:
                raise
            (item, base_model), rejection = place, exc
        with self.lock:
            if idempotency_key and (existing := self._idempotent(user_id, idempotency_key)):
                return existing  # a concurrent retry registered it meanwhile
            self._check_capacity(user_id)
            if item.run_id is not None and item.seq is not None:
                self._check_seq(item)
            if rejection is None:
                try:
                    self._check_limits(item)
                except ServiceError as exc:
                    if item.seq is None:
                        raise
                    rejection = exc
            if rejection is not None:
                # A refused call still takes its place in its run's order: the run's later
                # calls must neither wait for it (seq_gap_seconds) nor run before it.
                item.op, item.context["error"] = "rejected", rejection
            item.arrival = next(self.arrivals)
            self.futures[item.request_id] = concurrent.futures.Future()
            self.owners[item.request_id] = user_id
            self._count_pending(item)
            if idempotency_key:
                self.idempotency[(user_id, idempotency_key)] = item.request_id
                item.context["idempotency_key"] = idempotency_key
        try:
            self.store.insert(
                requests_table, request_id=item.request_id, user_id=user_id, op=op, run_id=item.run_id,
                seq=item.seq, status="pending", idempotency_key=idempotency_key, created_at=now(),
            )
        except sa.exc.IntegrityError:  # a concurrent submit with the same key won the race
            self._unregister(item.request_id)
            existing = self._idempotent(user_id, idempotency_key or "")
            if existing is None:
                raise
            return existing
        except Exception:  # e.g. the database stayed down past Store.retry_seconds: not accepted
            self._unregister(item.request_id)
            raise
        self._worker(base_model).enqueue(item)
        if rejection:
            raise rejection
        return item.request_id

    def _place_of_refused(self, user_id: str, body: Any) -> tuple[WorkItem, str] | None:
        """The place in its run's order of a request refused before it was queued, when
        its body names a run of this user and a seq; else None (nothing to hold)."""
        def field(name: str) -> Any:
            return body.get(name) if isinstance(body, dict) else getattr(body, name, None)

        run_id, seq = field("model_id"), field("seq")
        if not isinstance(run_id, str) or type(seq) is not int:
            return None
        try:
            run = self._run(user_id, run_id)
        except ServiceError:  # not this user's run: nothing to hold
            return None
        item = WorkItem(request_id="req-" + secrets.token_hex(8), op="rejected", request=None,
                        user_id=user_id, run_id=run_id, seq=seq)
        return item, run["base_model"]

    async def retrieve(self, user_id: str, request_id: str, timeout: float) -> Outcome:
        """The outcome of a request, waiting up to ``timeout`` s (long poll)."""
        future = self.futures.get(request_id)
        if future is None or self.owners.get(request_id) != user_id:
            return self._stored_outcome(user_id, request_id)
        if future.done():  # also for timeout=0, which wait_for would cancel before looking
            return future.result()
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
        except asyncio.TimeoutError:
            return Outcome.pending(self._queue_info(request_id))

    def _stored_outcome(self, user_id: str, request_id: str) -> Outcome:
        row = self.store.get(requests_table, request_id=request_id)
        if row is None or row["user_id"] != user_id:
            raise not_found(f"request {request_id!r}")
        error = t.ErrorInfo(category=row["error_category"], message=row["error_message"]) if row["error_category"] else None
        if row["status"] == "pending":  # queued in another process's lifetime: cannot finish
            return Outcome("failed", error=t.ErrorInfo(category="server", message=RESTART_MESSAGE))
        return Outcome(row["status"], row["result"], error)

    def _queue_info(self, request_id: str) -> QueueInfo | None:
        """Where a pending request stands on its host; None once no worker holds it
        (taken, finishing: it resolves in a moment)."""
        for worker in list(self.workers.values()):
            info = worker.queue_info(request_id)
            if info is not None:
                return info
        return None

    def _unregister(self, request_id: str) -> None:
        with self.lock:
            self.futures.pop(request_id, None)
            self._uncount_pending(request_id)
            user_id = self.owners.pop(request_id, None)
            for key, rid in list(self.idempotency.items()):
                if rid == request_id and key[0] == user_id:
                    del self.idempotency[key]

    def _idempotent(self, user_id: str, key: str) -> str | None:
        with self.lock:
            if (user_id, key) in self.idempotency:
                return self.idempotency[(user_id, key)]
        row = self.store.get(requests_table, user_id=user_id, idempotency_key=key)
        return row["request_id"] if row else None

    def request_for_key(self, user_id: str, key: str) -> str | None:
        """The request a submit with this idempotency key registered, if any."""
        return self._idempotent(user_id, key)

    @staticmethod
    def _parse(op: str, body: Any) -> pydantic.BaseModel:
        return _validated(t.OPERATIONS[op][0], body, f"{op}: ")

    # -- routing: which run, sampler and model host a request belongs to ------------

    def _route(self, item: WorkItem) -> str:
        req = item.request
        if isinstance(req, t.CreateModelRequest):
            self._check_model(req.base_model)
            if req.lora_config.rank > self.limits.max_lora_rank or req.lora_config.rank < 1:
                raise ServiceError("validation", f"lora_config.rank: must be in [1, {self.limits.max_lora_rank}], got {req.lora_config.rank}")
            item.context["run_id"] = "run-" + secrets.token_hex(6)
            return req.base_model
        if isinstance(req, t.CreateModelFromStateRequest):
            row = self._checkpoint(item.user_id, req.path, kind="weights")
            item.context.update(run_id="run-" + secrets.token_hex(6), checkpoint=row)
            return self._run(item.user_id, row["run_id"])["base_model"]
        if isinstance(req, t.CreateSamplerRequest):
            if req.base_model is not None:
                self._check_model(req.base_model)
                return req.base_model
            row = self._checkpoint(item.user_id, req.model_path or "")
            item.context["checkpoint"] = row
            return self._run(item.user_id, row["run_id"])["base_model"]
        if isinstance(req, t.SampleRequest | t.ComputeLogprobsRequest):
            sampler = self.store.get(samplers_table, sampler_id=req.sampler_id)
            if sampler is None or sampler["user_id"] != item.user_id:
                raise not_found(f"sampler {req.sampler_id!r}")
            item.context["sampler"] = sampler
            return sampler["base_model"]
        run = self._run(item.user_id, req.model_id, field="model_id")
        item.run_id, item.seq = run["run_id"], getattr(req, "seq", None)
        if isinstance(req, t.LoadWeightsRequest):
            item.context["checkpoint"] = self._checkpoint(item.user_id, req.path, kind="weights")
        return run["base_model"]

    def _check_model(self, name: str) -> None:
        from trio_engine import ModelNotAvailableError

        # Any name may resolve to the hub, and names become folder names (tokenizers/<org>--<name>):
        # '..' would make that folder the data dir itself, which tokenizer_files replaces.
        problem = ckpt.unsafe_reason(name.replace("/", "--"), max_len=256)
        if problem:
            raise ServiceError("validation", f"base_model: {name[:200]!r} {problem}", 400)
        try:
            self.catalog.resolve(name)
        except ModelNotAvailableError as exc:
            raise ServiceError("validation", f"base_model: {exc}", 400) from None

    def _run(self, user_id: str, run_id: str, field: str = "run_id") -> dict:
        ckpt.check_part(field, run_id, max_len=64)  # a run id names a folder: 400 before any lookup
        run = self.store.get(runs_table, run_id=run_id)
        if run is None or run["user_id"] != user_id:
            raise not_found(f"training run {run_id!r}")
        return run

    def _checkpoint(self, user_id: str, path: str, kind: str | None = None) -> dict:
        ckpt.parse_path(path)  # a clear validation error for a malformed path
        row = self.store.get(checkpoints_table, path=path)
        if row is not None and expired(row):  # its TTL ran out since the last sweep
            remove_expired_checkpoints(self.store, self.data_dir)
            row = None
        if row is None or row["user_id"] != user_id:
            raise not_found(f"checkpoint {path!r}")
        if kind and row["kind"] != kind:
            raise ServiceError("validation", f"path: {path!r} is a {row['kind']} checkpoint, need {kind}")
        return row

    def checkpoint_row(self, user_id: str, path: str) -> dict:
        """A checkpoint's record; 404 unless it is this user's."""
        return self._checkpoint(user_id, path)

    def _check_budget(self, item: WorkItem) -> None:
        """A key whose token budget is spent submits no more token work (usage.py says
        what counts, and why 403). Checked before anything changes; other operations
        (saving, downloading) stay allowed. Requests already accepted still run."""
        if item.op in COUNTED_OPS and (budget := self.store.budget_of(item.user_id)) is not None:
            check_budget(budget, self.store.usage_total(item.user_id))

    def _check_seq(self, item: WorkItem) -> None:
        assert item.run_id is not None and item.seq is not None
        expected = self.next_seq.get(item.run_id, 0)
        # unfinished: queued, running, or its answer held for a snapshot (a copy accepted
        # then would never run: its seq is not next once the first one's is answered)
        if item.seq < expected or (item.run_id, item.seq) in self.unfinished.values():
            raise ServiceError("validation", f"seq: {item.seq} was already used for run {item.run_id} (next is {expected})", 409)

    def _check_quotas(self, item: WorkItem) -> None:
        """Called under ``self.lock``: queued creates are counted, so racing ones cannot all pass."""
        req, lim = item.request, self.limits
        if isinstance(req, t.CreateModelRequest | t.CreateModelFromStateRequest) and lim.max_runs_per_user is not None:
            queued = sum(i.user_id == item.user_id and i.op in ("create_model", "create_model_from_state")
                         for w in self.workers.values() for i in w.snapshot())
            used = len(self.store.select(runs_table, user_id=item.user_id)) + queued
            check_quota("max_runs_per_user", "runs", used, lim.max_runs_per_user,
                   "runs are kept (there is no deleting one), so ask the operator for more")
        if isinstance(req, t.SaveWeightsRequest):  # and again when it runs (queued saves are not counted)
            check_checkpoint_bytes(self.store, item.user_id, req.kind, lim.max_checkpoint_bytes_per_user)

    def _check_capacity(self, user_id: str, count: int = 1) -> None:
        """Called under ``self.lock``, before anything changes: 429 when ``count`` more of the
        user's or the service's pending requests would pass their bound. (A retry of an
        accepted request never gets here: its idempotency key answered first.)"""
        lim = self.limits
        mine, total = self.pending_by_user[user_id], len(self.unfinished)
        if lim.max_pending_per_user is not None and mine + count > lim.max_pending_per_user:
            raise over_capacity("max_pending_per_user", "requests of this user", mine, lim.max_pending_per_user,
                                lim.retry_after_seconds, count)
        if lim.max_pending_total is not None and total + count > lim.max_pending_total:
            raise over_capacity("max_pending_total", "requests", total, lim.max_pending_total, lim.retry_after_seconds,
                                count)

    def check_room(self, user_id: str, count: int) -> None:
        """For a front door about to submit ``count`` requests that answer one call: a 429
        now if they would not all fit in the pending bounds, rather than some accepted (and
        run, and billed) and the rest refused. Not a reservation: a request of the same
        user submitted in between can still take a place."""
        with self.lock:
            self._check_capacity(user_id, count)

    def _count_pending(self, item: WorkItem) -> None:
        place = (item.run_id, item.seq) if item.run_id is not None and item.seq is not None else None
        self.unfinished[item.request_id] = place
        self.pending_by_user[item.user_id] += 1

    def _uncount_pending(self, request_id: str) -> None:
        """Under ``self.lock``: the request finished (or was never queued)."""
        if request_id in self.unfinished:
            del self.unfinished[request_id]
            user_id = self.owners.get(request_id, "")
            self.pending_by_user[user_id] -= 1
            if self.pending_by_user[user_id] <= 0:
                del self.pending_by_user[user_id]

    def _check_limits(self, item: WorkItem) -> None:
        self._check_quotas(item)
        req, lim = item.request, self.limits
        if isinstance(req, t.ForwardRequest):
            if len(req.data) > lim.max_batch_size:
                raise ServiceError("validation", f"data: {len(req.data)} datums exceed max_batch_size={lim.max_batch_size}", 413)
            total = 0
            for i, datum in enumerate(req.data):
                n = datum.model_input.length
                if n > lim.max_seq_len:
                    raise ServiceError("validation", f"data[{i}].model_input: length {n} exceeds max_seq_len={lim.max_seq_len}", 413)
                total += n
            if total > lim.max_tokens_per_request:
                raise ServiceError("validation", f"data: {total} tokens exceed max_tokens_per_request={lim.max_tokens_per_request}", 413)
        if isinstance(req, t.SampleRequest):
            if req.num_samples > lim.max_samples_per_request:
                raise ServiceError("validation", f"num_samples: {req.num_samples} exceeds the limit of {lim.max_samples_per_request}", 413)
            if req.prompt.length + req.sampling_params.max_tokens > lim.max_seq_len:
                raise ServiceError("validation", f"prompt length + max_tokens = {req.prompt.length + req.sampling_params.max_tokens} exceeds max_seq_len={lim.max_seq_len}", 413)

    # -- execution (worker thread) ----------------------------------------------------

    def _worker(self, base_model: str) -> HostWorker:
        with self.lock:
            if base_model not in self.workers:
                ctx = Context(base_model, self._new_engine(base_model), self.store, self.data_dir,
                              self.limits.ephemeral_samplers_per_run, self.limits.max_checkpoint_bytes_per_user,
                              unstepped=Counter(self.calls_since_step),
                              lost=Counter(self.lost_calls))
                order = Sequencing(self.next_seq, self.lock, self.limits.seq_gap_seconds)
                self.workers[base_model] = HostWorker(ctx, lambda item, r: self.resolve(item, *r), order,
                                                      self.idle_offload_seconds, self.limits.max_batch_tokens,
                                                      self.limits.max_pass_tokens, self.limits.max_resident_runs,
                                                      self.limits.slice_alone)
            return self.workers[base_model]

    def _check_servable(self, base_model: str) -> None:
        """Refuse a model not yet served whose host the Ray cluster has no GPU room for (its
        host is made once the request is accepted: a refused one must hold none)."""
        if self.engine_kind == "ray" and base_model not in self.workers:
            from .ray_engine import check_gpu_room, wants_gpu

            if wants_gpu(self.engine_settings.device):
                check_gpu_room(base_model, self.ray_gpus_per_model, self.gpu_shares)

    def _new_engine(self, base_model: str) -> Engine:
        if self.engine_kind == "ray":
            from .ray_engine import RayEngine, wants_gpu

            self._check_servable(base_model)
            engine = RayEngine(base_model, self.engine_settings, address=self.ray_address,
                               resource=self.ray_placement.get(base_model), gpus=self.ray_gpus_per_model)
            if wants_gpu(self.engine_settings.device):
                self.gpu_shares[base_model] = self.ray_gpus_per_model
            return engine
        return LocalEngine(base_model, self.engine_settings)

    def resolve(self, item: WorkItem, result: pydantic.BaseModel | None, error: ServiceError | None) -> None:
        """Store the outcome, advance the run's sequence, wake the waiters.

        The store retries through a database restart (``Store.retry_seconds``); if it is
        down for longer, the outcome is still delivered to this process's waiters and the
        error logged: an executed request is not turned into a lost one, and the worker
        thread (which calls this) lives on.
        """
        if error is None:
            assert result is not None
            outcome = Outcome("done", result.model_dump_json())
        else:
            outcome = Outcome("failed", error=t.ErrorInfo(category=error.category, message=error.message,
                                                          status_code=error.status))
        if item.run_id is not None and item.seq is not None:
            with self.lock:  # never back: an idle worker may have skipped past a seq that never came
                self.next_seq[item.run_id] = max(self.next_seq.get(item.run_id, 0), item.seq + 1)
        try:
            self._store_outcome(item, outcome)
        except Exception:
            log.exception("request=%s run=%s op=%s: its outcome could not be stored; delivered in memory only",
                          item.request_id, item.run_id or "-", item.op)
        if result is not None and error is None:
            self._count_usage(item, result)
        with self.lock:
            self._uncount_pending(item.request_id)
        future = self.futures.get(item.request_id)
        if future is not None and not future.done():
            future.set_result(outcome)
        self._forget_old(item)

    def _count_usage(self, item: WorkItem, result: pydantic.BaseModel) -> None:
        """Add a done request's tokens to its user's usage (usage.py); a failure to count is
        logged and never fails the request, whose result is already stored."""
        try:
            run_id, n = tokens_of(item, result)
            self.store.add_usage(item.user_id, run_id, n.trained, n.prefilled, n.sampled)
        except Exception:
            log.exception("request=%s run=%s: counting its token usage failed", item.request_id, item.run_id)

    def _store_outcome(self, item: WorkItem, outcome: Outcome) -> None:
        """The request's outcome and its run's next seq, and the step a done optim_step
        made, in one transaction (see ``_answer_landed_steps``)."""
        if outcome.error is None:
            request: dict[str, Any] = {"status": "done", "result": outcome.result_json}
        else:
            request = {"status": "failed", "error_category": outcome.error.category,
                       "error_message": outcome.error.message}
        run: dict[str, Any] = {}
        if item.run_id is not None and item.seq is not None:
            run = {"next_seq": item.seq + 1, "last_request_at": now()}
            if outcome.error is None and "step" in item.context:
                run["step"] = item.context["step"]
        self.store.update_together((requests_table, "request_id", item.request_id, request),
                                   (runs_table, "run_id", item.run_id or "", run))

    def _forget_old(self, item: WorkItem) -> None:
        """Finished futures stay in memory for a while; after that the store answers."""
        now_s = time.monotonic()
        with self.lock:
            self.finished.append((now_s, item.request_id, item.context.get("idempotency_key")))
            while self.finished and (now_s - self.finished[0][0] > KEEP_FINISHED_SECONDS or len(self.finished) > KEEP_FINISHED_MAX):
                _, request_id, key = self.finished.popleft()
                user_id = self.owners.pop(request_id, None)
                self.futures.pop(request_id, None)
                if key is not None:
                    self.idempotency.pop((user_id or "", key), None)

    def checkpoint_dir(self, run_id: str, kind: str, name: str) -> Path:
        return ckpt.folder(self.data_dir, run_id, kind, name)

    # -- REST (synchronous reads) ------------------------------------------------------

    def capabilities(self) -> t.ServerCapabilities:
        lim = self.limits
        return t.ServerCapabilities(
            supported_models=self.catalog.available(), max_tokens_per_request=lim.max_tokens_per_request,
            max_seq_len=lim.max_seq_len, max_batch_size=lim.max_batch_size, max_lora_rank=lim.max_lora_rank,
            max_runs_per_user=lim.max_runs_per_user, max_checkpoint_bytes_per_user=lim.max_checkpoint_bytes_per_user,
            max_pending_per_user=lim.max_pending_per_user, max_pending_total=lim.max_pending_total,
        )

    def tokenizer_files(self, base_model: str) -> t.TokenizerFiles:
        self._check_model(base_model)
        folder = self.data_dir / "tokenizers" / base_model.replace("/", "--")
        if (folder / "tokenizer_config.json").exists():
            files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        else:  # ask the engine once; later calls read the cache
            files = self._worker(base_model).engine.tokenizer_files()
            tmp = folder.with_name(folder.name + f".tmp-{secrets.token_hex(4)}")
            tmp.mkdir(parents=True)
            for name, content in files.items():
                (tmp / name).write_bytes(content)
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        return t.TokenizerFiles.of(base_model, files)

    def context_length(self, base_model: str) -> int:
        """The most tokens one sequence (prompt + sampled) may have on this base model: the
        smaller of the model's own context and ``Limits.max_seq_len``. Loads the model the
        first time; every front door reads it from here."""
        if base_model not in self.contexts:
            self._check_model(base_model)
            info = self._worker(base_model).engine.load()
            self.contexts[base_model] = min(int(info["max_seq_len"]), self.limits.max_seq_len)
        return self.contexts[base_model]

    def list_runs(self, user_id: str) -> list[t.TrainingRun]:
        remove_expired_checkpoints(self.store, self.data_dir)  # once for all the runs
        return [self._training_run(r) for r in self.store.select(runs_table, user_id=user_id, order_by="created_at")]

    def get_run(self, user_id: str, run_id: str) -> t.TrainingRun:
        row = self._run(user_id, run_id)
        remove_expired_checkpoints(self.store, self.data_dir)
        return self._training_run(row)

    def _training_run(self, row: dict) -> t.TrainingRun:
        return t.TrainingRun(
            run_id=row["run_id"], base_model=row["base_model"], lora_rank=json.loads(row["lora_config"])["rank"],
            created_at=row["created_at"], last_request_at=row["last_request_at"], step=row["step"],
            checkpoints=self._kept_checkpoints(user_id=row["user_id"], run_id=row["run_id"]),
        )

    def log_metrics(self, user_id: str, run_id: str, body: Any) -> t.LogMetricsResponse:
        """Record a client's metrics for one step of its run (``step`` None: the run's
        current step). Validated first, then the run's owner checked: nothing is
        recorded for a bad body or another user's run."""
        req = _validated(t.LogMetricsRequest, body)
        run = self._run(user_id, run_id)
        step = run["step"] if req.step is None else req.step
        self.store.put_metrics(run_id, step, "client", req.metrics)
        return t.LogMetricsResponse(run_id=run_id, step=step)

    def run_metrics(self, user_id: str, run_id: str) -> list[t.StepMetrics]:
        """The run's steps in order, each with the service's and the client's metrics."""
        self._run(user_id, run_id)
        return [t.StepMetrics(step=step, metrics=metrics) for step, metrics in self.store.run_metrics(run_id)]

    def usage(self, user_id: str) -> t.Usage:
        """The user's token usage: totals, one row per run, and the key's budget."""
        return usage_response(self.store.usage_by_run(user_id), self.store.budget_of(user_id))

    def run_usage(self, user_id: str, run_id: str) -> t.RunUsage:
        """One run's token usage (sampling from its weights included); 404 unless it is this user's."""
        self._run(user_id, run_id)
        rows = self.store.usage_by_run(user_id, run_id)
        return t.RunUsage(**rows[0]) if rows else t.RunUsage(run_id=run_id)

    def list_checkpoints(self, user_id: str, run_id: str | None = None) -> list[t.Checkpoint]:
        where = {"user_id": user_id} | ({"run_id": run_id} if run_id else {})
        if run_id:
            self._run(user_id, run_id)
        remove_expired_checkpoints(self.store, self.data_dir)
        return self._kept_checkpoints(**where)

    def _kept_checkpoints(self, **where: str) -> list[t.Checkpoint]:
        rows = self.store.select(checkpoints_table, order_by="created_at", **where)
        # unnamed sampler weights are not checkpoints to keep; an expired one the sweep left
        # (being saved again right now) is gone already
        return [_checkpoint_of(r) for r in rows if r["kind"] != "ephemeral" and not expired(r)]

    def delete_checkpoint(self, user_id: str, path: str) -> None:
        remove_checkpoint(self.store, self.data_dir, self._checkpoint(user_id, path))

    def set_checkpoint_ttl(self, user_id: str, path: str, body: Any) -> t.Checkpoint:
        """The checkpoint expires ``body.ttl_seconds`` from now (None: never); 404 unless it
        is this user's. ``body``: a ``CheckpointTTL`` or what validates as one."""
        ttl_seconds = _validated(t.CheckpointTTL, body).ttl_seconds
        row = self._checkpoint(user_id, path)
        expires_at = None if ttl_seconds is None else later(now(), ttl_seconds)
        if not set_expiry(self.store, path, expires_at):  # expired and swept since it was read
            raise not_found(f"checkpoint {path!r}")
        return _checkpoint_of(row | {"expires_at": expires_at})

    def checkpoint_archive(self, user_id: str, path: str) -> tuple[Path, str]:
        """A tar archive of the checkpoint folder (built once, then served with ranges): a
        link to it that the caller unlinks once sent (``checkpoints.served_link``), and
        the archive's name."""
        row = self._checkpoint(user_id, path)
        folder = self.checkpoint_dir(row["run_id"], row["kind"], row["name"])
        try:
            archive = ckpt.archive(folder, self.data_dir / "archives")
            return ckpt.served_link(archive), archive.name
        except FileNotFoundError:  # deleted (or swept) while its archive was built or linked
            raise not_found(f"checkpoint {path!r}") from None

    def close(self) -> None:
        """Stop every worker (each finishes its running batch), then free the data dir; at
        exit if not called before."""
        atexit.unregister(self.close)
        for worker in list(self.workers.values()):
            worker.stop()
        self._unlock_data_dir()

    def _unlock_data_dir(self) -> None:
        """Free the data dir, and the database ``Store.claim`` held."""
        if (store := getattr(self, "store", None)) is not None:
            store.release()
        if self._data_dir_lock is not None:
            self._data_dir_lock.close()  # the lock goes with the file
            self._data_dir_lock = None


def lock_data_dir(data_dir: Path, share: bool = False) -> tuple[IO[str] | None, bool]:
    """A lock on ``data_dir`` for one service's lifetime (a file lock, which the OS frees
    when the process dies, however it dies): (the open lock file, whether this service is
    alone on it and so runs its start-up recovery).

    Two services on one data dir would fail each other's requests at start-up, delete each
    other's sampler weights and train the same runs apart. A service takes the lock
    exclusively. One that may ``share`` (the embedded one) takes it exclusively if it can,
    to recover, then shares it (``share_lock``); beside other sharers it joins them
    without recovering; beside an exclusive holder (``trio serve``) it holds nothing and
    does not recover. None, True where there are no POSIX file locks.

    Raises:
        DataDirInUse: another service uses the data dir and this one may not share it.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None, True
    lock = open(data_dir / "trio.lock", "a+")  # noqa: SIM115  (held open for the service's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        if not share:
            lock.close()
            raise DataDirInUse(f"data dir {data_dir} is in use by another TRIO service ({holder or 'a shared one'}); "
                               "stop it, or give this one another data dir") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a server's: share its data dir, holding nothing
            lock.close()
            return None, False
        return lock, False
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
    lock.flush()
    return lock, True


def share_lock(lock: IO[str]) -> None:
    """Turn an exclusive data-dir lock into a shared one (``lock_data_dir``)."""
    import fcntl

    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)


def _validated(model: type[M], body: Any, prefix: str = "") -> M:
    """``body`` as ``model`` (a model already is one); a 422 naming the field if it is not."""
    try:
        return body if isinstance(body, model) else model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise ServiceError("validation", prefix + describe_validation_error(exc), 422) from None


def _checkpoint_of(row: dict) -> t.Checkpoint:
    """A checkpoints row as the API's Checkpoint."""
    metadata = json.loads(row["user_metadata"]) if row["user_metadata"] else None
    return t.Checkpoint(**{k: v for k, v in row.items() if k not in ("user_id", "user_metadata")},
                        user_metadata=metadata)
