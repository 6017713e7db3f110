"""The service core's worker really batches work from different runs into one pass."""

from __future__ import annotations

import time

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_server.core import ServiceCore

MODEL = "trio/tiny-llama"


def test_forward_backward_of_different_runs_share_one_pass(tmp_path):
    core = ServiceCore(tmp_path, dtype="float32")
    svc = trio.ServiceClient(transport=LocalTransport(core))
    runs = [svc.create_lora_training_client(base_model=MODEL, rank=2, seed=k) for k in range(3)]
    host = core.workers[MODEL].host()
    calls: list[int] = []
    real = host.forward_backward

    def spy(jobs):
        calls.append(len(jobs))
        return real(jobs)

    host.forward_backward = spy
    toks = list(range(1, 9))
    d = trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})
    with host.lock:  # keep the worker busy so all three queue up
        blocker = runs[0].forward([d])
        futures = [tc.forward_backward([d]) for tc in runs]
        time.sleep(0.5)
    blocker.result()
    results = [f.result() for f in futures]
    assert calls == [3], calls
    assert all(r.metrics["loss:sum"] > 0 for r in results)
    core.close()
