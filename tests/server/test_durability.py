"""A real ``trio serve`` process: SIGKILL during training, restart on the same data dir.

Nothing here depends on how long anything takes: the request that is in flight at the
kill is one that cannot finish by itself (it waits for a sequence number that never
comes, with ``--seq-gap-seconds`` set far beyond the test), and the snapshot the
restart resumes from is awaited by reading it, not by sleeping.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import pytrio as trio
from pytrio.futures import run_sync
from trio_server.errors import RESTART_MESSAGE

from ..sdk.conftest import ServeProcess
from .snapshots import snapshot_step

MODEL = "trio/tiny-llama"


@pytest.fixture
def serve(tmp_path):
    proc = ServeProcess(tmp_path, "--seq-gap-seconds", "3600")
    yield proc
    proc.stop()


def datum():
    toks = [1, 5, 9, 200, 31, 7, 7, 300]
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 7})


def train(tc, steps: int) -> None:
    for _ in range(steps):
        tc.forward_backward([datum()])
        tc.optim_step(trio.AdamParams(learning_rate=1e-2))
    tc.get_info()  # waits for the steps


def logprobs(tc) -> list[float]:
    return tc.forward([datum()]).result().loss_fn_outputs[0]["logprobs"].tolist()


def test_sigkill_mid_training_loses_no_completed_step(serve):
    key = serve.create_key()
    serve.start()
    svc = trio.ServiceClient(base_url=serve.url, api_key=key)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=0)
    train(tc, 2)
    assert snapshot_step(serve.data_dir, tc.model_id) == 2  # on disk when the step was answered
    transport = svc._session.transport

    async def submit_and_wait(op, body, key):
        rid = await transport.submit(op, body, key)
        return rid, await transport.retrieve(rid, 30)

    done_id, done = run_sync(submit_and_wait("get_info", {"model_id": tc.model_id}, "k-info"))
    assert done.status == "done"
    # In flight at the kill: another run's request that waits for its seq 0, never sent.
    other = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=1)
    inflight = run_sync(transport.submit("forward", {"model_id": other.model_id, "seq": 5, "data": [datum().model_dump()]}, "k-x"))
    assert run_sync(transport.retrieve(inflight, 0.5)).status == "pending"

    serve.kill()
    # A call made while the server is down is carried across the restart by the SDK.
    during: list[object] = []
    caller = threading.Thread(target=lambda: during.append(tc.forward([datum()]).result(timeout=300)))
    caller.start()
    serve.start()
    caller.join(300)
    assert not caller.is_alive(), "a client call hung across the restart"
    assert isinstance(during[0], trio.ForwardBackwardOutput), during

    lost = run_sync(transport.retrieve(inflight, 5))
    assert lost.status == "failed" and lost.error.message == RESTART_MESSAGE
    again = run_sync(transport.retrieve(done_id, 5))
    assert again.status == "done" and again.result == done.result

    # The same TrainingClient goes on from step 2 with exactly the weights it had.
    train(tc, 1)
    assert tc.get_info().step == 3
    reference = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=0)
    train(reference, 2)
    at_step_2 = logprobs(reference)
    train(reference, 1)
    assert during[0].loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(at_step_2, abs=1e-6)
    assert logprobs(tc) == pytest.approx(logprobs(reference), abs=1e-6)
    assert logprobs(tc) != pytest.approx(at_step_2, abs=1e-4)  # step 3 did move the weights


def test_http_session_never_imports_torch(serve):
    key = serve.create_key()
    serve.start()
    code = f"""
import sys, pytrio as trio
svc = trio.ServiceClient(base_url={serve.url!r}, api_key={key!r})
tc = svc.create_lora_training_client(base_model={MODEL!r}, rank=2)
tok = tc.get_tokenizer()
ids = tok.encode("hello there, general")
d = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=dict(target_tokens=ids[1:], weights=[1]*(len(ids)-1)))
tc.forward_backward([d], "cross_entropy").result(); tc.optim_step(trio.AdamParams()).result()
s = tc.save_weights_and_get_sampling_client(name="x")
s.sample(trio.ModelInput.from_ints(ids[:3]), 2, trio.SamplingParams(max_tokens=4)).result()
svc.create_rest_client().list_user_checkpoints()
print("torch" in sys.modules)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTRIO_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"

