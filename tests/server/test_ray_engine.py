"""``--engine ray`` on a real two-node Ray cluster on loopback.

The cluster is two ``ray start`` processes on this machine (a head, and a second node
offering the custom resource ``trio_node_b``), on the loopback interface. The
service core runs in this process and joins it; the tiny model is pinned to the second
node. Compared against the in-process engine, never against earlier output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_engine import AdamConfig
from trio_server.core import Limits, ServiceCore
from trio_server.engine import SnapshotLost

from .snapshots import snapshot_step

MODEL = "trio/tiny-llama"
NODE_B = "trio_node_b"
RAY = str(Path(sys.executable).with_name("ray"))


def ray_cli(*args: str, env: dict[str, str]) -> None:
    out = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def stop_cluster(temp_dir: str) -> None:
    """End this cluster's processes only (``ray stop`` would end every Ray on the machine)."""
    import psutil

    roots = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    # with their children: agents rename themselves (ray::DashboardAgent), hiding the path
    ours = list({p.pid: p for root in roots for p in (root, *root.children(recursive=True))}.values())
    for proc in ours:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(ours, timeout=30)
    shutil.rmtree(temp_dir, ignore_errors=True)


def free_port() -> int:
    """A port free now, between Ray's default worker ports (to 19999) and Linux's ephemeral
    range (from 32768): a port from that range (20000-39999 were drawn) could be taken by
    any outgoing connection meanwhile, and once was ("Failed to start the grpc server")."""
    for _ in range(100):
        port = 20000 + secrets.randbelow(12000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-31999")


@pytest.fixture(scope="module")
def ray_cluster():
    """(address, node id of the second node); the cluster's processes are ended afterwards."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="trio-ray-", dir="/tmp")  # short: Ray puts sockets below it
    # Loopback only, and no token: these nodes exist for this test on this machine. A real
    # cluster runs with RAY_AUTH_MODE=token (docs/scaling.md).
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=200000000",
              "--disable-usage-stats"]
    address = f"127.0.0.1:{port}"
    try:
        # one GPU declared (the actors still compute on the CPU): models that ask for GPUs
        # are placed by their share of it (test_models_past_the_clusters_gpus_are_refused_by_name)
        ray_cli("start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=false",
                "--num-gpus=1", *common, env=env)
        ray_cli("start", f"--address={address}", f'--resources={{"{NODE_B}": 1}}', *common, env=env)
        ray.init(address=address, namespace="trio", _node_ip_address="127.0.0.1")
        node_b = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and NODE_B in n["Resources"])
        yield address, node_b
    finally:
        ray.shutdown()
        stop_cluster(temp_dir)


@pytest.fixture(scope="module")
def cores(ray_cluster, tmp_path_factory):
    """A core on the Ray cluster (model pinned to node b), and an in-process reference."""
    address, _ = ray_cluster
    sliced = Limits(slice_alone=True)  # one user's large calls run in passes too (see train)
    on_ray = ServiceCore(tmp_path_factory.mktemp("ray-core"), dtype="float32", engine="ray", device="cpu",
                         ray_address=address, ray_placement={MODEL: NODE_B}, limits=sliced)  # off the GPU declared
    local = ServiceCore(tmp_path_factory.mktemp("local-core"), dtype="float32", limits=sliced)
    yield on_ray, local
    on_ray.close()
    local.close()
    shutil.rmtree(on_ray.data_dir, ignore_errors=True)


def client(core) -> trio.ServiceClient:
    return trio.ServiceClient(transport=LocalTransport(core))


def datum(shift: int = 0):
    toks = [(t + shift) % 400 + 1 for t in (1, 5, 9, 200, 31, 7, 7, 300, 44, 12)]
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 9})


def train(tc, steps: int, first: int = 0) -> list[float]:
    """Steps ``first .. first + steps - 1`` of one fixed data schedule."""
    losses = []
    for k in range(first, first + steps):
        # 8 x 9 = 72 tokens: over the default max_pass_tokens (64), so each call runs as two
        # passes (slice_alone), and the actor holds and frees the run's grads between them
        fb = tc.forward_backward([datum(k), datum(k + 3)] * 4)
        tc.optim_step(trio.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
    tc.get_info()
    return losses


def logprobs(tc) -> list[float]:
    return tc.forward([datum(7)]).result().loss_fn_outputs[0]["logprobs"].tolist()


def test_model_pinned_to_second_node_trains_and_samples_like_in_process(ray_cluster, cores):
    _, node_b = ray_cluster
    on_ray, local = cores
    runs = [client(core).create_lora_training_client(base_model=MODEL, rank=4, seed=3) for core in cores]
    assert runs[0].get_info().model_info["ray_node_id"] == node_b
    assert runs[0].get_info().model_info["pid"] != os.getpid()
    ray_losses, local_losses = (train(tc, 3) for tc in runs)
    assert ray_losses == pytest.approx(local_losses, abs=1e-5)
    assert ray_losses[-1] < ray_losses[0]

    params = trio.SamplingParams(max_tokens=6, temperature=0.0)
    prompt = trio.ModelInput.from_ints([1, 5, 9, 200])
    outs = [tc.save_weights_and_get_sampling_client(name="s").sample(prompt, 2, params).result() for tc in runs]
    assert [s.tokens for s in outs[0].sequences] == [s.tokens for s in outs[1].sequences]
    assert len(outs[0].sequences[0].tokens) == 6
    assert outs[0].sequences[0].logprobs == pytest.approx(outs[1].sequences[0].logprobs, abs=1e-5)


def test_actor_sigkill_continues_from_last_completed_step(cores):
    on_ray, _ = cores
    svc = client(on_ray)
    tc = svc.create_lora_training_client(base_model=MODEL, rank=4, seed=5)
    train(tc, 2)
    assert snapshot_step(on_ray.data_dir, tc.model_id) == 2  # on disk when the step was answered
    before = logprobs(tc)
    engine = on_ray.workers[MODEL].engine
    _, write = engine.optim_step(tc.model_id, AdamConfig(learning_rate=1e-2))  # no grads: changes nothing
    engine.durable(write)  # the actor's own write: waited for on its "durable" thread
    pid = tc.get_info().model_info["pid"]
    os.kill(pid, signal.SIGKILL)

    assert logprobs(tc) == pytest.approx(before, abs=1e-6)  # the next call: same weights
    engine.durable(write)  # asked of the restarted actor: the dead one's write had landed, so it is kept
    with pytest.raises(SnapshotLost):  # a write it never made (of a later step) is lost
        engine.durable(dataclasses.replace(write, step=write.step + 1))
    assert tc.get_info().model_info["pid"] != pid  # on a new actor process
    train(tc, 1, first=2)
    assert tc.get_info().step == 3
    reference = svc.create_lora_training_client(base_model=MODEL, rank=4, seed=5)
    train(reference, 3)
    assert logprobs(tc) == pytest.approx(logprobs(reference), abs=1e-6)
    assert logprobs(tc) != pytest.approx(before, abs=1e-4)


def test_calls_since_an_actor_restart_are_not_stepped_on_without_the_ones_it_lost(cores):
    """Two forward_backward calls answered, the actor killed, the loop goes on: a third
    call, then optim_step. The new actor holds the third call's gradients alone; the step
    made on them was answered done (a third of the batch). It is refused naming the lost
    calls, the third's gradients dropped too; run again, the step equals an uninterrupted one.
    A run offloaded with its calls' gradients before the kill lost nothing: it steps on them."""
    on_ray, _ = cores
    svc = client(on_ray)
    tc, reference, offloaded = (svc.create_lora_training_client(base_model=MODEL, rank=4, seed=11) for _ in range(3))
    for k in range(2):
        tc.forward_backward([datum(k)]).result()
    for k in range(3):
        offloaded.forward_backward([datum(k)]).result()
    worker = on_ray.workers[MODEL]
    del worker.last_used[offloaded.model_id]  # as HostWorker._offload_runs does it (the worker is idle)
    worker.engine.offload(offloaded.model_id)
    os.kill(tc.get_info().model_info["pid"], signal.SIGKILL)
    logprobs(tc)  # a call that only reads waits out the restart (a training call would fail with it)
    tc.forward_backward([datum(2)]).result()
    with pytest.raises(trio.ServerError, match=r"gradients of the 3 forward_backward call\(s\) .* \(2 made "
                                               r"before it; the 1 made since are dropped"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    for trainee in (tc, reference):
        for k in range(3):
            trainee.forward_backward([datum(k)]).result()
        trainee.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    offloaded.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    assert tc.get_info().step == offloaded.get_info().step == 1
    assert logprobs(tc) == pytest.approx(logprobs(reference), abs=1e-6)
    assert logprobs(offloaded) == pytest.approx(logprobs(reference), abs=1e-6)


def test_a_step_that_first_hears_of_an_actor_restart_is_refused_once(cores):
    """The step is the first call after the kill: it learns of the restart itself, finds
    no gradients and is refused; the calls run again, the next step is made (it was
    refused again, for the same lost calls)."""
    on_ray, _ = cores
    svc = client(on_ray)
    tc, reference = (svc.create_lora_training_client(base_model=MODEL, rank=4, seed=13) for _ in range(2))
    for k in range(2):
        tc.forward_backward([datum(k)]).result()
    os.kill(tc.get_info().model_info["pid"], signal.SIGKILL)
    with pytest.raises(trio.ServerError, match=r"gradients of the 2 forward_backward call\(s\) .* were lost"):
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    for trainee in (tc, reference):
        for k in range(2):
            trainee.forward_backward([datum(k)]).result()
        trainee.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    assert logprobs(tc) == pytest.approx(logprobs(reference), abs=1e-6)


def test_a_snapshot_wait_does_not_hold_up_the_actors_calls(cores):
    """``durable`` runs in a concurrency group of its own: while it waits for a write not
    yet asked for, the actor answers calls, and the optim_step that asks for the write ends
    the wait. (In the actor's one default group the call would queue behind the wait for
    good: the timeouts only turn such a hang into a failure.)"""
    import ray

    on_ray, _ = cores
    tc = client(on_ray).create_lora_training_client(base_model=MODEL, rank=4, seed=7)
    engine = on_ray.workers[MODEL].engine
    _, write = engine.optim_step(tc.model_id, AdamConfig(learning_rate=1e-2))  # no grads: changes nothing
    engine.durable(write)
    next_write = dataclasses.replace(write, write=write.write + 1, step=write.step + 1)
    waiting = engine.actor.durable.remote(next_write)
    _, info = ray.get(engine.actor.call.remote(None, "adapter_info", tc.model_id), timeout=120)
    assert info.step == write.step
    assert ray.wait([waiting], timeout=0)[0] == []  # still waiting: nothing has asked for that write
    _, asked = engine.optim_step(tc.model_id, AdamConfig(learning_rate=1e-2))
    assert asked.write == next_write.write
    ray.get(waiting, timeout=120)


def test_models_past_the_clusters_gpus_are_refused_by_name(ray_cluster, tmp_path):
    """An actor asking for a GPU share the cluster has no room for would stay pending, and
    its model's first call wait for good: the model is refused, naming what holds the GPUs."""
    address, _ = ray_cluster
    core = ServiceCore(tmp_path, dtype="float32", engine="ray", ray_address=address, device="auto")
    try:
        svc = client(core)
        svc.create_lora_training_client(base_model=MODEL, rank=2).forward([datum()]).result()
        with pytest.raises(trio.ValidationError, match=r"'trio/tiny-qwen3' needs 1 of a GPU, and this Ray cluster's "
                                                   r"1 GPUs are taken \(by trio/tiny-llama 1\).*--ray-gpus-per-model"):
            svc.create_lora_training_client(base_model="trio/tiny-qwen3", rank=2)
        from trio_server import store as tables

        assert [r["op"] for r in core.store.select(tables.requests) if r["status"] == "pending"] == []  # nothing kept
    finally:
        core.close()


def test_gpu_shares_fit_while_they_add_up_to_the_clusters_gpus(monkeypatch):
    import ray

    from trio_server.errors import ServiceError
    from trio_server.ray_engine import check_gpu_room

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "GPU": 2.0})
    check_gpu_room("c", 0.5, {"a": 1.0, "b": 0.5})  # 2 of 2
    with pytest.raises(ServiceError, match=r"'d' needs 0.25 of a GPU.*2 GPUs are taken \(by a 1, b 0.5, c 0.5\)"):
        check_gpu_room("d", 0.25, {"a": 1.0, "b": 0.5, "c": 0.5})
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    with pytest.raises(ServiceError, match=r"0 GPUs are taken \(by none\)"):
        check_gpu_room("a", 1.0, {})


@pytest.mark.parametrize("share", [0, -1, 1.5, float("nan")])
def test_a_gpu_share_that_is_neither_a_fraction_nor_whole_gpus_is_refused(share, tmp_path):
    with pytest.raises(ValueError, match=r"ray_gpus_per_model: a fraction of one GPU or a whole number"):
        ServiceCore(tmp_path, ray_gpus_per_model=share)
