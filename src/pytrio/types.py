"""Every type the wire carries: pydantic models shared by the SDK and the server.

User-facing types (``Datum``, ``ModelInput``, ``TensorData``, ``AdamParams``,
``SamplingParams`` and the responses) come first; the request/response envelopes of
the protocol (``*Request``, ``FutureResponse``) follow. No torch here: ``TensorData``
converts to and from torch only when asked, importing it lazily; ``TokenizerFiles``
becomes a tokenizer the same way (transformers, imported when asked).
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
import shutil
from collections.abc import Generator
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    field_validator,
    model_validator,
)

from .errors import ValidationError

# No leading '.', no '..', no trailing newline ($ would allow one): a name is one safe file name.
CHECKPOINT_NAME = re.compile(r"^(?!.*\.\.)[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}\Z")


def lone_surrogate_at(value: Any, where: str = "") -> str | None:
    """Where in a JSON value a string holds a lone UTF-16 surrogate, as ``messages[0].content``
    (None: nowhere). JSON's ``"\\ud800"`` parses to one; it is not text, and no UTF-8 reply
    can carry it (a stored one broke every later listing of its owner's). A walk with a
    stack of its own (a value nested as deep as a parser allows is no error here) that
    holds containers only and names a place only once found: a body of millions of numbers
    costs a pass over them, no more."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return _place(where, path)
            continue
        pairs = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, inner in pairs:
            if isinstance(key, str) and not _is_text(key):
                return _place(where, (*path, key))
            if isinstance(inner, str):
                if not _is_text(inner):
                    return _place(where, (*path, key))
            elif isinstance(inner, dict | list):
                stack.append((inner, (*path, key)))
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _place(where: str, path: tuple) -> str:
    """``where`` + ``path`` as ``messages[0].content``; a key's surrogate as its escape (the
    name goes into a UTF-8 reply)."""
    name = where
    for key in path:
        if isinstance(key, int):
            name += f"[{key}]"
        else:
            shown = key.encode("utf-8", "backslashreplace").decode()
            name = f"{name}.{shown}" if name else shown
    return name or "body"


NOT_TEXT = "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"  # after where (lone_surrogate_at)


def _text(value: str) -> str:
    if not _is_text(value):
        raise ValueError(NOT_TEXT)
    return value


Text = Annotated[str, AfterValidator(_text)]  # a string kept and sent back: Unicode text


INT64_MAX = 2**63 - 1  # the widest integer the store (SQLite, Postgres BIGINT) keeps


class _Model(BaseModel):
    # NaN and infinities go out as the JSON constants Python's json reads back, not as null:
    # a NaN logprob or metric is a value the user must see, and null failed to parse.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=False, ser_json_inf_nan="constants")

    # Not an __init__ that re-raises pydantic's errors as the SDK's: pydantic calls a custom
    # __init__ for every nested model it validates too (a server parsing a body among them),
    # which nests the messages and slows validation. A bad ``Datum(...)`` raises pydantic's
    # ValidationError (a ValueError); every SDK call raises the SDK's.


# --------------------------------------------------------------------------- tensors


DType = Literal["int64", "float32"]

# The dtype of each loss input the losses read, whatever its values look like: the user
# docs write ``weights=[0, 1]`` (ints), and token ids often come out of numpy as floats.
FIELD_DTYPES: dict[str, DType] = {
    "target_tokens": "int64", "weights": "float32", "advantages": "float32", "logprobs": "float32",
}


class TensorData(_Model):
    """A flat list of numbers with a dtype and shape; what ``loss_fn_inputs`` hold.

    ``shape`` (if given) must hold exactly ``len(data)`` elements. Inside a ``Datum`` the
    dtype follows the field (``FIELD_DTYPES``), not the values.
    """

    data: list[float] | list[int]
    dtype: DType = "float32"
    shape: list[int] | None = None

    @model_validator(mode="after")
    def _shape_holds_data(self) -> TensorData:
        check_shape(self)
        return self

    def as_dtype(self, dtype: DType) -> TensorData:
        """This tensor with ``dtype``; int64 refuses a value that is not a whole number."""
        if dtype == "int64":
            bad = next(((k, v) for k, v in enumerate(self.data) if not math.isfinite(v) or v != int(v)), None)
            if bad is not None:
                raise ValueError(f"{bad[1]!r} is not an integer, at index {bad[0]}")
            data: list[float] | list[int] = [int(v) for v in self.data]
        else:
            data = [float(v) for v in self.data]
        return TensorData.model_construct(data=data, dtype=dtype, shape=self.shape)

    def finite(self) -> TensorData:
        """This tensor; raises ValueError naming the first NaN or infinity and its index."""
        if self.dtype == "int64" or math.isfinite(sum(self.data)):  # the sum: one pass in C, the common case
            return self
        bad = next(((k, v) for k, v in enumerate(self.data) if not math.isfinite(v)), None)
        if bad is not None:  # else only the sum overflowed
            raise ValueError(f"contains non-finite value {bad[1]!r} at index {bad[0]}")
        return self

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype: Literal["int64", "float32"] = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        return cls(data=array.reshape(-1).tolist(), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().numpy())

    @classmethod
    def coerce(cls, value: Any) -> TensorData:
        """Lists, numpy arrays, torch tensors or TensorData -> TensorData."""
        if isinstance(value, TensorData):
            return value
        if isinstance(value, dict):
            return cls.model_validate(value)
        if type(value).__module__.startswith("torch"):
            return cls.from_torch(value)
        array = np.asarray(value)
        if array.dtype == object:
            raise ValueError(f"cannot convert {type(value).__name__} to a tensor")
        return cls.from_numpy(array)

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=np.int64 if self.dtype == "int64" else np.float32)
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self) -> Any:
        import torch  # only a user who asks for torch pays for it

        return torch.from_numpy(self.to_numpy())

    def __len__(self) -> int:
        return len(self.data)


def check_shape(tensor: TensorData) -> None:
    if tensor.shape is not None and math.prod(tensor.shape) != len(tensor.data):
        raise ValueError(f"shape {tensor.shape} holds {math.prod(tensor.shape)} elements, "
                         f"but data has {len(tensor.data)}")


def loss_input(name: str, value: Any) -> TensorData:
    """``value`` (list, numpy, torch or TensorData) as the tensor the input ``name`` holds.

    Raises ValueError naming the field and the value.
    """
    try:
        tensor = TensorData.coerce(value)
        check_shape(tensor)  # again: a TensorData may have been built without validation
        # a copy, always: the request must not change when the caller's lists do
        return tensor.as_dtype(FIELD_DTYPES.get(name, tensor.dtype)).finite()
    except (ValueError, TypeError, OverflowError) as exc:  # OverflowError: an int past float's range
        raise ValueError(f"loss_fn_inputs[{name!r}]: {exc}") from None


# --------------------------------------------------------------------------- model input


class EncodedTextChunk(_Model):
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


def _token_id(k: int, token: Any) -> int:
    try:
        value = int(token)
        whole = bool(value == token)
    except (TypeError, ValueError):
        whole = False
    if not whole:
        raise ValidationError(f"tokens[{k}]: {token!r} is not a token id (a whole number)")
    return value


class ModelInput(_Model):
    """A token sequence, as chunks (only encoded text for now)."""

    chunks: list[EncodedTextChunk] = Field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: list[int]) -> ModelInput:
        """Token ids (ints, or numpy / torch integers) as one chunk; anything that is not a
        whole number (``1.5``, ``"3"``) is refused, not rounded."""
        return cls(chunks=[EncodedTextChunk(tokens=[_token_id(k, t) for k, t in enumerate(tokens)])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=[int(token)]))


class Datum(_Model):
    """One training example: the input tokens and the loss function's per-token inputs."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)

    @field_validator("loss_fn_inputs", mode="before")
    @classmethod
    def _coerce_inputs(cls, value: Any) -> dict[str, TensorData]:
        if not isinstance(value, dict):
            raise ValueError(f"loss_fn_inputs must be a dict, got {type(value).__name__}")
        return {key: loss_input(key, item) for key, item in value.items()}


# --------------------------------------------------------------------------- parameters


class LoraConfig(_Model):
    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class _Finite(_Model):
    """A request's parameters: NaN and infinities are refused (no finite step or draw comes
    of them, and JSON cannot carry them to a server)."""

    model_config = ConfigDict(allow_inf_nan=False)


FP32_TINY = 1.1754943508222875e-38  # the smallest normal fp32 number (torch.finfo(torch.float32).tiny)


class AdamParams(_Finite):
    """AdamW hyper-parameters for one ``optim_step`` (defaults as in the user docs). Out of
    range (a negative rate, a beta of 1 or more) is refused here, at construction, as the
    engine would refuse it (``trio_engine.optim.AdamConfig``)."""

    learning_rate: Annotated[float, Field(ge=0)] = 1e-4
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999
    # 0 (or what fp32 rounds to 0) divides a zero gradient by zero: NaN weights
    eps: Annotated[float, Field(ge=FP32_TINY)] = 1e-12
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    grad_clip_norm: Annotated[float, Field(ge=0)] = 0.0  # 0: no clipping


Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]  # what torch's generator takes


class SamplingParams(_Finite):
    """How to sample.

    Attributes:
        max_tokens: the most tokens to generate. Required: the user docs always give it,
            and a silent default would cut samples short (or run long) unnoticed.
        temperature: 0 is greedy. top_k: -1 is off. top_p: 1 is off.
        stop: strings or token ids that end a sequence, in addition to EOS. ``None``
            means EOS only; ``[]`` means no stop at all, not even EOS (tinker's meaning).
        ignore_eos: True keeps generating through EOS, to ``max_tokens`` or a ``stop``
            (fixed-length rollouts, benchmarks); ``stop=[]`` implies it.
        seed: the same seed gives the same samples.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: str | list[str] | list[int] | None = None
    ignore_eos: bool = False
    seed: Seed | None = None

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, stop: Any) -> Any:
        """``""`` is in every text: it would end each sequence at its first token."""
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("a stop string must not be empty")
        return stop


# --------------------------------------------------------------------------- responses


class AwaitableResult:
    """A result that is its own finished future: ``await r`` and ``r.result()`` give ``r``.

    The sampling twins return results, as Tinker's do (``(await sc.sample_async(...)).sequences``);
    being awaitable, they also serve code written for a future, as in the user docs
    (``fut = await sc.sample_async(...); res = await fut``).
    """

    def __await__(self) -> Generator[Any, None, Any]:
        return self
        yield  # a generator that finishes at once: awaiting costs nothing

    def result(self, timeout: float | None = None) -> Any:
        return self

    def done(self) -> bool:
        return True


class PromptLogprobs(AwaitableResult, list):  # type: ignore[type-arg]
    """``compute_logprobs_async``'s result: a list of floats (None for the first token)."""


class ForwardBackwardOutput(_Model):
    """Per datum ``{"logprobs", "elementwise_loss"}``; ``metrics`` has ``loss:sum``."""

    loss_fn_output_type: str = "TensorData"
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]
    elapsed_time: float = 0.0  # milliseconds


class OptimStepResponse(_Model):
    metrics: dict[str, float] = Field(default_factory=dict)


class SaveWeightsResponse(_Model):
    path: str


class SaveWeightsForSamplerResponse(_Model):
    path: str


class LoadWeightsResponse(_Model):
    path: str


class SampledSequence(_Model):
    tokens: list[int]
    logprobs: list[float]
    text: str
    stop_reason: Literal["stop", "length"]


class SampleResponse(AwaitableResult, _Model):
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    # prompt tokens whose KV the server reused from a recent request's (its prefix cache)
    prompt_cache_hit_tokens: int = 0


class ComputeLogprobsResponse(_Model):
    logprobs: list[float | None]


class CreateModelResponse(_Model):
    model_id: str
    base_model: str


class CreateSamplerResponse(_Model):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class GetInfoResponse(_Model):
    model_id: str
    base_model: str
    lora_rank: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    step: int
    model_info: dict[str, Any] = Field(default_factory=dict)


class ServerCapabilities(_Model):
    supported_models: list[str]
    max_tokens_per_request: int
    max_seq_len: int
    max_batch_size: int
    max_lora_rank: int
    max_runs_per_user: int | None = None  # per-user quotas; None: none
    max_checkpoint_bytes_per_user: int | None = None
    max_pending_per_user: int | None = None  # queue bounds: accepted, unfinished requests; None: none
    max_pending_total: int | None = None


class TokenUsage(_Model):
    """Tokens the service processed for successful requests (a failed one counts nothing).

    trained    forward_backward: every datum's ``model_input`` tokens
    prefilled  forward: every datum's tokens (a pass without gradients);
               sample and compute_logprobs: the prompt's tokens, once per request (the
               prompt is prefilled once and shared by its ``num_samples``)
    sampled    sample: the tokens generated, all sequences together
    total      trained + prefilled + sampled: what a key's budget counts
    """

    trained: int = 0
    prefilled: int = 0
    sampled: int = 0

    @property
    def total(self) -> int:
        return self.trained + self.prefilled + self.sampled


class RunUsage(TokenUsage):
    run_id: str | None  # None: sampling from a base model (a sampler of no run)


class Usage(TokenUsage):
    """The caller's usage: totals, per-run rows, and the key's budget (None: unlimited)."""

    budget_tokens: int | None = None
    runs: list[RunUsage] = Field(default_factory=list)


MAX_TTL_SECONDS = 3650 * 86400  # ten years, as tinker's
# A checkpoint's time to live: whole seconds (strict: "3600", 1.5 and True are refused)
TTLSeconds = Annotated[int, Strict(), Field(ge=1, le=MAX_TTL_SECONDS)]


class CheckpointTTL(_Model):
    ttl_seconds: TTLSeconds | None  # None: kept until deleted


class _Reply(_Model):
    """A response that a newer server may extend: fields this SDK does not know are ignored."""

    model_config = ConfigDict(extra="ignore")


class Checkpoint(_Reply):
    path: str
    run_id: str
    kind: Literal["weights", "sampler_weights"]
    name: str
    created_at: str
    size_bytes: int = 0
    expires_at: str | None = None  # removed by the service from then on (a save's ttl_seconds); None: kept
    user_metadata: dict[str, str] | None = None


class TrainingRun(_Reply):
    run_id: str
    base_model: str
    lora_rank: int
    created_at: str
    last_request_at: str | None = None
    step: int = 0
    checkpoints: list[Checkpoint] = Field(default_factory=list)


MetricName = Annotated[str, StringConstraints(min_length=1, max_length=128)]
# Strict: true and "1.5" are not numbers; ints are. Finite: a chart cannot draw NaN.
MetricValue = Annotated[float, Strict(), AllowInfNan(False)]
MAX_METRICS_PER_CALL = 256


class StepMetrics(_Model):
    """One training step's metrics. Step k is optim_step k with the forward_backward
    calls since step k-1. The service records ``loss`` (the step's ``loss:sum`` over the
    sum of its datums' weights), ``tokens``, the loss function's ``<name>:mean`` metrics
    (averaged over the step's tokens of non-zero weight), ``grad_norm`` and
    ``learning_rate``; ``log_metrics`` adds the client's own (a client value of a name
    hides the service's)."""

    step: int
    metrics: dict[str, float]


class LogMetricsRequest(_Model):
    """``POST /api/v1/runs/{run_id}/metrics``: a client's metrics for one step.

    ``step`` None: the run's current step (its number of optim_steps so far).
    """

    step: Annotated[int, Strict()] | None = Field(default=None, ge=0, le=INT64_MAX)
    metrics: dict[MetricName, MetricValue] = Field(min_length=1, max_length=MAX_METRICS_PER_CALL)


class LogMetricsResponse(_Model):
    run_id: str
    step: int  # where the metrics were recorded (the current step, when none was given)


class TokenizerFiles(_Model):
    """A tokenizer's Hugging Face files. Sent as base64: some (a sentencepiece
    ``tokenizer.model``) are binary, and JSON carries only text."""

    base_model: str
    files: dict[str, str]  # filename -> base64 of its bytes

    @classmethod
    def of(cls, base_model: str, contents: dict[str, bytes]) -> TokenizerFiles:
        return cls(base_model=base_model, files={n: base64.b64encode(b).decode() for n, b in contents.items()})

    def contents(self) -> dict[str, bytes]:
        return {name: base64.b64decode(text) for name, text in self.files.items()}

    def load(self, cache_dir: str | Path) -> Any:
        """The Hugging Face fast tokenizer these files make, cached in a folder of
        ``cache_dir`` named by their digest (see ``load_tokenizer``)."""
        return load_tokenizer(self.contents(), cache_dir)


def load_tokenizer(files: dict[str, bytes], cache_dir: str | Path) -> Any:
    """A ``PreTrainedTokenizerFast`` from a tokenizer's files (name -> bytes).

    The files are written once to ``cache_dir/<digest>`` (the digest covers every file's
    name and content, so any change gives a fresh folder) and loaded from there. The SDK
    and the server's OpenAI door both build their tokenizers here.
    """
    # PreTrainedTokenizerFast, not AutoTokenizer: the latter imports torch when installed,
    # and the SDK must stay torch-free. The server always ships a tokenizer.json.
    from transformers import PreTrainedTokenizerFast

    folder = Path(cache_dir) / _digest(files)
    if not (folder / "tokenizer_config.json").exists():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            (tmp / name).write_bytes(content)
        try:
            tmp.rename(folder)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _digest(files: dict[str, bytes]) -> str:
    """The cache key: every file's name and content, so any change gives a fresh folder."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(hashlib.sha256(name.encode()).digest() + hashlib.sha256(files[name]).digest())
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------- protocol


class CreateModelRequest(_Model):
    base_model: str
    lora_config: LoraConfig = Field(default_factory=LoraConfig)


class CreateModelFromStateRequest(_Model):
    path: str
    with_optimizer: bool = False


class _RunRequest(_Model):
    model_id: str
    seq: int = Field(ge=0, le=INT64_MAX)  # stored as a 64-bit integer


class ForwardRequest(_RunRequest):
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, Annotated[float, AllowInfNan(False)]] | None = None
    # forward_backward_custom's backward (a cross_entropy pass weighted by -dloss/dlogprobs):
    # the user's loss ("loss:sum") and loss_fn's metrics, which the run's step metrics
    # record in place of the pass's own (trio_server.metrics)
    custom_metrics: dict[str, Annotated[float, AllowInfNan(False)]] | None = None

    @field_validator("data")
    @classmethod
    def _checked_data(cls, data: list[Datum]) -> list[Datum]:
        return [checked_datum(i, d) for i, d in enumerate(data)]


def checked_datum(i: int, datum: Datum) -> Datum:
    """``datum`` checked again where its index is known (a Datum's inputs may have been
    replaced after it was built, unvalidated); every forward needs ``target_tokens``.

    Raises ValueError naming ``data[i]``, the field and the value.
    """
    where = f"data[{i}].loss_fn_inputs"
    if "target_tokens" not in datum.loss_fn_inputs:
        raise ValueError(f"{where}: 'target_tokens' is missing (got {sorted(datum.loss_fn_inputs)})")
    try:
        inputs = {key: loss_input(key, value) for key, value in datum.loss_fn_inputs.items()}
    except ValueError as exc:
        raise ValueError(f"data[{i}].{exc}") from None
    tokens = ModelInput.model_construct(chunks=[chunk.model_copy(update={"tokens": list(chunk.tokens)})
                                                for chunk in datum.model_input.chunks])
    return Datum.model_construct(model_input=tokens, loss_fn_inputs=inputs)


class OptimStepRequest(_RunRequest):
    adam_params: AdamParams = Field(default_factory=AdamParams)


class SaveWeightsRequest(_RunRequest):
    """Save a checkpoint. ``ephemeral`` sampler weights are named by the service, never
    listed, and removed when the service restarts or the run saves too many more."""

    name: str | None = None
    kind: Literal["weights", "sampler_weights", "ephemeral"]
    overwrite: bool = False  # False: a used name is refused (409)
    ttl_seconds: TTLSeconds | None = None  # removed this long after the save; None: kept
    user_metadata: dict[Text, Text] | None = None  # kept with the checkpoint, listed with it

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str | None) -> str | None:
        if name is not None and not CHECKPOINT_NAME.match(name):
            raise ValueError(
                f"name {name!r}: use 1-128 letters, digits, '.', '_' or '-', not starting with '.', without '..'"
            )
        return name

    @model_validator(mode="after")
    def _named_unless_ephemeral(self) -> SaveWeightsRequest:
        if (self.name is None) != (self.kind == "ephemeral"):
            raise ValueError("name: required for a checkpoint, and given by the service for ephemeral weights")
        return self


class LoadWeightsRequest(_RunRequest):
    path: str
    with_optimizer: bool = False


class GetInfoRequest(_Model):
    model_id: str


class CreateSamplerRequest(_Model):
    base_model: str | None = None
    model_path: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> CreateSamplerRequest:
        if (self.base_model is None) == (self.model_path is None):
            raise ValueError("give exactly one of base_model and model_path")
        return self


class SampleRequest(_Model):
    sampler_id: str
    prompt: ModelInput
    num_samples: int = 1
    sampling_params: SamplingParams
    include_prompt_logprobs: bool = False


class ComputeLogprobsRequest(_Model):
    sampler_id: str
    prompt: ModelInput


MAX_POLL_SECONDS = 30.0  # the longest a retrieve waits for an outcome (a long poll)


class RetrieveFutureRequest(_Model):
    request_id: str
    timeout: float = Field(default=MAX_POLL_SECONDS, ge=0, le=MAX_POLL_SECONDS)


class ErrorInfo(_Model):
    category: str  # validation | not_found | capacity | server | ...
    message: str
    status_code: int | None = None  # the HTTP status it has (None: the category's usual one)


class FutureResponse(_Reply):  # a newer server's pending answers may say more (others_ahead did)
    request_id: str
    status: Literal["done", "failed", "pending"]
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    queue_state: str | None = None  # pending: "running" or "queued (position N)"
    # pending and queued: how many requests of its model host run before it, and when it
    # should start, in seconds from now (None: no estimate yet). See trio_server/queueing.py.
    queue_position: int | None = None
    starts_in_seconds: float | None = None
    others_ahead: int | None = None  # of queue_position, other users' requests (None: not said)


class SubmitResponse(_Model):
    request_id: str


# op name -> (request model, result model); the one table both sides dispatch on.
OPERATIONS: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "create_model": (CreateModelRequest, CreateModelResponse),
    "create_model_from_state": (CreateModelFromStateRequest, CreateModelResponse),
    "forward": (ForwardRequest, ForwardBackwardOutput),
    "forward_backward": (ForwardRequest, ForwardBackwardOutput),
    "optim_step": (OptimStepRequest, OptimStepResponse),
    "save_weights": (SaveWeightsRequest, SaveWeightsResponse),
    "load_weights": (LoadWeightsRequest, LoadWeightsResponse),
    "get_info": (GetInfoRequest, GetInfoResponse),
    "create_sampler": (CreateSamplerRequest, CreateSamplerResponse),
    "sample": (SampleRequest, SampleResponse),
    "compute_logprobs": (ComputeLogprobsRequest, ComputeLogprobsResponse),
}
