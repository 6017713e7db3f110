"""The OpenAI door: OpenAI-compatible inference on ``trio serve``, over the same core.

Mounted at ``/openai`` (clients set ``base_url=http://HOST:PORT/openai/v1`` and
``api_key=<TRIO key>``). Like the tinker door (tinker_api.py) it only translates: each
call becomes the core's own ``create_sampler`` and ``sample`` requests, so a chat request
shares decode batches with RL rollouts and everything else the core schedules; there is
no second inference path. Pure translation lives in ``openai_wire``.

    POST /openai/v1/chat/completions   messages through the model's chat template
    POST /openai/v1/completions        prompt: a string, strings, token ids, or lists of them
    GET  /openai/v1/models             the base models served here + your sampler checkpoints
    GET  /openai/v1/models/{model}

- ``model``: a base model of ``GET /models``, or your ``trio://<run>/sampler_weights/<name>``
  checkpoint (its ``tinker://`` twin too). Another user's checkpoint is a 404, exactly like
  an unknown one. The door keeps one core sampler per (user, model), in a bounded LRU map;
  a checkpoint deleted meanwhile answers 404 and leaves the map.
- Parameters as OpenAI defines them: ``temperature`` (default 1), ``top_p`` (0: greedy), ``n`` (the
  samples share one prompt prefill), ``stop``, ``seed``, ``max_tokens`` (chat:
  ``max_completion_tokens`` wins). Without one: 16 for completions (OpenAI's default), and
  ``DEFAULT_CHAT_MAX_TOKENS`` for chats; always within the model's context and the
  server's ``max_seq_len`` (more is a 400, ``code: context_length_exceeded``). ``n`` is
  bounded by ``max_samples_per_request``. A chat ends at the template's end of turn (EOS
  for the bundled SmolLM2 and Qwen3 templates; another token is added as a stop).
- Logprobs: chat ``logprobs: true``, completions ``logprobs: 0`` give each returned token's
  log p under the model at temperature 1 (the trainer's numerics). TRIO has no top-k
  alternatives: ``top_logprobs`` > 0 and completions ``logprobs`` > 0 are refused (400).
  ``echo``, ``suffix``, ``tools``, ``functions``, ``response_format``, ``audio``,
  ``prediction``, penalties and ``logit_bias`` are accepted at their neutral values only
  (else a 400: never silently dropped); unknown fields are ignored.
- Several completion prompts are one core request each: all must fit the user's pending
  bounds when the call arrives (else a 429 and none runs; more prompts than
  ``max_pending_per_user`` is a 400).
- ``usage.completion_tokens`` counts every sampled token, an end-of-turn token included
  (it is not in the text or the logprobs). A stop sequence is not returned.
- Streaming (``stream: true``): ``data: {chunk}`` events, one per token (a character split
  across tokens comes whole, with the token that completes it), then ``data: [DONE]``;
  ``stream_options.include_usage`` adds a last chunk with the usage. The core answers a
  sample request once its sequences have ended, so the chunks are sent then, not as the
  tokens are drawn.
- Keys: ``Authorization: Bearer <TRIO key>`` (or ``X-API-Key``), the keys of the rest of the
  API; ``--no-auth`` accepts any. Errors are OpenAI's ``{"error": {message, type, param,
  code}}``: 400 ``invalid_request_error`` naming ``param``, 401, 404 ``model_not_found``,
  500 ``server_error``.
- Tokenization runs here, on the event loop (a chat template is quick): a fast tokenizer
  per base model built from ``core.tokenizer_files`` as the SDK builds it
  (``TokenizerFiles.load``). Detokenizing results runs in a thread.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from . import checkpoints as ckpt
from . import openai_wire as w
from .auth import authenticate
from .core import ServiceCore
from .errors import ServiceError
from .tinker_wire import to_trio_path

log = logging.getLogger("trio.openai")

T = TypeVar("T")
POLL_SECONDS = 30.0
MAX_SAMPLERS = 1024  # (user, model) -> sampler entries kept
DEFAULT_CHAT_MAX_TOKENS = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default


@dataclass(frozen=True)
class Served:
    """A core sampler serving one model to one user."""

    sampler_id: str
    base_model: str


def from_service(exc: ServiceError, model: str | None = None) -> w.OpenAIError:
    """A core error in OpenAI's shape (the one mapping of categories)."""
    if exc.category == "authentication":
        return w.OpenAIError(401, exc.message, code="invalid_api_key")
    if exc.category == "not_found":
        return w.model_not_found(model, exc.message) if model else w.OpenAIError(404, exc.message)
    if exc.category == "validation" and exc.status == 403:  # a quota or token budget: not the body's fault
        return w.OpenAIError(403, exc.message, type="insufficient_quota")
    if exc.category == "validation":
        return w.bad_param(None, exc.message)
    if exc.category == "capacity":
        return w.OpenAIError(429, exc.message, type="rate_limit_error", code="rate_limit_exceeded",
                             headers=exc.reply_headers())
    return w.OpenAIError(500, exc.message, type="server_error")


class OpenAIDoor:
    """Translation state: samplers per (user, model), tokenizers per base model."""

    def __init__(self, core: ServiceCore, auth: bool):
        self.core, self.auth = core, auth
        self.samplers: OrderedDict[tuple[str, str], Served] = OrderedDict()
        self.codecs: dict[str, w.Codec] = {}
        self.making: dict[tuple, asyncio.Future] = {}
        self.started = int(time.time())

    def user(self, request: Request) -> str:
        try:
            return authenticate(self.core.store, request, self.auth)
        except ServiceError as exc:
            raise from_service(exc) from None

    async def _once(self, key: tuple, make: Callable[[], Awaitable[T]]) -> T:
        """One ``make()`` for concurrent callers of the same key (a cancelled caller does
        not cancel it for the others)."""
        future = self.making.get(key)
        if future is None:
            future = self.making[key] = asyncio.ensure_future(make())
            future.add_done_callback(lambda _: self.making.pop(key, None))
        return await asyncio.shield(future)

    # -- models ----------------------------------------------------------------------

    async def served(self, user_id: str, model: str) -> Served:
        """The core sampler for this user's model, created on first use."""
        key = (user_id, to_trio_path(model))
        if key in self.samplers:
            self.samplers.move_to_end(key)
            return self.samplers[key]
        try:
            served = await self._once(("sampler", *key), lambda: self._open(user_id, key[1]))
        except w.OpenAIError as exc:  # name the model as this client wrote it (tinker://, not trio://);
            # a copy: concurrent requests for the same sampler share the exception
            raise w.OpenAIError(exc.status, exc.message.replace(key[1], model), exc.type, exc.param, exc.code,
                                exc.headers) from None
        self.samplers[key] = served
        while len(self.samplers) > MAX_SAMPLERS:
            self.samplers.popitem(last=False)
        return served

    async def _open(self, user_id: str, model: str) -> Served:
        try:
            request_id = self.core.submit(user_id, "create_sampler", self._source(model))
            created = await self._result(user_id, request_id)
        except ServiceError as exc:
            raise from_service(exc, model) from None
        return Served(created["sampler_id"], created["base_model"])

    def _source(self, model: str) -> dict:
        """The create_sampler body for a model name; 404 for what names no servable model."""
        if "://" not in model:
            if model not in self.core.capabilities().supported_models:
                raise w.model_not_found(model)
            return {"base_model": model}
        try:
            _, kind, _ = ckpt.parse_path(model)
        except ServiceError:
            raise w.model_not_found(model, "not a trio://<run>/sampler_weights/<name> path") from None
        if kind != "sampler_weights":
            raise w.model_not_found(model, "only sampler_weights checkpoints can be served")
        return {"model_path": model}

    def models(self, user_id: str) -> list[dict]:
        base = [{"id": m, "object": "model", "created": self.started, "owned_by": "trio"}
                for m in self.core.capabilities().supported_models]
        return base + [{"id": c.path, "object": "model", "created": _unix(c.created_at), "owned_by": user_id}
                       for c in self.core.list_checkpoints(user_id) if c.kind == "sampler_weights"]

    async def codec(self, base_model: str) -> w.Codec:
        if base_model not in self.codecs:
            self.codecs[base_model] = await self._once(("codec", base_model),
                                                       lambda: asyncio.to_thread(self._load_codec, base_model))
        return self.codecs[base_model]

    def _load_codec(self, base_model: str) -> w.Codec:
        files = self.core.tokenizer_files(base_model)
        return w.Codec.of(files.load(self.core.data_dir / "openai" / "tokenizers"))

    async def context(self, base_model: str) -> int:
        # one thread for the callers while the model loads (the core keeps the answer)
        return await self._once(("context", base_model), lambda: asyncio.to_thread(self.core.context_length, base_model))

    # -- sampling --------------------------------------------------------------------

    async def sample(self, user_id: str, model: str, served: Served, prompt: list[int], n: int,
                     params: dict) -> list[dict]:
        """``n`` sequences of one prompt, through the core's batched sampler."""
        body = {"sampler_id": served.sampler_id, "prompt": {"chunks": [{"tokens": prompt}]}, "num_samples": n,
                "sampling_params": params}
        try:
            return (await self._result(user_id, self.core.submit(user_id, "sample", body)))["sequences"]
        except ServiceError as exc:
            if exc.category == "not_found":  # its checkpoint was deleted: forget the sampler
                self.samplers.pop((user_id, to_trio_path(model)), None)
            raise from_service(exc, model) from None

    def _check_room(self, user_id: str, prompts: int) -> None:
        """Each prompt is a core request: all of them fit the pending bounds, or none is sent
        (a 400 if they never could: retrying would not help)."""
        limits = self.core.limits
        limit = min((n for n in (limits.max_pending_per_user, limits.max_pending_total) if n is not None), default=None)
        if limit is not None and prompts > limit:
            raise w.bad_param("prompt", f"prompt: {prompts} prompts in one call, more than the {limit} requests "
                              "that may be pending here; send them in smaller calls")
        try:
            self.core.check_room(user_id, prompts)
        except ServiceError as exc:
            raise from_service(exc) from None

    async def _result(self, user_id: str, request_id: str) -> Any:
        while True:
            outcome = await self.core.retrieve(user_id, request_id, POLL_SECONDS)
            if outcome.status == "done":
                return json.loads(outcome.result_json or "null")
            if outcome.status == "failed":
                error = outcome.error
                raise ServiceError(error.category if error else "server", error.message if error else "failed",
                                   (error.status_code if error else None) or 500)

    async def chat(self, user_id: str, body: w.ChatBody) -> Response:
        w.check_limits(body, self.core.limits.max_samples_per_request)
        served = await self.served(user_id, body.model)
        codec = await self.codec(served.base_model)
        prompt = w.chat_prompt(codec.tokenizer, body.messages)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        new = w.max_tokens(body.max_completion_tokens or body.max_tokens, param, len(prompt),
                           await self.context(served.base_model), DEFAULT_CHAT_MAX_TOKENS, "messages")
        params = w.sampling_params(body, new, codec.chat_stops(body.stops, bool(body.ignore_eos)))
        seqs = await self.sample(user_id, body.model, served, prompt, body.choices, params)
        choices = await asyncio.to_thread(lambda: [w.choice_of(codec, s, body.stops) for s in seqs])
        head = w.Head("chatcmpl-" + secrets.token_hex(12), int(time.time()), body.model)
        if body.stream:
            return _stream(w.chat_chunks(head, codec, choices, len(prompt), bool(body.logprobs), body.include_usage))
        return JSONResponse(w.chat_completion(head, codec, choices, len(prompt), bool(body.logprobs)))

    async def complete(self, user_id: str, body: w.CompletionBody) -> Response:
        w.check_limits(body, self.core.limits.max_samples_per_request)
        served = await self.served(user_id, body.model)
        codec = await self.codec(served.base_model)
        prompts = w.completion_prompts(codec.tokenizer, body.prompt)
        context = await self.context(served.base_model)
        news = [w.max_tokens(body.max_tokens, "max_tokens", len(p), context, DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
                for p in prompts]
        self._check_room(user_id, len(prompts))
        runs = [self.sample(user_id, body.model, served, p, body.choices, w.sampling_params(body, new, body.stops))
                for p, new in zip(prompts, news)]
        seqs = [s for each in await asyncio.gather(*runs) for s in each]  # prompt i's are choices i*n..
        choices = await asyncio.to_thread(lambda: [w.choice_of(codec, s, body.stops) for s in seqs])
        head = w.Head("cmpl-" + secrets.token_hex(12), int(time.time()), body.model)
        logprobs, used = body.logprobs is not None, sum(map(len, prompts))
        if body.stream:
            return _stream(w.completion_chunks(head, codec, choices, used, logprobs, body.include_usage))
        return JSONResponse(w.completion(head, codec, choices, used, logprobs))


def _stream(chunks: Iterator[dict]) -> StreamingResponse:
    return StreamingResponse(w.sse(chunks), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _unix(iso: str) -> int:
    return int(dt.datetime.fromisoformat(iso).timestamp())


async def _body(request: Request, model: type[w.Common]) -> Any:
    raw = await request.body() or b"null"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise w.bad_param(None, f"malformed JSON: {exc}") from None
    # a lone surrogate comes only from a \uD800-\uDFFF escape (UTF-8 cannot carry one):
    # without one in the text, no walk over the value (1.5 s for 8 million numbers)
    return w.parse(model, data, text_checked=_SURROGATE_ESCAPE.search(raw) is None)


_SURROGATE_ESCAPE = re.compile(rb"\\ud[89a-f]", re.IGNORECASE)  # \uD800-\uDFFF escaped in a JSON text


class _OpenAIRoute(APIRoute):
    """Every failure answered in OpenAI's error shape (the app's handlers use TRIO's)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                return await handler(request)
            except w.OpenAIError as exc:
                return JSONResponse(exc.body(), exc.status, headers=exc.headers)
            except ServiceError as exc:
                error = from_service(exc)
                return JSONResponse(error.body(), error.status, headers=error.headers)
            except Exception as exc:
                log.exception("openai route %s failed", request.url.path)
                error = w.OpenAIError(500, f"internal error: {exc}", type="server_error")
                return JSONResponse(error.body(), error.status)

        return answered


def create_router(core: ServiceCore, auth: bool = True) -> APIRouter:
    """The OpenAI routes; the app mounts them under ``/openai``."""
    door = OpenAIDoor(core, auth)
    r = APIRouter(prefix="/v1", route_class=_OpenAIRoute)

    @r.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        user_id = door.user(request)
        return await door.chat(user_id, await _body(request, w.ChatBody))

    @r.post("/completions")
    async def completions(request: Request) -> Response:
        user_id = door.user(request)
        return await door.complete(user_id, await _body(request, w.CompletionBody))

    @r.get("/models")
    async def list_models(request: Request) -> dict:
        return {"object": "list", "data": await asyncio.to_thread(door.models, door.user(request))}

    @r.get("/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict:
        found = [m for m in await asyncio.to_thread(door.models, door.user(request)) if m["id"] == to_trio_path(model)]
        if not found:
            raise w.model_not_found(model)
        return found[0]

    @r.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def unknown(rest: str, request: Request) -> Response:
        """Any other route (embeddings, responses, deleting a model...): a 404 in OpenAI's
        shape, which its clients parse, not the app's ``{"detail": ...}``."""
        raise w.OpenAIError(404, f"Invalid URL ({request.method} /v1/{rest}): not implemented by TRIO",
                            code="unknown_url")

    return r
