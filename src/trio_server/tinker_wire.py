"""The tinker 0.38 wire format, translated to and from the core's wire types. No I/O.

The SDK sends ``forward_backward`` as a protobuf ``ForwardBackwardRequest`` and accepts
``ForwardBackwardOutput`` and ``SampleResponse`` results only as protobuf (the vendored
``tinker_public_pb2``; schema in docs/tinker_public.proto). Tokens travel as int32 bytes,
tensors as dense little-endian bytes with a dtype, per-datum outputs as one batched tensor
with byte offsets. Checkpoint paths differ only in their scheme.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import tinker_public_pb2 as _pb
from .errors import ServiceError

pb: Any = _pb  # generated code: its message classes are made at import time


# -- paths and ids ---------------------------------------------------------------------------


def to_trio_path(path: str) -> str:
    """``tinker://<run>/<kind>/<name>`` -> ``trio://...`` (the same checkpoint)."""
    if path.startswith("tinker://"):
        return "trio://" + path[len("tinker://"):]
    return path


def to_tinker_path(path: str | None) -> str | None:
    return None if path is None else "tinker://" + path.split("://", 1)[-1]


def session_of(model_id: str) -> str:
    return model_id.split(":", 1)[0]


def seq_of(seq_id: Any) -> int:
    """The tinker SDK numbers a client's requests from 1; the core from 0."""
    if not isinstance(seq_id, int) or seq_id < 1:
        raise ServiceError("validation", f"seq_id: must be an integer >= 1, got {seq_id!r}")
    return seq_id - 1


# -- protobuf <-> the core's wire types ------------------------------------------------------

_NP: dict[int, Any] = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}


def _tensor(name: str, i: int, msg: Any) -> dict:
    where = f"data[{i}].loss_fn_inputs[{name!r}]"
    if msg.WhichOneof("encoding") == "sparse_csr":
        raise ServiceError("validation", f"{where}: sparse (top-k) tensors are not supported by TRIO; send dense 1-D tensors")
    if len(msg.shape) > 1:
        raise ServiceError("validation", f"{where}: shape {list(msg.shape)}: TRIO takes 1-D loss inputs (one value a "
                           "token), not 2-D (top-k) ones")
    if msg.dtype == 4:
        raw = np.frombuffer(msg.dense, dtype="<u2").astype(np.uint32) << 16
        array = raw.view(np.float32)
    elif msg.dtype in _NP:
        array = np.frombuffer(msg.dense, dtype=_NP[msg.dtype])
    else:
        raise ServiceError("validation", f"{where}: unknown dtype {msg.dtype}")
    dtype = "float32" if array.dtype.kind == "f" else "int64"
    return {"data": array.tolist(), "dtype": dtype, "shape": list(msg.shape) or None}


def decode_datums(msg: Any) -> list[dict]:
    """The protobuf ``ForwardBackwardRequest.data`` as the core's ``Datum`` dicts."""
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise ServiceError("validation", f"data[{i}].model_input: {kind} chunks are not supported by TRIO (encoded_text only)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
        inputs = {name: _tensor(name, i, t) for name, t in datum.loss_fn_inputs.items()}
        data.append({"model_input": {"chunks": [{"tokens": tokens}]}, "loss_fn_inputs": inputs})
    return data


def loss_config(msg: Any) -> dict[str, float] | None:
    config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise ServiceError("validation", f"loss_fn_config[{key!r}]: TRIO takes numbers only, got {value.text!r}")
        config[key] = value.number
    return config or None


def encode_forward_output(result: dict) -> bytes:
    """The core's ForwardBackwardOutput JSON as tinker's protobuf: one ArrayRecord."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    per_datum = result["loss_fn_outputs"]
    record = out.loss_fn_outputs.add()
    record.num_datums = len(per_datum)
    for name in ("logprobs", "elementwise_loss"):
        arrays = [np.asarray(d[name]["data"], dtype="<f4") for d in per_datum if name in d]
        if len(arrays) != len(per_datum):
            continue
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype="<i8").tobytes()
        field.dtype = 1
    for key, value in result["metrics"].items():
        out.metrics[key if ":" in key else key + ":mean"] = float(value)  # the SDK splits on ':'
    return out.SerializeToString()


def encode_sample_output(result: dict) -> bytes:
    out = pb.SampleResponse()
    for seq in result["sequences"]:
        s = out.sequences.add()
        s.stop_reason = 0 if seq["stop_reason"] == "stop" else 1
        s.tokens = np.asarray(seq["tokens"], dtype="<i4").tobytes()
        s.logprobs = np.asarray(seq["logprobs"], dtype="<f4").tobytes()
    if result.get("prompt_logprobs") is not None:
        values = [math.nan if v is None else v for v in result["prompt_logprobs"]]
        out.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    out.prompt_cache_hit_tokens = int(result.get("prompt_cache_hit_tokens") or 0)
    return out.SerializeToString()
