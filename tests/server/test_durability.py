"""A real ``trio serve`` process: SIGKILL during work, restart on the same data dir."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import pytrio as trio
from pytrio.futures import run_sync
from trio_server.core import RESTART_MESSAGE

from ..sdk.conftest import ServeProcess, free_port

MODEL = "trio/tiny-llama"


@pytest.fixture
def serve(tmp_path):
    proc = ServeProcess(tmp_path, free_port())
    yield proc
    if proc.proc and proc.proc.poll() is None:
        proc.proc.terminate()
        proc.proc.wait(10)


def datum():
    toks = [1, 5, 9, 200, 31, 7, 7, 300]
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 7})


def test_sigkill_and_restart(serve):
    key = serve.create_key()
    serve.start()
    svc = trio.ServiceClient(base_url=serve.url, api_key=key)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=0)
    tc.forward_backward([datum()])
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("before-kill").result().path
    expected = tc.forward([datum()]).result().loss_fn_outputs[0]["logprobs"].tolist()

    transport = svc._session.transport

    async def submit_and_wait(op, body):
        rid = await transport.submit(op, body, f"k-{op}-{time.time()}")
        return rid, await transport.retrieve(rid, 30)

    done_id, done = run_sync(submit_and_wait("get_info", {"model_id": tc.model_id}))
    assert done.status == "done"
    # in flight at the kill: loading the bundled model takes seconds
    inflight = run_sync(transport.submit("create_model", {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "k-x"))

    outcomes: list[str] = []

    def keep_calling():  # a client that keeps calling across the restart
        for _ in range(8):
            try:
                tc.forward([datum()]).result(timeout=120)
                outcomes.append("ok")
            except trio.TrioError as exc:
                outcomes.append(type(exc).__name__)
            time.sleep(0.3)

    caller = threading.Thread(target=keep_calling)
    caller.start()
    time.sleep(0.5)
    serve.kill()
    time.sleep(1.0)
    serve.start()
    caller.join(300)
    assert not caller.is_alive(), "a client call hung across the restart"
    assert outcomes and all(o in ("ok", "NotFoundError", "ServerError", "ConnectionError") for o in outcomes), outcomes

    async def retrieve(rid):
        return await transport.retrieve(rid, 5)

    again = run_sync(retrieve(done_id))
    assert again.status == "done" and again.result == done.result
    lost = run_sync(retrieve(inflight))
    assert lost.status == "failed" and lost.error.message == RESTART_MESSAGE

    rest = svc.create_rest_client()
    assert tc.model_id in [r.run_id for r in rest.list_training_runs()]
    restored = svc.create_training_client_from_state_with_optimizer(path)
    got = restored.forward([datum()]).result().loss_fn_outputs[0]["logprobs"].tolist()
    assert got == pytest.approx(expected, abs=1e-6)


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
