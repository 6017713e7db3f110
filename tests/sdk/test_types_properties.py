"""Property tests of the wire types (pytrio.types), shared by client and server.

A JSON round trip keeps every value, and a bad value raises pydantic's ValidationError,
never a bare TypeError/ValueError/OverflowError that a front door would turn into a 500.
"""

from __future__ import annotations

import math

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytrio import types as t

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite = st.floats(allow_nan=False, allow_infinity=False)
int64 = st.integers(-(2**63), 2**63 - 1)
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=20)
names = st.text(max_size=12)


def round_trip(model: pydantic.BaseModel) -> pydantic.BaseModel:
    return type(model).model_validate_json(model.model_dump_json())


@st.composite
def tensors(draw, dtype=st.sampled_from(["int64", "float32"])):
    kind = draw(dtype)
    data = draw(st.lists(int64 if kind == "int64" else finite, max_size=12))
    shape = draw(st.sampled_from([None, [len(data)], [1, len(data)]]))
    return t.TensorData(data=data, dtype=kind, shape=shape)


model_inputs = st.builds(lambda chunks: t.ModelInput(chunks=[t.EncodedTextChunk(tokens=c) for c in chunks]),
                         st.lists(tokens, max_size=3))


@st.composite
def data(draw):
    n = draw(st.integers(1, 8))
    inputs = {"target_tokens": draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))}
    for name in draw(st.sets(st.sampled_from(["weights", "advantages", "logprobs"]))):
        inputs[name] = draw(st.lists(finite, min_size=n, max_size=n))
    return t.Datum(model_input=t.ModelInput.from_ints(draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))),
                   loss_fn_inputs=inputs)


sampling_params = st.builds(
    t.SamplingParams, max_tokens=int64, temperature=finite, top_k=int64, top_p=finite,
    stop=st.one_of(st.none(), st.text(min_size=1), st.lists(st.text(min_size=1), max_size=3), st.lists(int64, max_size=3)),
    ignore_eos=st.booleans(), seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)))
non_negative = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
below_one = st.floats(min_value=0, max_value=1, exclude_max=True)
adam_params = st.builds(t.AdamParams, learning_rate=non_negative, beta1=below_one, beta2=below_one,
                        eps=st.floats(min_value=t.FP32_TINY, allow_infinity=False), weight_decay=non_negative,
                        grad_clip_norm=non_negative)
forward_outputs = st.builds(
    t.ForwardBackwardOutput,
    loss_fn_outputs=st.lists(st.dictionaries(st.sampled_from(["logprobs", "elementwise_loss"]),
                                             tensors(st.just("float32")), max_size=2), max_size=3),
    metrics=st.dictionaries(names, finite, max_size=3), elapsed_time=finite)
sample_responses = st.builds(
    t.SampleResponse,
    sequences=st.lists(st.builds(t.SampledSequence, tokens=tokens, logprobs=st.lists(finite, max_size=5),
                                 text=st.text(), stop_reason=st.sampled_from(["stop", "length"])), max_size=3),
    prompt_logprobs=st.one_of(st.none(), st.lists(st.one_of(st.none(), finite), max_size=5)))
responses = st.one_of(
    forward_outputs, sample_responses,
    st.builds(t.OptimStepResponse, metrics=st.dictionaries(names, finite, max_size=3)),
    st.builds(t.ComputeLogprobsResponse, logprobs=st.lists(st.one_of(st.none(), finite), max_size=5)),
    st.builds(t.CreateModelResponse, model_id=st.text(), base_model=st.text()),
    st.builds(t.SaveWeightsResponse, path=st.text()),
    st.builds(t.GetInfoResponse, model_id=st.text(), base_model=st.text(), lora_rank=int64, train_attn=st.booleans(),
              train_mlp=st.booleans(), train_unembed=st.booleans(), step=int64))


@SETTINGS
@given(st.one_of(model_inputs, tensors(), data(), sampling_params, adam_params, responses))
def test_a_json_round_trip_keeps_every_value(model):
    again = round_trip(model)
    assert again == model
    assert again.model_dump() == model.model_dump()


@SETTINGS
@given(tensors())
def test_tensor_data_keeps_its_dtype_and_values(tensor):
    again = round_trip(tensor)
    assert again.dtype == tensor.dtype and again.shape == tensor.shape
    assert again.tolist() == tensor.tolist()


@SETTINGS
@given(st.lists(st.floats(), max_size=6), st.dictionaries(names, st.floats(), max_size=3))
def test_non_finite_floats_survive_the_wire(values, metrics):
    # NaN/inf went out as null and the client could not parse the answer at all
    model = t.ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": t.TensorData(data=values)}], metrics=metrics)
    again = round_trip(model)
    same = [a == b or (math.isnan(a) and math.isnan(b))
            for a, b in zip(again.loss_fn_outputs[0]["logprobs"].data, values, strict=True)]
    assert all(same)
    assert again.metrics.keys() == metrics.keys()
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(again.metrics.values(), metrics.values()))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)),
    max_leaves=12)
WIRE_TYPES = [t.ModelInput, t.TensorData, t.Datum, t.SamplingParams, t.AdamParams, t.LoraConfig,
              t.ForwardBackwardOutput, t.SampleResponse, t.ForwardRequest, t.SampleRequest,
              t.CreateModelRequest, t.OptimStepRequest]


def bodies(model: type[pydantic.BaseModel]):
    """Dicts with the model's own field names (so values reach its validators), or anything."""
    fields = st.fixed_dictionaries({}, optional={name: json_values for name in model.model_fields})
    return st.one_of(fields, json_values)


@pytest.mark.parametrize("model", WIRE_TYPES, ids=lambda m: m.__name__)
@SETTINGS
@given(st.data())
def test_bad_values_raise_only_validation_error(model, draw):
    body = draw.draw(bodies(model))
    try:
        model.model_validate(body)
    except pydantic.ValidationError:
        pass


@pytest.mark.parametrize("model", [t.Datum, t.TensorData], ids=lambda m: m.__name__)
@SETTINGS
@given(st.lists(st.one_of(st.integers(), st.floats(), st.none(), st.text(max_size=3)), max_size=6))
def test_any_loss_input_values_raise_only_validation_error(model, values):
    body = ({"model_input": {"chunks": [{"tokens": [1]}]}, "loss_fn_inputs": {"target_tokens": values,
                                                                              "weights": values}}
            if model is t.Datum else {"data": values, "dtype": "int64"})
    try:
        parsed = model.model_validate(body)
    except pydantic.ValidationError:
        return
    if model is t.Datum:
        assert all(math.isfinite(v) and v == int(v) for v in parsed.loss_fn_inputs["target_tokens"].data)
