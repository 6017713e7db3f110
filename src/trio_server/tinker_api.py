"""The tinker 0.38 front door: the official ``tinker`` SDK and tinker-cookbook against TRIO.

Mounted at ``/tinker`` (clients set ``TINKER_BASE_URL=http://HOST:PORT/tinker``) over the
same ``ServiceCore`` as the pytrio routes: every training and sampling call becomes one of
the core's own requests, so validation, ordering, limits, isolation, co-batching and
durability are the core's. This module only translates (docs: the tinker protocol notes in
``docs/tinker_public.proto`` and the README's "Using the tinker SDK").

- Ids. A tinker session is ``sess-<hex>``; its training clients are ``<session>:train:<n>``
  and its sampling sessions ``<session>:sample:<n>``, as the SDK itself assumes. The
  ``tinker_ids`` table maps each to the core's run or sampler id (through the request
  that created it, so the map survives a restart). Training runs and checkpoints keep
  the core's ids: ``tinker://<run>/weights/<name>`` is ``trio://<run>/weights/<name>``.
- Order and retries. A tinker ``seq_id`` n (from 1) is the core's ``seq`` n-1. The SDK's
  outer retry resends a seq under a new idempotency key, so the core's idempotency key
  here is ``tinker:<model_id>:<seq_id>`` (``tinker:<sampling_session>:<seq_id>`` for
  samples): a resent request answers the first one's request id.
- Futures. ``retrieve_future`` long-polls the core for up to ``POLL_SECONDS``; a pending
  request answers 408 ``try_again`` (re-polled at once by the SDK), a failed one 200
  ``{error, category}``. Nothing permanent answers 409 or 5xx, which the SDK retries for
  minutes. A submit past a queue bound (``Limits.max_pending_*``) answers 429 with
  ``Retry-After``/``retry-after-ms``, which the SDK honours and resends (for up to 5
  minutes); since its key names the seq, a resend of an accepted one is never refused.
  ``forward_backward`` bodies and the ``ForwardBackwardOutput`` and
  ``SampleResponse`` results are protobuf (``tinker_wire``), the rest JSON.
- Keys. ``X-API-Key: tml-<TRIO key>``; with ``--no-auth`` any ``tml-`` key is accepted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict

from pytrio import types as t
from trio_engine import InvalidInputError
from trio_engine.checkpoint import saved_lora_config
from trio_engine.sampler import MAX_NUM_SAMPLES

from .auth import ANONYMOUS
from .core import Outcome, ServiceCore
from .errors import RESTART_MESSAGE, ServiceError, not_found
from .store import now
from .store import requests as requests_table
from .store import runs as runs_table
from .store import samplers as samplers_table
from .tinker_wire import (
    decode_datums,
    encode_forward_output,
    encode_sample_output,
    loss_config,
    pb,
    seq_of,
    session_of,
    to_tinker_path,
    to_trio_path,
)

log = logging.getLogger("trio.tinker")

POLL_SECONDS = 25.0  # under the SDK's 45 s per-poll timeout
MIN_BYTES_PER_TOKEN = 8  # the SDK's estimate of a datum: 4 bytes a token, + at least 4 for its target
KEY_PREFIX = "tml-"
PROTO = "application/x-protobuf"
LOCAL_PREFIX = "tinker-"  # request ids of futures this module holds, not the core
LOCAL_FUTURES_PER_USER = 1_000  # done futures held here per user at most, besides the 600 s (TinkerDoor._forget_old)
CATEGORY = {"validation": "user", "not_found": "user", "capacity": "user", "authentication": "user",
            "server": "server"}

metadata = sa.MetaData()
sessions_table = sa.Table(
    "tinker_sessions", metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(64), nullable=False),
    sa.Column("created_at", sa.String(32), nullable=False),
    sa.Column("finished_at", sa.String(32)),
)
ids_table = sa.Table(
    "tinker_ids", metadata,
    sa.Column("tinker_id", sa.String(128), primary_key=True),  # <session>:train:<n> | <session>:sample:<n>
    sa.Column("user_id", sa.String(64), nullable=False),
    sa.Column("core_id", sa.String(64), index=True),  # the run or sampler id, once created
    sa.Column("request_id", sa.String(64), nullable=False),  # the core request that creates it
    sa.Column("user_metadata", sa.Text),
    sa.Column("created_at", sa.String(32), nullable=False),
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class RetrieveBody(_Body):
    request_id: str


class SessionBody(_Body):
    session_id: str


def _error(outcome: Outcome) -> t.ErrorInfo:
    return outcome.error or t.ErrorInfo(category="server", message="failed without an error message")


# -- replies ---------------------------------------------------------------------------------


@dataclass
class Reply:
    """A finished tinker future: its body and media type."""

    body: bytes
    media_type: str = "application/json"

    @classmethod
    def json(cls, obj: Any) -> Reply:
        return cls(json.dumps(obj).encode())

    @classmethod
    def failed(cls, category: str, message: str) -> Reply:
        return cls.json({"error": in_tinker_terms(message), "category": CATEGORY.get(category, "unknown")})


@dataclass
class LocalFuture:
    """A tinker future the core does not hold: a compound call, or a refusal at submit."""

    user_id: str
    task: asyncio.Future[Reply]
    created: float = field(default_factory=time.monotonic)


class TinkerDoor:
    """Translation state: the id map (in the store) and compound futures (in memory)."""

    def __init__(self, core: ServiceCore, auth: bool):
        self.core, self.auth = core, auth
        self.store = core.store
        metadata.create_all(self.store.engine)
        self.local: dict[str, LocalFuture] = {}
        self.local_by_key: dict[tuple[str, str], str] = {}
        self.known: dict[tuple[str, str], str] = {}  # (user, tinker id) -> core id; never changes once set
        self.ops: dict[str, str] = {}  # core request id -> op, for the requests made here (recent ones)

    # -- auth --------------------------------------------------------------------------------

    def user(self, request: Request) -> str:
        key = request.headers.get("x-api-key") or ""
        if not key.startswith(KEY_PREFIX):
            raise ServiceError("authentication", "missing tinker API key: send X-API-Key: tml-<TRIO key> "
                               "(TINKER_API_KEY; `trio keys create` prints it)", 401)
        if not self.auth:
            return ANONYMOUS
        user = self.store.user_for_key(key[len(KEY_PREFIX):])
        if user is None:
            raise ServiceError("authentication", "invalid API key", 401)
        return user

    # -- the id map ----------------------------------------------------------------------

    def remember(self, tinker_id: str, user_id: str, request_id: str, user_metadata: Any = None) -> None:
        if request_id.startswith(LOCAL_PREFIX):  # refused: nothing was created
            return
        row = self.store.get(ids_table, tinker_id=tinker_id)
        if row is not None:
            if row["user_id"] != user_id:
                raise not_found(f"{tinker_id!r}")
            return
        try:
            self.store.insert(ids_table, tinker_id=tinker_id, user_id=user_id, request_id=request_id,
                              user_metadata=json.dumps(user_metadata) if user_metadata else None, created_at=now())
        except sa.exc.IntegrityError:  # a concurrent retry inserted it
            pass

    async def core_id(self, user_id: str, tinker_id: str, what: str) -> str:
        """The core's run or sampler id for a tinker id, waiting for its creation if need be."""
        if (user_id, tinker_id) in self.known:  # every sample and training call asks
            return self.known[(user_id, tinker_id)]
        row = self.store.get(ids_table, tinker_id=tinker_id)
        if row is None or row["user_id"] != user_id:
            if tinker_id.startswith(("run-", "sampler-")):  # a core id used as is
                return tinker_id
            raise not_found(f"{what} {tinker_id!r}")
        core_id = row["core_id"]
        if not core_id:
            result = json.loads((await self.wait(user_id, row["request_id"])).result_json or "{}")
            core_id = result.get("model_id") or result.get("sampler_id")
            self.store.update(ids_table, "tinker_id", tinker_id, core_id=core_id)
        self.known[(user_id, tinker_id)] = core_id
        return core_id

    def tinker_row_for_run(self, run_id: str) -> dict | None:
        return self.store.get(ids_table, core_id=run_id)

    def check_session(self, user_id: str, session_id: str) -> None:
        row = self.store.get(sessions_table, session_id=session_id)
        if row is None or row["user_id"] != user_id:
            raise not_found(f"session {session_id!r}")

    # -- futures -------------------------------------------------------------------------

    async def wait(self, user_id: str, request_id: str) -> Outcome:
        """The core outcome of a request, however long it takes; raises if it failed."""
        while True:
            outcome = await self.core.retrieve(user_id, request_id, POLL_SECONDS)
            if outcome.status == "done":
                return outcome
            if outcome.status == "failed":
                error = _error(outcome)
                raise ServiceError(error.category, error.message)

    def submit(self, user_id: str, op: str, body: dict, key: str | None,
               refusal: ServiceError | None = None) -> str:
        """A core request id, or a local future that fails with the core's refusal.
        ``refusal``: this door's own (see ServiceCore.submit); a call that names its run
        and seq still takes its place in the run's order."""
        try:
            request_id = self.core.submit(user_id, op, body, key, refusal)
            self.ops[request_id] = op
            while len(self.ops) > 10_000:  # the oldest first; the store still knows them
                del self.ops[next(iter(self.ops))]
            return request_id
        except ServiceError as exc:
            if exc.category in ("authentication", "capacity"):
                raise  # capacity: a 429 with Retry-After, which the SDK waits out and resends
            if key and (existing := self.core.request_for_key(user_id, key)):
                return existing  # refused but registered (over a limit): its future says why
            return self.local_future(user_id, self._raise(exc))

    async def in_run_order(self, user_id: str, model_id: str, seq_id: Any) -> tuple[str, dict, dict | None]:
        """A training client's call: its idempotency key, the core request's run and seq,
        and, when either is unknown, the reply to give instead (a future failing with why).
        A call whose run and seq are known takes its place in the run's order even when
        refused (``submit``'s ``refusal``), so the run's next call does not wait for it."""
        key = f"tinker:{model_id}:{seq_id}"
        try:
            return key, {"model_id": await self.core_id(user_id, model_id, "model"), "seq": seq_of(seq_id)}, None
        except ServiceError as exc:
            return key, {}, {"request_id": self.local_future(user_id, self._raise(exc), key), "model_id": model_id}

    @staticmethod
    async def _raise(exc: ServiceError) -> Reply:
        raise exc

    def local_future(self, user_id: str, work: Awaitable[Reply], key: str | None = None) -> str:
        if key and (user_id, key) in self.local_by_key:  # a resend: the first one's future
            if asyncio.iscoroutine(work):
                work.close()
            return self.local_by_key[(user_id, key)]
        self._forget_old(user_id)
        request_id = LOCAL_PREFIX + secrets.token_hex(8)
        task = asyncio.ensure_future(work)
        task.add_done_callback(_keep_the_error_alone)
        self.local[request_id] = LocalFuture(user_id, task)
        if key:
            self.local_by_key[(user_id, key)] = request_id
        return request_id

    @staticmethod
    def _local_reply(request_id: str, task: asyncio.Future[Reply]) -> Reply:
        if (error := task.exception()) is None:
            return task.result()
        if isinstance(error, ServiceError):
            return Reply.failed(error.category, error.message)
        # a bug here must not become a 5xx the SDK retries forever
        log.error("tinker future %s failed", request_id, exc_info=error)
        return Reply.failed("server", f"internal error: {error}")

    def _forget_old(self, user_id: str, keep_seconds: float = 600.0) -> None:
        """Drop the done futures older than ``keep_seconds``, and ``user_id``'s oldest done
        ones past ``LOCAL_FUTURES_PER_USER`` (refused calls come as fast as a client sends
        them; one user's flood must not push out another's answers)."""
        cutoff = time.monotonic() - keep_seconds
        excess = sum(fut.user_id == user_id for fut in self.local.values()) - LOCAL_FUTURES_PER_USER
        for rid, fut in list(self.local.items()):  # oldest first
            mine = fut.user_id == user_id and excess > 0
            if fut.task.done() and (fut.created < cutoff or mine):
                del self.local[rid]
                excess -= mine
        for key, rid in list(self.local_by_key.items()):
            if rid not in self.local:
                del self.local_by_key[key]

    async def retrieve(self, user_id: str, request_id: str) -> Response:
        local = self.local.get(request_id)
        if local is not None and local.user_id == user_id:
            # read, not raised: a raise would add this poll's frames to the kept exception
            if not (await asyncio.wait({local.task}, timeout=POLL_SECONDS))[0]:
                return self.try_again(request_id)
            reply = self._local_reply(request_id, local.task)
            return Response(reply.body, media_type=reply.media_type)
        if request_id.startswith(LOCAL_PREFIX) and local is None:  # held by a process that has ended
            reply = Reply.failed("server", RESTART_MESSAGE)
            return Response(reply.body, media_type=reply.media_type)
        outcome = await self.core.retrieve(user_id, request_id, POLL_SECONDS)
        if outcome.status == "pending":
            return self.try_again(request_id)
        if outcome.status == "failed":
            error = _error(outcome)
            reply = Reply.failed(error.category, error.message)
        else:
            try:
                reply = self.translate(request_id, json.loads(outcome.result_json or "null"))
            except Exception as exc:  # as above: answered, never a 5xx
                log.exception("tinker result of %s not translated", request_id)
                reply = Reply.failed("server", f"internal error: {exc}")
        return Response(reply.body, media_type=reply.media_type)

    @staticmethod
    def try_again(request_id: str) -> Response:
        return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"}, status_code=408)

    def translate(self, request_id: str, result: Any) -> Reply:
        """A core result in the shape the tinker SDK expects for that operation."""
        op = self.ops.get(request_id)
        if op is None:
            row = self.store.get(requests_table, request_id=request_id)
            op = row["op"] if row else ""
        if op in ("forward", "forward_backward"):
            return Reply(encode_forward_output(result), PROTO)
        if op == "sample":
            return Reply(encode_sample_output(result), PROTO)
        if op in ("create_model", "create_model_from_state"):
            mapped = self.store.get(ids_table, request_id=request_id)
            model_id = mapped["tinker_id"] if mapped else result["model_id"]
            if mapped and not mapped["core_id"]:
                self.store.update(ids_table, "tinker_id", model_id, core_id=result["model_id"])
            if op == "create_model":
                return Reply.json({"model_id": model_id, "type": "create_model"})
            return Reply.json({"model_id": model_id, "type": "load_weights"})
        if op == "optim_step":
            # less the run's step count: the cookbook merges these metrics into the record it
            # logs, whose own (0-based) "step" a float 1.0, 2.0 ... would replace, and its
            # resume, which drops a run's records from an int step on, would keep them
            metrics = {k: v for k, v in (result.get("metrics") or {}).items() if k != "step"}
            return Reply.json({"metrics": metrics})
        if op in ("save_weights", "load_weights"):
            return Reply.json({"path": to_tinker_path(result["path"])})
        return Reply.json(result)

    # -- sampling sessions ---------------------------------------------------------------

    async def context_of_sampler(self, sampler_id: str) -> int:
        """The most tokens a sequence of this core sampler may have (its base model's context
        within the server's ``max_seq_len``); loads the model the first time."""
        row = self.core.store.get(samplers_table, sampler_id=sampler_id)
        if row is None:
            raise not_found(f"sampler {sampler_id!r}")
        return await asyncio.to_thread(self.core.context_length, row["base_model"])

    async def open_sampler(self, user_id: str, sampling_session_id: str, body: dict,
                           wait_for_room: bool = False) -> str:
        """Create (once) the core sampler behind a tinker sampling session; its core id.

        ``wait_for_room``: past a queue bound, wait and resubmit (as the SDK does on a 429)
        rather than raise; for a call already answered with a future, which could only fail."""
        key = f"tinker:{sampling_session_id}"
        while True:
            try:
                request_id = self.core.submit(user_id, "create_sampler", body, key)
                break
            except ServiceError as exc:
                if not (wait_for_room and exc.category == "capacity"):
                    raise
                await asyncio.sleep(exc.retry_after or 1.0)
        self.remember(sampling_session_id, user_id, request_id)
        return await self.core_id(user_id, sampling_session_id, "sampling session")


def _tinker_run(core: ServiceCore, door: TinkerDoor, user_id: str, run: Any) -> dict:
    """The core's TrainingRun as tinker's TrainingRun."""
    mapped = door.tinker_row_for_run(run.run_id)
    meta = json.loads(mapped["user_metadata"]) if mapped and mapped["user_metadata"] else None
    ckpts = [_tinker_checkpoint(c) for c in run.checkpoints]
    training = [c for c in ckpts if c["checkpoint_type"] == "training"]
    sampler = [c for c in ckpts if c["checkpoint_type"] == "sampler"]
    return {
        "training_run_id": run.run_id, "base_model": run.base_model, "model_owner": user_id, "is_lora": True,
        "lora_rank": run.lora_rank, "last_request_time": run.last_request_at or run.created_at,
        "last_checkpoint": training[-1] if training else None,
        "last_sampler_checkpoint": sampler[-1] if sampler else None,
        "user_metadata": {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) and meta else None,
    }


def _tinker_checkpoint(c: Any) -> dict:
    return {
        "checkpoint_id": f"{c.kind}/{c.name}", "checkpoint_type": "training" if c.kind == "weights" else "sampler",
        "time": c.created_at, "tinker_path": to_tinker_path(c.path), "size_bytes": c.size_bytes, "public": False,
        "expires_at": c.expires_at, "user_metadata": c.user_metadata,
    }


def in_tinker_terms(message: str) -> str:
    """A core message for a tinker client: its checkpoint paths as that client wrote them
    (``tinker://``, where the core says ``trio://``)."""
    return message.replace("trio://", "tinker://")


EXTERNAL_WEIGHTS_REFUSAL = (
    "exporting weights to external storage (save_weights_external) is not supported by TRIO: save "
    "sampler weights (save_weights_for_sampler), then fetch them with pytrio's download_checkpoint_archive "
    "or `trio checkpoints download`, a PEFT folder that peft and vLLM load; `trio export --merge` writes "
    "a merged Hugging Face model")


def _not_adamw(body: dict) -> ServiceError | None:
    """The refusal of a training client asked to use another optimizer than AdamW."""
    optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
    if optimizer == "adamw":
        return None
    return ServiceError("validation", f"optimizer_config.type: TRIO supports 'adamw' only, got {optimizer!r}")


def _other_base_model(core: ServiceCore, user_id: str, path: str, base_model: str | None) -> ServiceError | None:
    """The refusal of a client from a checkpoint that names another base model than the
    checkpoint's (the SDK's ``base_model``: it would otherwise be ignored)."""
    try:
        run = core.store.get(runs_table, run_id=core.checkpoint_row(user_id, path)["run_id"])
    except ServiceError:
        return None  # an unknown checkpoint: the load says so
    if base_model is None or run is None or run["base_model"] == base_model:
        return None
    return ServiceError("validation", f"base_model: {to_tinker_path(path)} was trained on {run['base_model']!r}, "
                        f"not {base_model!r}")


def need(body: dict, name: str) -> Any:
    """A required field of a tinker body; a missing one is the client's error, never a 500."""
    if body.get(name) is None:
        raise ServiceError("validation", f"{name}: required")
    return body[name]


class _AnsweredRoute(APIRoute):
    """Turns an unexpected exception into a 400: a 5xx would make the SDK retry for minutes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                return await handler(request)
            except ServiceError as exc:
                exc.message = in_tinker_terms(exc.message)
                raise
            except (HTTPException, RequestValidationError):
                raise
            except Exception as exc:
                log.exception("tinker route %s failed", request.url.path)
                return JSONResponse({"error": {"category": "server", "message": f"internal error: {exc}"}}, 400)

        return answered


def _keep_the_error_alone(task: asyncio.Future[Reply]) -> None:
    """A local future's error is kept for polls without the frames it was raised through:
    the route's, holding the request (38 MiB a refused call with a 20 MB field)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        error.__traceback__ = error.__context__ = error.__cause__ = None


def _user_metadata(body: dict) -> Any:
    """A create's ``user_metadata``, kept to list with the run: refused unless an object of
    text (a list, kept, broke every later listing of the user's runs)."""
    metadata = body.get("user_metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ServiceError("validation", f"user_metadata: must be an object of strings, got {type(metadata).__name__}")
    if (where := t.lone_surrogate_at(metadata, "user_metadata")) is not None:
        raise ServiceError("validation", f"{where}: {t.NOT_TEXT}")
    return metadata


def _page(items: list, limit: int, offset: int) -> tuple[list, dict]:
    return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


def create_router(core: ServiceCore, auth: bool = True) -> APIRouter:
    """The tinker routes; the app mounts them under ``/tinker``."""
    door = TinkerDoor(core, auth)
    r = APIRouter(prefix="/api/v1", route_class=_AnsweredRoute)
    user = door.user

    # -- bootstrap and session -----------------------------------------------------------

    @r.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @r.post("/client/config")
    async def client_config(request: Request) -> dict:
        user(request)
        # Chunks of one forward_backward in seq order; plain httpx transport. The SDK also
        # cuts a chunk at an estimate of its bytes: at least 8 a token (an int32 input, a
        # target of 4 bytes or more), so this bound keeps every chunk within max_tokens_per_request.
        return {"parallel_fwdbwd_chunks": False, "use_pyqwest_transport": False,
                "fwdbwd_max_chunk_len": core.limits.max_batch_size,
                "fwdbwd_max_chunk_bytes_count": MIN_BYTES_PER_TOKEN * core.limits.max_tokens_per_request}

    @r.post("/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        user(request)
        return {"refresh_interval_sec": 300}

    @r.post("/create_session")
    async def create_session(request: Request) -> dict:
        user_id = user(request)
        session_id = "sess-" + secrets.token_hex(6)
        core.store.insert(sessions_table, session_id=session_id, user_id=user_id, created_at=now())
        return {"session_id": session_id, "type": "create_session"}

    @r.post("/session_heartbeat")
    async def heartbeat(body: SessionBody, request: Request) -> dict:
        door.check_session(user(request), body.session_id)
        return {"type": "session_heartbeat"}

    @r.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict:
        door.check_session(user(request), session_id)
        core.store.update(sessions_table, "session_id", session_id, finished_at=now())
        return {}

    @r.post("/telemetry")
    async def telemetry(request: Request) -> dict:
        user(request)
        return {"status": "accepted"}

    @r.get("/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        user(request)
        caps = core.capabilities()
        return {"supported_models": [{"model_name": m, "max_context_length": caps.max_seq_len, "trainable": True,
                                      "sampleable": True} for m in caps.supported_models]}

    # -- training ------------------------------------------------------------------------

    @r.post("/create_model")
    async def create_model(body: _Body, request: Request) -> dict:
        user_id, b = user(request), body.model_dump()
        door.check_session(user_id, need(b, "session_id"))
        model_id = f"{need(b, 'session_id')}:train:{need(b, 'model_seq_id')}"
        lora = {k: v for k, v in (b.get("lora_config") or {}).items()
                if k in ("rank", "seed", "train_mlp", "train_attn", "train_unembed")}
        metadata = _user_metadata(b)
        if refusal := _not_adamw(b):
            return {"request_id": door.local_future(user_id, door._raise(refusal)), "model_id": model_id}
        rid = door.submit(user_id, "create_model", {"base_model": need(b, "base_model"), "lora_config": lora},
                          f"tinker:{model_id}:create")
        door.remember(model_id, user_id, rid, metadata)
        return {"request_id": rid, "model_id": model_id}

    @r.post("/get_info")
    async def get_info(body: _Body, request: Request) -> dict:
        user_id, b = user(request), body.model_dump()
        run = await asyncio.to_thread(core.get_run, user_id, await door.core_id(user_id, need(b, "model_id"), "model"))
        return {"type": "get_info", "model_id": need(b, "model_id"), "is_lora": True, "lora_rank": run.lora_rank,
                "model_name": run.base_model,
                "model_data": {"model_name": run.base_model, "tokenizer_id": run.base_model}}

    @r.post("/forward_backward")
    async def forward_backward(request: Request) -> dict:
        user_id = user(request)
        msg = pb.ForwardBackwardRequest()
        try:
            msg.ParseFromString(await request.body())
        except Exception:
            raise ServiceError("validation", "forward_backward: the body is not a tinker ForwardBackwardRequest protobuf") from None
        model_id = msg.model_id
        key, req, refused = await door.in_run_order(user_id, model_id, msg.seq_id)
        if refused:
            return refused
        op = "forward" if msg.forward_only else "forward_backward"
        try:
            req.update(data=decode_datums(msg), loss_fn=msg.loss_fn or "cross_entropy", loss_fn_config=loss_config(msg))
        except ServiceError as exc:  # the run and seq are known: it still takes its place
            return {"request_id": door.submit(user_id, op, req, key, refusal=exc), "model_id": model_id}
        return {"request_id": door.submit(user_id, op, req, key), "model_id": model_id}

    @r.post("/optim_step")
    async def optim_step(body: _Body, request: Request) -> dict:
        user_id, b = user(request), body.model_dump()
        model_id, params = need(b, "model_id"), b.get("adam_params")
        key, req, refused = await door.in_run_order(user_id, model_id, b.get("seq_id"))
        if refused:
            return refused
        if params is None:  # refused, but in its place in the run's order
            refusal = ServiceError("validation", "optim_step: TRIO supports AdamW only (adam_params); "
                                   f"got {sorted(k for k in b if k.endswith('params'))}")
            return {"request_id": door.submit(user_id, "optim_step", req, key, refusal), "model_id": model_id}
        req["adam_params"] = {k: v for k, v in params.items() if k != "type"}
        return {"request_id": door.submit(user_id, "optim_step", req, key), "model_id": model_id}

    # -- checkpoints ---------------------------------------------------------------------

    @r.post("/save_weights")
    async def save_weights(body: _Body, request: Request) -> dict:
        return await _save(body.model_dump(), user(request), "weights")

    @r.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(body: _Body, request: Request) -> dict:
        return await _save(body.model_dump(), user(request), "sampler_weights")

    @r.post("/save_weights_external")
    async def save_weights_external(body: _Body, request: Request) -> dict:
        """Refused with where to go instead (a bare 404 told the cookbook's
        ``weights.download`` nothing), in its place in the run's order."""
        user_id, b = user(request), body.model_dump()
        model_id = need(b, "model_id")
        key, req, refused = await door.in_run_order(user_id, model_id, b.get("seq_id"))
        if refused:
            return refused
        refusal = ServiceError("validation", EXTERNAL_WEIGHTS_REFUSAL)
        return {"request_id": door.submit(user_id, "save_weights", req, key, refusal), "model_id": model_id}

    @r.get("/training_runs/{training_run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    def external_weights_urls(request: Request) -> dict:
        user(request)
        raise ServiceError("validation", EXTERNAL_WEIGHTS_REFUSAL)

    async def _save(b: dict, user_id: str, kind: str) -> dict:
        model_id = need(b, "model_id")
        key, req, refused = await door.in_run_order(user_id, model_id, b.get("seq_id"))
        if refused:
            return refused
        # Unnamed sampler weights (only for a sampling session) are the core's ephemeral
        # kind: never listed, removed at restart and beyond the run's quota.
        name = b.get("path") or None
        if name is None and kind == "sampler_weights":
            kind = "ephemeral"
        req.update(name=name, kind=kind, overwrite=bool(b.get("overwrite")),
                   ttl_seconds=b.get("ttl_seconds"), user_metadata=b.get("user_metadata"))
        rid = door.submit(user_id, "save_weights", req, key)
        session_seq = b.get("sampling_session_seq_id")
        if kind == "weights" or session_seq is None:
            return {"request_id": rid, "model_id": model_id}

        async def then_sample() -> Reply:  # save, then open the sampling session on it
            saved = json.loads((await door.wait(user_id, rid)).result_json or "{}")
            sampling_session_id = f"{session_of(model_id)}:sample:{session_seq}"
            await door.open_sampler(user_id, sampling_session_id, {"model_path": saved["path"]}, wait_for_room=True)
            reply: dict[str, Any] = {"sampling_session_id": sampling_session_id, "type": "save_weights_for_sampler"}
            if b.get("path"):
                reply["path"] = to_tinker_path(saved["path"])
            return Reply.json(reply)

        return {"request_id": door.local_future(user_id, then_sample(), key), "model_id": model_id}

    @r.post("/load_weights")
    async def load_weights(body: _Body, request: Request) -> dict:
        user_id, b = user(request), body.model_dump()
        path = to_trio_path(b.get("path") or "")
        if b.get("session_id") is not None:  # a new training client from a checkpoint (its seq 0)
            door.check_session(user_id, need(b, "session_id"))
            model_id = f"{need(b, 'session_id')}:train:{need(b, 'model_seq_id')}"
            metadata = _user_metadata(b)
            if refusal := _not_adamw(b) or _other_base_model(core, user_id, path, b.get("base_model")):
                return {"request_id": door.local_future(user_id, door._raise(refusal)), "model_id": model_id}
            rid = door.submit(user_id, "create_model_from_state", {"path": path, "with_optimizer": bool(b.get("optimizer"))},
                              f"tinker:{model_id}:create")
            door.remember(model_id, user_id, rid, metadata)
            return {"request_id": rid, "model_id": model_id}
        model_id = b.get("model_id") or ""
        key, req, refused = await door.in_run_order(user_id, model_id, b.get("seq_id"))
        if refused:
            return refused
        req.update(path=path, with_optimizer=bool(b.get("optimizer")))
        return {"request_id": door.submit(user_id, "load_weights", req, key), "model_id": model_id}

    # -- sampling ------------------------------------------------------------------------

    @r.post("/create_sampling_session")
    async def create_sampling_session(body: _Body, request: Request) -> dict:
        user_id, b = user(request), body.model_dump()
        door.check_session(user_id, need(b, "session_id"))
        sampling_session_id = f"{need(b, 'session_id')}:sample:{need(b, 'sampling_session_seq_id')}"
        source = ({"model_path": to_trio_path(need(b, "model_path"))} if b.get("model_path")
                  else {"base_model": b.get("base_model")})
        await door.open_sampler(user_id, sampling_session_id, source)
        return {"sampling_session_id": sampling_session_id, "type": "create_sampling_session"}

    @r.get("/samplers/{sampling_session_id}")
    async def get_sampler(sampling_session_id: str, request: Request) -> dict:
        user_id = user(request)
        sampler_id = await door.core_id(user_id, sampling_session_id, "sampling session")
        row = core.store.get(samplers_table, sampler_id=sampler_id)
        if row is None or row["user_id"] != user_id:
            raise not_found(f"sampling session {sampling_session_id!r}")
        return {"sampler_id": sampling_session_id, "base_model": row["base_model"],
                "model_path": to_tinker_path(row["model_path"])}

    @r.post("/asample")
    async def asample(body: _Body, request: Request) -> dict:
        user_id, b = user(request), body.model_dump()
        n = 1 if b.get("num_samples") is None else int(b["num_samples"])  # 0 is refused, not taken as 1
        ssid, seq_id = b.get("sampling_session_id"), b.get("seq_id")
        key = f"tinker:{ssid}:{seq_id}" if ssid and seq_id is not None else None
        try:
            if not 1 <= n <= MAX_NUM_SAMPLES:  # before anything is built per sample
                raise ServiceError("validation", f"num_samples: must be in [1, {MAX_NUM_SAMPLES}], got {n}")
            if not ssid:
                raise ServiceError("validation", "asample: TRIO needs a sampling_session_id "
                                   "(create_sampling_client / save_weights_and_get_sampling_client)")
            for option in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
                if b.get(option):
                    raise ServiceError("validation", f"{option}: not supported by TRIO (only 0)")
            if b.get("record_stability_info"):  # refused at the first sample, not after a batch of them
                raise ServiceError("validation", "record_stability_info: TRIO keeps no StableReinforce records "
                                   "(it has no stable_reinforce loss); sample without them and train with "
                                   "importance_sampling, ppo or cispo (the cookbook: loss_fn=...), or gspo where "
                                   "each datum has a sequence_ratio_mask (as the cookbook's rl_loop sends)")
            if b.get("target_prompt_logprobs") is not None or b.get("prompt_logprobs_last_n") is not None:
                raise ServiceError("validation", "target_prompt_logprobs / prompt_logprobs_last_n: not supported by TRIO")
            sampler_id = await door.core_id(user_id, ssid, "sampling session")
            tokens = []
            for i, chunk in enumerate((b.get("prompt") or {}).get("chunks") or []):
                if chunk.get("type", "encoded_text") != "encoded_text":
                    raise ServiceError("validation", f"prompt.chunks[{i}]: {chunk.get('type')} chunks are not supported by TRIO")
                tokens.extend(chunk["tokens"])
            p = dict(b.get("sampling_params") or {})
            params = {k: p[k] for k in ("temperature", "top_k", "top_p", "seed", "stop", "max_tokens")
                      if p.get(k) is not None}
            if "max_tokens" not in params:  # the SDK's default: what the model's context leaves
                params["max_tokens"] = max(1, await door.context_of_sampler(sampler_id) - len(tokens))
            req = {"sampler_id": sampler_id, "prompt": {"chunks": [{"tokens": tokens}]}, "num_samples": n,
                   "sampling_params": params, "include_prompt_logprobs": bool(b.get("prompt_logprobs"))}
            rid = door.submit(user_id, "sample", req, key)
        except ServiceError as exc:
            if exc.category in ("authentication", "capacity"):
                raise  # a 429 the SDK waits out and resends (door.submit)
            rid, n = door.local_future(user_id, door._raise(exc), key), 0  # refused: no sequences
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}

    # -- futures -------------------------------------------------------------------------

    @r.post("/retrieve_future")
    async def retrieve_future(body: RetrieveBody, request: Request) -> Response:
        return await door.retrieve(user(request), body.request_id)

    # -- REST ----------------------------------------------------------------------------

    async def run_id_of(user_id: str, training_run_id: str) -> str:
        return await door.core_id(user_id, training_run_id, "training run")

    @r.get("/sessions")
    def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> dict:
        rows = core.store.select(sessions_table, order_by="created_at", user_id=user(request))
        return {"sessions": [row["session_id"] for row in rows][offset:offset + limit]}

    @r.get("/sessions/{session_id}")
    def get_session(session_id: str, request: Request) -> dict:
        """The session's training runs (their run ids, as the REST routes take) and samplers."""
        user_id = user(request)
        door.check_session(user_id, session_id)
        ids: dict[str, list[str]] = {"train": [], "sample": []}
        for row in door.store.select(ids_table, order_by="created_at", user_id=user_id):
            session, kind, _ = row["tinker_id"].rsplit(":", 2)
            if session == session_id:
                ids[kind].append(row["core_id"] or row["tinker_id"])  # the core id once it is known
        return {"training_run_ids": ids["train"], "sampler_ids": ids["sample"]}

    @r.api_route("/training_runs/{training_run_id}/checkpoints/{kind}/{name}/publish", methods=["POST", "DELETE"])
    def publish(request: Request) -> dict:
        user(request)
        raise ServiceError("validation", "publishing checkpoints is not supported by TRIO: a checkpoint is its "
                           "owner's alone (download it with pytrio's download_checkpoint_archive to share it)")

    @r.get("/training_runs")
    def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
        user_id = user(request)
        runs = [_tinker_run(core, door, user_id, run) for run in core.list_runs(user_id)]
        page, cursor = _page(runs, limit, offset)
        return {"training_runs": page, "cursor": cursor}

    @r.get("/training_runs/{training_run_id}")
    async def get_training_run(training_run_id: str, request: Request) -> dict:
        user_id = user(request)
        run = await asyncio.to_thread(core.get_run, user_id, await run_id_of(user_id, training_run_id))
        return _tinker_run(core, door, user_id, run)

    @r.get("/training_runs/{training_run_id}/checkpoints")
    async def run_checkpoints(training_run_id: str, request: Request) -> dict:
        user_id = user(request)
        run_id = await run_id_of(user_id, training_run_id)
        checkpoints = await asyncio.to_thread(core.list_checkpoints, user_id, run_id)  # may remove expired ones
        return {"checkpoints": [_tinker_checkpoint(c) for c in checkpoints]}

    @r.get("/checkpoints")
    def user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
        user_id = user(request)
        page, cursor = _page([_tinker_checkpoint(c) for c in core.list_checkpoints(user_id)], limit, offset)
        return {"checkpoints": page, "cursor": cursor}

    @r.delete("/training_runs/{training_run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(training_run_id: str, kind: str, name: str, request: Request) -> Response:
        user_id = user(request)
        run_id = await run_id_of(user_id, training_run_id)
        await asyncio.to_thread(core.delete_checkpoint, user_id, f"trio://{run_id}/{kind}/{name}")
        return Response(status_code=204)

    @r.put("/training_runs/{training_run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_checkpoint_ttl(training_run_id: str, kind: str, name: str, body: _Body, request: Request) -> dict:
        user_id = user(request)
        run_id = await run_id_of(user_id, training_run_id)
        path = f"trio://{run_id}/{kind}/{name}"
        checkpoint = await asyncio.to_thread(core.set_checkpoint_ttl, user_id, path, body.model_dump())
        return _tinker_checkpoint(checkpoint)

    @r.post("/weights_info")
    async def weights_info(body: _Body, request: Request) -> dict:
        user_id, b = user(request), body.model_dump()
        path = to_trio_path(b.get("tinker_path") or "")
        checkpoint = core.checkpoint_row(user_id, path)
        run = core.store.get(runs_table, run_id=checkpoint["run_id"])
        # the checkpoint's own config: the run's may have changed since (a load of another rank)
        folder = core.checkpoint_dir(checkpoint["run_id"], checkpoint["kind"], checkpoint["name"])
        try:
            lora = await asyncio.to_thread(saved_lora_config, folder)
        except (OSError, InvalidInputError, KeyError, ValueError) as exc:
            raise ServiceError("validation", f"{to_tinker_path(path)}: its LoRA config cannot be read ({exc})") from exc
        return {"base_model": run["base_model"] if run else "", "is_lora": True, "lora_rank": lora.rank,
                "train_unembed": lora.train_unembed, "train_mlp": lora.train_mlp, "train_attn": lora.train_attn}

    @r.api_route("/{route:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    def not_served(route: str, request: Request) -> dict:
        """Last: what no route above takes (tinker's billing, audit log, storage usage,
        session search, projects and trace export, copy_weights, ...) is named as not
        served, where it got a bare 404 or 405."""
        user(request)
        # a fixed path served with other methods is a 405, as it was without this route; a
        # templated one may be tinker's fixed path not served (POST sessions/search)
        allowed = sorted({method for served in r.routes if isinstance(served, APIRoute) and not served.param_convertors
                          and served.path_regex.match(f"/api/v1/{route}") for method in served.methods or ()})
        if allowed:
            raise ServiceError("validation", f"{request.method} /api/v1/{route}: this route takes "
                               f"{', '.join(allowed)}", 405, headers={"Allow": ", ".join(allowed)})
        raise ServiceError("not_found", f"{request.method} /api/v1/{route}: this part of the tinker API is not served "
                           "by TRIO (its README lists what is)", 404)

    return r

