"""The HTTP shell over ServiceCore: routes move bytes, the core decides.

    POST /api/v1/<op>                 submit; answers {"request_id"} at once
    POST /api/v1/retrieve_future      long poll (<= 30 s): done | failed | pending
    GET  /api/v1/healthz              no key needed
    GET  /api/v1/capabilities, /tokenizer, /runs, /runs/{id}, /checkpoints
    GET  /api/v1/runs/{id}/metrics    the run's steps: [{step, metrics}]
    POST /api/v1/runs/{id}/metrics    {step | null, metrics: {name: value}}: a client's own
    GET  /api/v1/usage                the caller's tokens trained/prefilled/sampled, per run, and budget
    GET  /api/v1/runs/{id}/usage      one run's tokens
    /tinker/api/v1/...                the tinker SDK's routes (tinker_api.py)
    /openai/v1/...                    OpenAI-compatible chat, completions, models (openai_api.py)
    DELETE /api/v1/checkpoints?path=  GET /api/v1/checkpoints/archive?path= (ranges)
    GET  /console                     the web console (static; its calls carry the key)

Errors are ``{"error": {"category", "message"}}`` with a 4xx/5xx status; malformed
JSON and wrong types get a 4xx naming the field, never a 500. A submit past a queue
bound is a 429 with ``Retry-After`` (``Limits.max_pending_*``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pytrio import types as t
from pytrio.errors import describe_validation_error

from .auth import authenticate
from .core import ServiceCore, ServiceError

log = logging.getLogger("trio.server")

# A request body's bound: per token of the largest request allowed (Limits.max_tokens_per_request),
# about twice what one needs (a ppo batch of 131,072 tokens, five numbers each, is 60 bytes a
# token: 7.5 MiB), and at least 1 MiB. A body is parsed into Python objects on the event loop
# before any limit of the request is checked: 2.4 s for 16 MiB of one-digit numbers here
# (64 MiB, the bound before, stalled every tenant's calls 9 s and took 1.3 GB).
BODY_BYTES_PER_TOKEN = 128
PUBLIC_PATHS = {"/api/v1/healthz"}
CONSOLE_DIR = Path(__file__).parent / "console"
CONSOLE_FILES = {"": "index.html", "console.js": "console.js", "console.css": "console.css"}
# The console loads nothing from elsewhere; this keeps it so (and any injected script out).
CONSOLE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; "
                   "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
                   "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def create_app(core: ServiceCore, auth: bool = True, max_body_bytes: int | None = None) -> FastAPI:
    """The service's HTTP app. ``max_body_bytes``: None, ``BODY_BYTES_PER_TOKEN`` per token of
    the core's ``max_tokens_per_request`` (16 MiB by default)."""
    if max_body_bytes is None:
        max_body_bytes = max(1 << 20, BODY_BYTES_PER_TOKEN * core.limits.max_tokens_per_request)
    app = FastAPI(title="TRIO", version="0.1.0", description="Post-training service: LoRA training and sampling.")
    app.state.core = core

    def user(request: Request) -> str:
        return request.state.user_id  # set by the middleware, before any body is parsed

    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return _error(exc.status, exc.category, exc.message, exc.reply_headers())

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error(400, "validation", f"malformed JSON: {errors[0].get('ctx', {}).get('error', '')}")
        return _error(422, "validation", describe_validation_error(exc))

    @app.middleware("http")
    async def limit_and_log(request: Request, call_next: Any) -> Response:
        started = time.monotonic()
        if request.url.path.startswith("/api/") and request.url.path not in PUBLIC_PATHS:
            try:
                request.state.user_id = authenticate(core.store, request, auth)
            except ServiceError as exc:
                return _error(exc.status, exc.category, exc.message)
        response = await call_next(request)
        log.info("%s %s %d %.0fms", request.method, request.url.path, response.status_code,
                 (time.monotonic() - started) * 1000)
        return response

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # added last: outside limit_and_log

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    for op, (request_model, _) in t.OPERATIONS.items():
        _add_submit_route(app, core, op, request_model, user)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(body: t.RetrieveFutureRequest, request: Request) -> Response:
        outcome = await core.retrieve(user(request), body.request_id, body.timeout)
        return Response(outcome.to_json(body.request_id), media_type="application/json")

    @app.get("/api/v1/capabilities")
    async def capabilities() -> t.ServerCapabilities:
        return core.capabilities()

    @app.get("/api/v1/tokenizer")
    def tokenizer(base_model: str) -> t.TokenizerFiles:
        return core.tokenizer_files(base_model)

    # Runs and checkpoints go out without their unset (None) fields: an SDK from before a
    # field was added (checkpoints' expires_at, user_metadata) refuses fields it does not know.
    @app.get("/api/v1/runs", response_model_exclude_none=True)
    def list_runs(request: Request) -> list[t.TrainingRun]:
        return core.list_runs(user(request))

    @app.get("/api/v1/runs/{run_id}", response_model_exclude_none=True)
    def get_run(run_id: str, request: Request) -> t.TrainingRun:
        return core.get_run(user(request), run_id)

    @app.get("/api/v1/runs/{run_id}/metrics")
    def run_metrics(run_id: str, request: Request) -> list[t.StepMetrics]:
        return core.run_metrics(user(request), run_id)

    @app.post("/api/v1/runs/{run_id}/metrics")
    def log_metrics(run_id: str, body: t.LogMetricsRequest, request: Request) -> t.LogMetricsResponse:
        return core.log_metrics(user(request), run_id, body)

    @app.get("/api/v1/usage")
    def usage(request: Request) -> t.Usage:
        return core.usage(user(request))

    @app.get("/api/v1/runs/{run_id}/usage")
    def run_usage(run_id: str, request: Request) -> t.RunUsage:
        return core.run_usage(user(request), run_id)

    @app.get("/api/v1/checkpoints", response_model_exclude_none=True)
    def list_checkpoints(request: Request, run_id: str | None = None) -> list[t.Checkpoint]:
        return core.list_checkpoints(user(request), run_id)

    @app.delete("/api/v1/checkpoints")
    def delete_checkpoint(path: str, request: Request) -> dict[str, str]:
        core.delete_checkpoint(user(request), path)
        return {"deleted": path}

    @app.put("/api/v1/checkpoints/ttl", response_model_exclude_none=True)
    def set_checkpoint_ttl(path: str, body: t.CheckpointTTL, request: Request) -> t.Checkpoint:
        return core.set_checkpoint_ttl(user(request), path, body)

    @app.get("/api/v1/checkpoints/archive")
    def checkpoint_archive(path: str, request: Request) -> FileResponse:
        link, name = core.checkpoint_archive(user(request), path)
        return _LinkResponse(link, media_type="application/x-tar", filename=name)

    @app.get("/console", include_in_schema=False)
    @app.get("/console/{name}", include_in_schema=False)
    def console(name: str = "") -> FileResponse:
        """The web console's files: static, so no key is needed to load them."""
        if name not in CONSOLE_FILES:
            raise ServiceError("not_found", f"console file {name!r} not found", 404)
        return FileResponse(CONSOLE_DIR / CONSOLE_FILES[name], headers=CONSOLE_HEADERS)

    from .openai_api import create_router as openai_router  # OpenAI-compatible inference, same core
    from .tinker_api import create_router  # the tinker 0.38 wire protocol, over the same core

    app.include_router(create_router(core, auth), prefix="/tinker")
    app.include_router(openai_router(core, auth), prefix="/openai")
    return app


def _add_submit_route(app: FastAPI, core: ServiceCore, op: str, model: type[BaseModel], user: Any) -> None:
    async def submit(body: model, request: Request) -> t.SubmitResponse:  # type: ignore[valid-type]
        request_id = core.submit(user(request), op, body, request.headers.get("idempotency-key"))
        return t.SubmitResponse(request_id=request_id)

    submit.__name__ = f"submit_{op}"
    submit.__annotations__["body"] = model  # a real class, not the postponed string
    submit.__annotations__["request"] = Request
    app.post(f"/api/v1/{op}", summary=f"Submit {op}", response_model=t.SubmitResponse)(submit)


class _LinkResponse(FileResponse):
    """A file served from a link of the response's own (``checkpoints.served_link``), which
    goes once the response ends, sent whole or not: a download cut short must not keep a
    deleted checkpoint's archive on disk."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            Path(self.path).unlink(missing_ok=True)


class BodyLimit:
    """ASGI middleware: a request body is at most ``max_bytes``, however it is sent.

    A ``Content-Length`` over the limit is refused before the body is read. A chunked
    body is counted as it streams through ``receive``: the moment it crosses the limit
    the client gets 413, the route sees a disconnect (so it stops reading), and whatever
    the route answers after that is dropped. At most one chunk past the limit is ever
    held in memory.
    """

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, f"{int(length)} bytes")
        seen, refused = 0, False

        async def counted() -> dict:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if seen > self.max_bytes:
                refused = True
                await self._refuse(send, f"more than {self.max_bytes} bytes (chunked)")
                return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: dict) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, unless_refused)

    async def _refuse(self, send: Any, size: str) -> None:
        # seq_unused: the call's body (its seq included) was never read, so its place in the
        # run's order is still free; the SDK gives it to the run's next call
        body = _error(413, "validation", f"request body: {size} exceeds the limit of {self.max_bytes} bytes",
                      seq_unused=True).body
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _error(status: int, category: str, message: str, headers: dict[str, str] | None = None,
           seq_unused: bool = False) -> JSONResponse:
    error: dict[str, Any] = {"category": category, "message": message}
    if seq_unused:
        error["seq_unused"] = True
    return JSONResponse({"error": error}, status_code=status, headers=headers)
