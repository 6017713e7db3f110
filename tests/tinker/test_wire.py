"""The tinker wire codec against the SDK's own encoder and decoders (no server)."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("tinker")
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)
from tinker.types.forward_backward_input import ForwardBackwardInput  # noqa: E402
from tinker.types.forward_backward_request import ForwardBackwardRequest  # noqa: E402

from tinker import types as tt  # noqa: E402
from trio_server.errors import ServiceError  # noqa: E402
from trio_server.tinker_wire import (  # noqa: E402
    decode_datums,
    encode_forward_output,
    encode_sample_output,
    loss_config,
    to_tinker_path,
    to_trio_path,
)


def _request(data, config=None):
    request = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=data, loss_fn="ppo", loss_fn_config=config),
        model_id="s:train:0", seq_id=1)
    return forward_backward_request_to_proto(request)


def test_forward_backward_request_decodes_to_core_datums():
    datum = tt.Datum(model_input=tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[5, 6]), tt.EncodedTextChunk(tokens=[7])]),
                     loss_fn_inputs={"target_tokens": [6, 7, 8], "advantages": np.array([0.5, -1.0, 2.0], dtype=np.float32)})
    msg = _request([datum], {"clip_low_threshold": 0.7})
    [decoded] = decode_datums(msg)
    assert decoded["model_input"]["chunks"][0]["tokens"] == [5, 6, 7]
    assert decoded["loss_fn_inputs"]["target_tokens"] == {"data": [6, 7, 8], "dtype": "int64", "shape": [3]}
    assert decoded["loss_fn_inputs"]["advantages"]["data"] == [0.5, -1.0, 2.0]
    assert loss_config(msg) == {"clip_low_threshold": pytest.approx(0.7)}


def test_text_config_and_sparse_inputs_are_refused_by_name():
    datum = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    msg = _request([datum])
    msg.data[0].loss_fn_inputs["weights"].sparse_csr.values = b""
    with pytest.raises(ServiceError, match=r"data\[0\].loss_fn_inputs\['weights'\]: sparse"):
        decode_datums(msg)
    msg.loss_fn_config_v2["mode"].text = "x"
    with pytest.raises(ServiceError, match=r"loss_fn_config\['mode'\]"):
        loss_config(msg)


def test_a_two_dimensional_input_is_refused_as_such():
    """The SDK's dense encoding of a top-k (tokens x k) input was refused as a length
    mismatch ("length 8 differs from model_input length 4")."""
    datum = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3, 4]),
                     loss_fn_inputs={"target_tokens": np.array([[2, 9], [3, 9], [4, 9], [5, 9]], dtype=np.int64)})
    with pytest.raises(ServiceError, match=r"data\[0\].loss_fn_inputs\['target_tokens'\]: shape \[4, 2\]: .*1-D"):
        decode_datums(_request([datum]))


def test_outputs_decode_with_the_sdk():
    result = {"loss_fn_outputs": [{"logprobs": {"data": [-1.0, -2.0]}, "elementwise_loss": {"data": [1.0, 2.0]}},
                                  {"logprobs": {"data": [-0.5]}, "elementwise_loss": {"data": [0.5]}}],
              "metrics": {"loss:sum": 3.5}}
    out = deserialize_forward_backward_output(encode_forward_output(result))
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]

    sample = {"sequences": [{"tokens": [4, 2], "logprobs": [-0.25, -0.5], "stop_reason": "stop", "text": "x"}],
              "prompt_logprobs": [None, -1.5], "prompt_cache_hit_tokens": 7}
    decoded = deserialize_sample_response(encode_sample_output(sample))
    assert decoded.prompt_cache_hit_tokens == 7
    seq = decoded.sequences[0]
    assert seq.tokens == [4, 2] and seq.logprobs == [-0.25, -0.5] and seq.stop_reason == "stop"
    first, second = decoded.prompt_logprobs
    assert (first is None or math.isnan(first)) and second == -1.5


def test_paths_differ_only_in_scheme():
    assert to_trio_path("tinker://run-ab12/weights/final") == "trio://run-ab12/weights/final"
    assert to_tinker_path("trio://run-ab12/sampler_weights/s") == "tinker://run-ab12/sampler_weights/s"
