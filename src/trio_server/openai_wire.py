"""The OpenAI wire format, translated to and from the core's sampling. No I/O.

Request bodies are parsed leniently (unknown fields are ignored, as OpenAI clients send
extras) but every parameter TRIO does not implement must have its neutral value, else
the call is refused with a 400 naming it. Results are built from the core's
``SampledSequence`` dicts: the text is detokenized incrementally (``detokenize``), so a
character split across tokens arrives whole with the token that completes it, and a
stop sequence and everything after it is cut off, as OpenAI does. Logprobs are the
sampled tokens' own (under the model at temperature 1, the trainer's numerics); TRIO has
no top-k alternatives and never makes them up.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from pytrio.types import NOT_TEXT, Seed, lone_surrogate_at

# -- errors ------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_param(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str, why: str = "") -> OpenAIError:
    message = (f"The model {model!r} does not exist or you do not have access to it"
               + (f": {why}" if why else "") + ". GET /openai/v1/models lists the models you can use.")
    return OpenAIError(404, message, param="model", code="model_not_found")


# -- request bodies ----------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool | None = False


class Message(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None


class Common(_Body):
    """The parameters chat and completions share (OpenAI's names and defaults)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1
    top_p: float | None = Field(None, ge=0, le=1)  # None: 1; 0: only the likeliest token (greedy)
    n: int | None = Field(None, ge=1)  # None: 1
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's sampling extras (the openai client sends them in ``extra_body``)
    top_k: int | None = Field(None, ge=-1)  # None, -1 or 0: off (vLLM's meanings)
    ignore_eos: bool | None = False
    # implemented only at their neutral values (see NEUTRAL)
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatBody(Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens (deprecated by OpenAI)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None  # tool calling's older form
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None


class CompletionBody(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Any = None
    suffix: Any = None
    best_of: int | None = Field(None, ge=1)


NOT_OURS = "TRIO returns the sampled tokens' logprobs only, not top-k alternatives; ask for 0"
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (lambda v: v in (None, 0), "penalties are not implemented; give 0 or leave it out"),
    "frequency_penalty": (lambda v: v in (None, 0), "penalties are not implemented; give 0 or leave it out"),
    "logit_bias": (lambda v: not v, "not implemented; leave it out"),
    "tools": (lambda v: not v, "tool calling is not implemented; leave it out"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calling is not implemented; leave it out"),
    "functions": (lambda v: not v, "function calling is not implemented; leave it out"),
    "function_call": (lambda v: v in (None, "none", "auto"), "function calling is not implemented; leave it out"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is implemented"),
    "audio": (lambda v: v is None, "audio output is not implemented; leave it out"),
    "prediction": (lambda v: v is None, "predicted outputs are not implemented; leave it out"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "only {'type': 'text'} is implemented"),
    "echo": (lambda v: not v, "echo is not implemented; leave it out"),
    "suffix": (lambda v: not v, "suffix (insertion) is not implemented; leave it out"),
    "top_logprobs": (lambda v: not v, NOT_OURS),
}


# vLLM's sampling extras TRIO does not implement (``top_k`` and ``ignore_eos`` it does):
# checked on the raw body, as unknown fields are otherwise ignored, so that a client asking
# for JSON-constrained output or a penalty gets a 400 rather than free text
_LEAVE_OUT = "not implemented; leave it out"
VLLM_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "repetition_penalty": (lambda v: v in (None, 1), "penalties are not implemented; give 1 or leave it out"),
    "length_penalty": (lambda v: v in (None, 1), "penalties are not implemented; give 1 or leave it out"),
    "min_tokens": (lambda v: v in (None, 0), "a minimum length is not implemented; give 0 or leave it out"),
    "min_p": (lambda v: v in (None, 0), "min-p sampling is not implemented; give 0 or leave it out"),
    "use_beam_search": (lambda v: not v, "beam search is not implemented; leave it out"),
    "include_stop_str_in_output": (lambda v: not v, "the stop sequence is always cut off; leave it out"),
    "skip_special_tokens": (lambda v: v in (None, True), "special tokens are always left out of the text"),
    **{name: (lambda v: not v, _LEAVE_OUT) for name in (
        "stop_token_ids", "allowed_token_ids", "bad_words", "logits_processors", "structured_outputs",
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")},
}


def parse(model: type[Common], data: Any, text_checked: bool = False) -> Any:
    """A validated body; a bad field is a 400 naming it (``messages[0].content``).
    ``text_checked``: the caller knows no string in it holds a lone surrogate."""
    if not isinstance(data, dict):
        raise bad_param(None, "the request body must be a JSON object")
    if not text_checked and (where := lone_surrogate_at(data)) is not None:
        raise bad_param(where, f"{where}: {NOT_TEXT}")
    try:
        body = model.model_validate(data)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        param = _param(error["loc"])
        raise bad_param(param, f"{param}: {error['msg']}, got {_short(error.get('input'))}") from None
    _check_neutral(body, data)
    return body


def _param(loc: Iterable[Any]) -> str:
    """``("messages", 0, "content", "str")`` -> ``messages[0].content`` (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            out += ("." if out else "") + part
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_neutral(body: Common, data: dict) -> None:
    """Refuse a parameter TRIO lacks unless it has its neutral value: OpenAI's from the
    parsed ``body``, vLLM's from the raw ``data`` (the body ignores them)."""
    _refuse_unless_neutral(NEUTRAL, {name: getattr(body, name) for name in NEUTRAL if name in type(body).model_fields})
    if isinstance(body, CompletionBody):
        if body.logprobs:
            raise bad_param("logprobs", f"logprobs: {NOT_OURS} (logprobs=0 gives the sampled tokens' own)")
        if body.best_of not in (None, body.choices):
            raise bad_param("best_of", f"best_of: only best_of == n is implemented; got {body.best_of}")
    if any(s == "" for s in body.stops):
        raise bad_param("stop", "stop: an empty string would stop at once; give non-empty strings")
    _refuse_unless_neutral(VLLM_NEUTRAL, {name: data.get(name) for name in VLLM_NEUTRAL})


def _refuse_unless_neutral(rules: dict[str, tuple[Callable[[Any], bool], str]], given: dict[str, Any]) -> None:
    for name, value in given.items():
        neutral, why = rules[name]
        if not neutral(value):
            raise bad_param(name, f"{name}: {why}; got {_short(value)}")


def check_limits(body: Common, max_samples: int) -> None:
    if body.choices > max_samples:
        raise bad_param("n", f"n: {body.choices} exceeds this server's limit of {max_samples}")


def max_tokens(asked: int | None, param: str, prompt_len: int, context: int, default: int,
               prompt_param: str) -> int:
    """How many tokens to sample: ``asked``, else ``default``, within the model's context."""
    room = context - prompt_len
    if room < 1:
        raise bad_param(prompt_param, f"{prompt_param}: {prompt_len} tokens leave no room in this model's "
                        f"context of {context} tokens", "context_length_exceeded")
    if asked is None:
        return min(default, room)
    if asked > room:
        raise bad_param(param, f"{param}: {prompt_len} prompt tokens + {asked} exceed this model's context of "
                        f"{context} tokens (at most {room} here)", "context_length_exceeded")
    return asked


def sampling_params(body: Common, max_new: int, stops: list[str]) -> dict:
    """The core's SamplingParams. ``stops`` None (not []): EOS must still end a sequence."""
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0:  # OpenAI allows it: the smallest set of tokens holding mass 0 is the likeliest one
        temperature, top_p = 0.0, 1.0
    top_k = -1 if body.top_k is None else body.top_k  # 0 is off in the sampler too
    return {"max_tokens": max_new, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": body.seed,
            "stop": stops or None, "ignore_eos": bool(body.ignore_eos)}


# -- the tokenizer's side ----------------------------------------------------------------


@dataclass(frozen=True)
class Codec:
    """A base model's tokenizer, with what the door derives from it once."""

    tokenizer: Any
    special: frozenset[int]
    end_of_turn: str | None  # a stop for chats when the template's end of turn is not EOS
    byte_level: bool  # tokens are GPT-2 byte-level strings

    @classmethod
    def of(cls, tokenizer: Any) -> Codec:
        eot = end_of_turn(tokenizer)
        extra = None if eot is None or eot == tokenizer.eos_token_id else tokenizer.convert_ids_to_tokens(eot)
        decoder = tokenizer.backend_tokenizer.decoder
        return cls(tokenizer, frozenset(tokenizer.all_special_ids), extra,
                   type(decoder).__name__ == "ByteLevel")

    def chat_stops(self, stops: list[str], ignore_eos: bool = False) -> list[str]:
        """The sampler stops at EOS; a template whose turn ends otherwise needs that token
        too, unless ``ignore_eos`` runs through the turn's end as well."""
        return [*stops, self.end_of_turn] if self.end_of_turn and not ignore_eos else stops


def end_of_turn(tokenizer: Any) -> int | None:
    """The special token the chat template closes an assistant turn with, if any."""
    mark = "TRIO-END-OF-TURN-PROBE"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": mark}], tokenize=False)
    except Exception:  # no template, or one that refuses this conversation
        return None
    if mark not in text:
        return None
    ids = tokenizer.encode(text.split(mark, 1)[1].lstrip(), add_special_tokens=False)
    return ids[0] if ids and ids[0] in tokenizer.all_special_ids else None


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_prompt(tokenizer: Any, messages: list[Message]) -> list[int]:
    """The conversation through the model's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_param("messages", "messages: this model has no chat template; use /v1/completions")
    if not messages:
        raise bad_param("messages", "messages: must not be empty")
    turns = [{"role": _role(i, m), "content": _content(i, m)} for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own checks, e.g. roles that must alternate
        raise bad_param("messages", f"messages: the model's chat template refused them: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=False)  # the template wrote any BOS itself


def _role(i: int, m: Message) -> str:
    if m.role not in ROLES:
        raise bad_param(f"messages[{i}].role", f"messages[{i}].role: {m.role!r} is not one of "
                        f"{sorted(ROLES)} (tool calling is not implemented)")
    if m.tool_calls:
        raise bad_param(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: tool calling is not implemented")
    return ROLES[m.role]


def _content(i: int, m: Message) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_param(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}]: only text parts "
                            f"are implemented, got type {part.get('type')!r}")
        texts.append(part["text"])
    return "".join(texts)


def completion_prompts(tokenizer: Any, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Each prompt's tokens: strings are encoded as a plain tokenizer call does (with the
    model's BOS, if it adds one); token lists are used as they are."""
    many: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not many:
        raise bad_param("prompt", "prompt: must not be empty")
    out = []
    for i, p in enumerate(many):
        tokens = tokenizer.encode(p) if isinstance(p, str) else list(p)
        where = "prompt" if len(many) == 1 else f"prompt[{i}]"
        if not tokens:
            raise bad_param(where, f"{where}: must not be empty (TRIO needs at least one token)")
        if not all(0 <= t < len(tokenizer) for t in tokens):
            raise bad_param(where, f"{where}: token ids must be in [0, {len(tokenizer)})")
        out.append(tokens)
    return out


def detokenize(tokenizer: Any, tokens: list[int]) -> list[str]:
    """Each token's piece of the text: ``""`` while it holds only part of a character (the
    piece arrives with the token that completes it); ``"".join`` is the decoded text.

    Decodes a short window per token (from the last completed piece), not the whole prefix.
    """
    pieces, start, read = [], 0, 0
    for i in range(len(tokens)):
        before = tokenizer.decode(tokens[start:read], skip_special_tokens=True)
        text = tokenizer.decode(tokens[start:i + 1], skip_special_tokens=True)
        if len(text) > len(before) and (not text.endswith("\ufffd") or i == len(tokens) - 1):
            pieces.append(text[len(before):])
            start, read = read, i + 1
        else:
            pieces.append("")
    return pieces


def token_bytes(codec: Codec, token: int) -> bytes:
    """A token's own bytes (part of a character, maybe)."""
    tok = codec.tokenizer
    piece = tok.convert_ids_to_tokens(token)
    if codec.byte_level and token not in tok.added_tokens_decoder:
        return bytes(BYTE_DECODER[c] for c in piece if c in BYTE_DECODER)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece byte fallback
        return bytes([int(piece[3:5], 16)])
    return tok.decode([token]).encode()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte is one printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


BYTE_DECODER = _byte_decoder()


def token_string(raw: bytes) -> str:
    """The token's text, or ``bytes:\\xNN...`` for part of a character (OpenAI's convention)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


# -- results -----------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


@dataclass
class Piece:
    """Text that one or more tokens complete (one token, unless a character spans several)."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    offset: int  # where ``text`` starts in the choice's text


@dataclass
class Choice:
    pieces: list[Piece]
    finish_reason: FinishReason
    sampled: int  # every token sampled (an end-of-turn token too): the usage count

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


def choice_of(codec: Codec, seq: dict, stops: list[str]) -> Choice:
    """A core SampledSequence as an OpenAI choice: the end-of-turn token dropped (it is not
    text), the text cut before the first stop sequence."""
    tokens, logprobs = list(seq["tokens"]), list(seq["logprobs"])
    if seq["stop_reason"] == "stop" and tokens and tokens[-1] in codec.special:
        tokens, logprobs = tokens[:-1], logprobs[:-1]
    texts = detokenize(codec.tokenizer, tokens)
    full = "".join(texts)
    cuts = [full.find(s) for s in stops if s in full]
    pieces = _pieces(tokens, logprobs, texts, min(cuts) if cuts else None)
    return Choice(pieces, "stop" if seq["stop_reason"] == "stop" else "length", len(seq["tokens"]))


def _pieces(tokens: list[int], logprobs: list[float], texts: list[str], cut: int | None) -> list[Piece]:
    pieces: list[Piece] = []
    held: list[tuple[int, float]] = []
    pos = 0
    for token, logprob, text in zip(tokens, logprobs, texts):
        if cut is not None and pos >= cut:
            break  # the stop sequence and what follows are not returned
        held.append((token, logprob))
        if text:
            text = text if cut is None else text[:cut - pos]
            pieces.append(Piece(text, [t for t, _ in held], [lp for _, lp in held], pos))
            held, pos = [], pos + len(text)
    if held:
        pieces.append(Piece("", [t for t, _ in held], [lp for _, lp in held], pos))
    return pieces


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(c.sampled for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


@dataclass
class Head:
    """What every object of one reply repeats."""

    id: str
    created: int
    model: str

    def of(self, obj: str, **fields: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, **fields}


def chat_logprobs(codec: Codec, pieces: list[Piece]) -> dict:
    content = []
    for piece in pieces:
        for token, logprob in zip(piece.tokens, piece.logprobs):
            raw = token_bytes(codec, token)
            content.append({"token": token_string(raw), "logprob": logprob, "bytes": list(raw), "top_logprobs": []})
    return {"content": content, "refusal": None}


def completion_logprobs(codec: Codec, pieces: list[Piece]) -> dict:
    tokens, logprobs, offsets = [], [], []
    for piece in pieces:
        for token, logprob in zip(piece.tokens, piece.logprobs):
            tokens.append(token_string(token_bytes(codec, token)))
            logprobs.append(logprob)
            offsets.append(piece.offset)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def chat_completion(head: Head, codec: Codec, choices: list[Choice], prompt_tokens: int, logprobs: bool) -> dict:
    return head.of("chat.completion", choices=[
        {"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None},
         "logprobs": chat_logprobs(codec, c.pieces) if logprobs else None, "finish_reason": c.finish_reason}
        for i, c in enumerate(choices)], usage=usage(prompt_tokens, choices))


def completion(head: Head, codec: Codec, choices: list[Choice], prompt_tokens: int, logprobs: bool) -> dict:
    return head.of("text_completion", choices=[
        {"index": i, "text": c.text, "logprobs": completion_logprobs(codec, c.pieces) if logprobs else None,
         "finish_reason": c.finish_reason}
        for i, c in enumerate(choices)], usage=usage(prompt_tokens, choices))


def chat_chunks(head: Head, codec: Codec, choices: list[Choice], prompt_tokens: int, logprobs: bool,
                include_usage: bool) -> Iterator[dict]:
    """``chat.completion.chunk`` objects: per choice a role chunk, a chunk per piece, a
    finish chunk; then, if asked, one with the usage and no choices."""
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, delta: dict, lp: dict | None = None, finish: str | None = None) -> dict:
        return head.of("chat.completion.chunk", choices=[
            {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}], **extra)

    for i, c in enumerate(choices):
        yield chunk(i, {"role": "assistant", "content": ""})
        for piece in c.pieces:
            yield chunk(i, {"content": piece.text}, chat_logprobs(codec, [piece]) if logprobs else None)
        yield chunk(i, {}, finish=c.finish_reason)
    if include_usage:
        yield head.of("chat.completion.chunk", choices=[], usage=usage(prompt_tokens, choices))


def completion_chunks(head: Head, codec: Codec, choices: list[Choice], prompt_tokens: int, logprobs: bool,
                      include_usage: bool) -> Iterator[dict]:
    """``text_completion`` chunks: per choice a chunk per piece and a finish chunk; then,
    if asked, one with the usage and no choices."""
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, text: str, lp: dict | None, finish: str | None = None) -> dict:
        return head.of("text_completion", choices=[
            {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}], **extra)

    for i, c in enumerate(choices):
        for piece in c.pieces:
            yield chunk(i, piece.text, completion_logprobs(codec, [piece]) if logprobs else None)
        yield chunk(i, "", None, c.finish_reason)
    if include_usage:
        yield head.of("text_completion", choices=[], usage=usage(prompt_tokens, choices))


def sse(chunks: Iterable[dict]) -> Iterator[str]:
    """Server-sent events: ``data: <json>`` per chunk, then ``data: [DONE]``."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
