"""Types: conversions users rely on, and that importing the SDK never imports torch."""

import subprocess
import sys

import numpy as np
import pydantic
import pytest
import torch

import pytrio as trio


def test_datum_accepts_lists_numpy_and_torch():
    d = trio.Datum(
        model_input=trio.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "weights": torch.tensor([0.0, 1.0, 1.0]),
                        "advantages": [0.5, -1, 2]},
    )
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0]
    assert d.loss_fn_inputs["advantages"].to_numpy().dtype == np.float32
    assert d.loss_fn_inputs["weights"].to_torch().dtype == torch.float32
    t = trio.TensorData.from_numpy(np.arange(6).reshape(2, 3))
    assert t.shape == [2, 3] and t.to_numpy().shape == (2, 3)
    with pytest.raises(ValueError, match="weights"):
        trio.Datum(model_input=trio.ModelInput.from_ints([1]), loss_fn_inputs={"weights": [object()]})


def test_model_input_helpers():
    m = trio.ModelInput.from_ints([1, 2]).append_int(3).append(trio.EncodedTextChunk(tokens=[4]))
    assert m.to_ints() == [1, 2, 3, 4] and m.length == 4 and len(m.chunks) == 3
    assert trio.ModelInput.empty().length == 0


def test_defaults_match_the_docs():
    p = trio.AdamParams()
    assert (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay) == (1e-4, 0.9, 0.999, 1e-12, 0.0)


@pytest.mark.parametrize("field, value", [("learning_rate", -1.0), ("beta1", 1.0), ("beta2", 2.0), ("beta1", -0.1),
                                          ("eps", -1e-8), ("eps", 0.0), ("weight_decay", -0.01),
                                          ("grad_clip_norm", -1.0)])
def test_adam_params_out_of_range_are_refused_at_construction(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        trio.AdamParams(**{field: value})
    trio.AdamParams(learning_rate=0.0, beta1=0.0, beta2=0.0, eps=1.1754943508222875e-38)  # the engine's edges


@pytest.mark.parametrize("field, value", [("seed", 2**64), ("seed", -2**63 - 1), ("stop", ""), ("stop", ["\n", ""])])
def test_sampling_params_out_of_range_are_refused_at_construction(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        trio.SamplingParams(max_tokens=4, **{field: value})
    trio.SamplingParams(max_tokens=4, seed=2**64 - 1, stop=["\n"])


def test_import_does_not_import_torch():
    code = "import sys, pytrio as trio; trio.ServiceClient; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_error_tree():
    for cls in (trio.ValidationError, trio.NotFoundError, trio.AuthenticationError, trio.CapacityError,
                trio.ServerError, trio.ConnectionError, trio.TimeoutError):
        assert issubclass(cls, trio.TrioError)
    assert issubclass(trio.ValidationError, ValueError)


# -- loss_fn_inputs: the dtype follows the field, the shape the data --------------------


def inputs(**values) -> dict:
    return trio.Datum(model_input=trio.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=values).loss_fn_inputs


def test_dtype_follows_the_field_not_the_values():
    """The user docs write ``weights=[0, 1]``; token ids often come out of numpy as floats."""
    got = inputs(weights=[0, 1, 1], target_tokens=np.array([2.0, 3.0, 4.0]), advantages=[1, -1, 0],
                 logprobs=torch.tensor([-1, -2, -3]))
    assert {k: v.dtype for k, v in got.items()} == {
        "weights": "float32", "target_tokens": "int64", "advantages": "float32", "logprobs": "float32"}
    assert got["target_tokens"].tolist() == [2, 3, 4] and all(type(x) is int for x in got["target_tokens"].data)
    assert got["weights"].to_numpy().dtype == np.float32 and got["weights"].tolist() == [0.0, 1.0, 1.0]
    explicit = trio.TensorData(data=[1, 1, 1], dtype="int64")
    assert inputs(weights=explicit)["weights"].dtype == "float32"


def test_a_token_id_that_is_not_an_integer_names_field_and_value():
    with pytest.raises(ValueError, match=r"target_tokens.*2\.5"):
        inputs(target_tokens=[1.0, 2.5, 3.0])


def test_the_shape_must_hold_the_data():
    with pytest.raises(ValueError, match=r"shape \[2, 2\].*4.*3"):
        trio.TensorData(data=[1.0, 2.0, 3.0], shape=[2, 2])
    with pytest.raises(ValueError, match=r"weights.*shape"):
        inputs(weights=trio.TensorData.model_construct(data=[1.0, 2.0, 3.0], dtype="float32", shape=[5]))
    assert trio.TensorData(data=[1.0, 2.0, 3.0, 4.0], shape=[2, 2]).to_numpy().shape == (2, 2)


def test_max_tokens_has_no_silent_default():
    """The user docs always say how long a sample may be; a forgotten max_tokens used to
    give 16 tokens without a word."""
    with pytest.raises(ValueError, match="max_tokens"):
        trio.SamplingParams(temperature=0.7)
    params = trio.SamplingParams(max_tokens=20)
    assert params.stop is None and params.ignore_eos is False


def test_a_pending_answer_with_fields_this_sdk_does_not_know_still_parses():
    """A newer server's FutureResponse may say more (``others_ahead`` was new once)."""
    from pytrio import types as t

    state = t.FutureResponse.model_validate({"request_id": "r", "status": "pending", "queue_position": 2, "eta_note": 1})
    assert state.queue_position == 2
