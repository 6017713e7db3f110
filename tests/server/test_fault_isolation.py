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
