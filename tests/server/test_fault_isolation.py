"""Faults stay with the request that caused them: the worker thread survives a bug, an engine
error is a server error (500) while bad input stays a validation error (400), and one run's
failing job in a co-batch leaves the other runs' results exactly as if they ran alone."""

from __future__ import annotations

import pytest

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_server import worker as worker_module
from trio_server.core import ServiceCore

MODEL = "trio/tiny-llama"


def datum(n: int = 6, **inputs: list[float]) -> trio.Datum:
    toks = list(range(1, n + 2))
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], **inputs})


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    core = ServiceCore(tmp_path_factory.mktemp("faults"), dtype="float32")
    yield core
    core.close()


def client(core) -> trio.ServiceClient:
    return trio.ServiceClient(transport=LocalTransport(core))


def test_an_exception_escaping_execute_fails_the_batch_not_the_worker(core, monkeypatch):
    tc = client(core).create_lora_training_client(base_model=MODEL, rank=2)
    real = worker_module.execute
    broken = {"left": 1}

    def execute_once_broken(ctx, batch):
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("a bug in a handler")
        return real(ctx, batch)

    monkeypatch.setattr(worker_module, "execute", execute_once_broken)
    with pytest.raises(trio.ServerError, match="a bug in a handler"):
        tc.forward([datum()]).result(timeout=120)
    assert core.workers[MODEL].thread.is_alive()
    assert tc.forward([datum()]).result(timeout=120).metrics["loss:sum"] > 0  # the next request runs


def test_an_engine_error_is_a_server_error_with_its_request_id_logged(core, monkeypatch, caplog):
    tc = client(core).create_lora_training_client(base_model=MODEL, rank=2)
    host = core.workers[MODEL].engine.host

    def broken(jobs):
        raise ValueError("a shape mismatch deep in the engine")  # a ValueError, yet not the caller's fault

    monkeypatch.setattr(host, "forward", broken)
    with caplog.at_level("ERROR", logger="trio"), pytest.raises(trio.ServerError) as info:
        tc.forward([datum()]).result(timeout=120)
    assert info.value.status_code == 500 and info.value.category == "server"
    assert "shape mismatch" in info.value.message
    assert info.value.request_id and any(
        info.value.request_id in r.getMessage() and "server error" in r.getMessage() for r in caplog.records)


def test_bad_input_stays_a_validation_error_naming_field_index_and_value(core):
    tc = client(core).create_lora_training_client(base_model=MODEL, rank=2)
    bad = trio.Datum(model_input=trio.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": [2, 3, 10**6]})
    with pytest.raises(trio.ValidationError) as info:
        tc.forward([datum(), bad]).result(timeout=120)
    assert info.value.status_code == 400
    assert "data[1]" in info.value.message and "target_tokens" in info.value.message
    assert "1000000" in info.value.message
