"""Bad input is refused at call time, before anything is sent: the error names the datum
index, the field and the value, and no sequence number or request is spent on it."""

from __future__ import annotations

from typing import Any

import pytest

import pytrio as trio
from pytrio import types as t
from pytrio.session import Session

from .fakes import OperationsOnly

MODEL = "trio/tiny-llama"


class Recording(OperationsOnly):
    """Accepts every submit and answers every poll with an empty forward output."""

    def __init__(self) -> None:
        self.submits: list[tuple[str, dict[str, Any]]] = []

    async def submit(self, op: str, body: dict[str, Any], idempotency_key: str) -> str:
        self.submits.append((op, body))
        return f"req-{len(self.submits)}"

    async def retrieve(self, request_id: str, timeout: float) -> t.FutureResponse:
        return t.FutureResponse(request_id=request_id, status="done",
                                result={"loss_fn_outputs": [], "metrics": {}})


def client() -> tuple[trio.TrainingClient, Recording]:
    transport = Recording()
    return trio.TrainingClient(Session(transport), "run-1", MODEL), transport


def good() -> trio.Datum:
    return trio.Datum(model_input=trio.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1, 1, 1]})


def test_a_datum_without_target_tokens_names_its_index():
    tc, transport = client()
    missing = trio.Datum(model_input=trio.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"weights": [1, 1, 1]})
    for call in (tc.forward, tc.forward_backward):
        with pytest.raises(trio.ValidationError, match=r"data\[1\].*target_tokens.*missing.*weights"):
            call([good(), missing])
    with pytest.raises(trio.ValidationError, match=r"data\[1\].*target_tokens.*missing"):
        tc.forward_backward_custom([good(), missing], lambda data, logprobs: (sum(lp.sum() for lp in logprobs), {}))
    assert transport.submits == []


def test_one_datum_where_a_list_is_due_says_so():
    tc, transport = client()
    for call in (tc.forward, tc.forward_backward, lambda d: tc.forward_backward_custom(d, lambda *_: None)):
        with pytest.raises(trio.ValidationError, match=r"data: a list of Datum, got one Datum; pass \[datum\]"):
            call(good())
    assert transport.submits == []


def test_a_bad_input_in_a_request_names_datum_field_and_value():
    tc, transport = client()
    as_dict = {"model_input": {"chunks": [{"tokens": [1, 2, 3]}]},
               "loss_fn_inputs": {"target_tokens": [2.0, 7.5, 4.0]}}
    with pytest.raises(trio.ValidationError, match=r"data\[1\].*target_tokens.*7\.5"):
        tc.forward_backward([good(), as_dict])
    changed = good()  # a field assigned after the datum was built is not validated by pydantic
    changed.loss_fn_inputs["weights"] = t.TensorData.model_construct(data=[1.0, 2.0, 3.0], dtype="float32", shape=[4])
    with pytest.raises(trio.ValidationError, match=r"data\[2\].*weights.*shape \[4\]"):
        tc.forward_backward([good(), good(), changed])
    assert transport.submits == []
    tc.forward_backward([good()]).result(timeout=5)
    assert transport.submits[0][1]["seq"] == 0  # the refused calls spent no sequence number
