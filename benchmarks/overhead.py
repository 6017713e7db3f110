"""What the HTTP service and the Ray engine cost over the in-process (embedded) service.

The same SDK calls run through three services: the local transport on a ServiceCore
in this process (the baseline); ``trio serve`` in a subprocess on loopback (HTTP);
and a ServiceCore in this process whose model host is a Ray actor on a local Ray
instance (``--engine ray``). Each comparison alternates ours and the baseline call by
call (ABAB...) and takes medians, so drift hits both alike.

    RESULT http_train_step_8x128  ours=<steps/s over HTTP> baseline=<steps/s in-process> ratio=...
    RESULT ray_train_step_8x128   ours=<steps/s via the actor> baseline=... ratio=...
    RESULT {http,ray}_sample, {http,ray}_trivial_call ...
    RESULT {http,ray}_burst_200   ours=<futures/s> baseline=<futures/s> ratio=...
    BURST  <service> futures=200 p50_ms=... p99_ms=... errors=...

Targets: HTTP train step >= 0.9; Ray train step and sample >= 0.93; burst errors = 0.
Run: .venv/bin/python benchmarks/overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from common import result, timed_pair

import pytrio as trio
from pytrio.transport.local import LocalTransport
from trio_engine import DEFAULT_MODEL
from trio_server.core import ServiceCore

TINY = "trio/tiny-llama"


def start_server(data_dir: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trio_server.cli", "serve", "--port", str(port), "--data-dir", str(data_dir), "--no-auth"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("server did not start")


def dense_batch(vocab: int = 49152) -> list[trio.Datum]:
    rng = random.Random(0)
    data = []
    for _ in range(8):
        toks = [rng.randrange(vocab) for _ in range(129)]
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:]}))
    return data


def workload(service: trio.ServiceClient) -> dict[str, Callable[[], object]]:
    """One call of each kind, ready to time, on one service."""
    tc = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=32, seed=0)
    data = dense_batch()

    def step():
        fb = tc.forward_backward(data)
        tc.optim_step(trio.AdamParams(learning_rate=1e-5)).result()
        fb.result()

    sampler = service.create_sampling_client(base_model=DEFAULT_MODEL)
    prompt = trio.ModelInput.from_ints(list(range(100, 140)))
    params = trio.SamplingParams(max_tokens=16, temperature=1.0, seed=0)
    return {
        "train_step_8x128": step,
        "sample": lambda: sampler.sample(prompt, 4, params).result(),
        "trivial_call": lambda: tc.get_info(),
    }


def compare(name: str, ours: dict[str, Callable[[], object]], baseline: dict[str, Callable[[], object]],
            repeats: int) -> None:
    for kind, runs in (("train_step_8x128", repeats), ("sample", 3 * repeats), ("trivial_call", 20 * repeats)):
        timings = timed_pair(ours[kind], baseline[kind], repeats=runs)
        result(f"{name}_{kind}", 1 / timings["ours"], 1 / timings["baseline"], " (per s)", timings.spread())


def burst(service: trio.ServiceClient, threads: int = 8, per_thread: int = 25) -> tuple[float, list[float], int]:
    """200 futures from 8 threads at once; returns (futures/s, latencies in s, errors)."""
    clients = [service.create_lora_training_client(base_model=TINY, rank=2, seed=k) for k in range(threads)]
    toks = list(range(1, 18))
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def drive(tc):
        submitted = [(time.perf_counter(), tc.forward([datum])) for _ in range(per_thread)]
        for started, fut in submitted:
            try:
                fut.result(timeout=300)
                with lock:
                    latencies.append(time.perf_counter() - started)
            except trio.TrioError:
                with lock:
                    errors[0] += 1

    workers = [threading.Thread(target=drive, args=(tc,)) for tc in clients]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * per_thread / (time.perf_counter() - start), latencies, errors[0]


def report_burst(name: str, service: trio.ServiceClient, baseline_rate: float) -> None:
    rate, latencies, errors = burst(service)
    result(f"{name}_burst_200", rate, baseline_rate, unit=" (futures/s)")
    qs = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0] * 99
    print(f"BURST {name} futures={len(latencies) + errors} p50_ms={qs[49] * 1000:.0f} "
          f"p99_ms={qs[98] * 1000:.0f} errors={errors}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.pop("PYTRIO_BASE_URL", None)
    with tempfile.TemporaryDirectory() as tmp:
        local = trio.ServiceClient(transport=LocalTransport(ServiceCore(Path(tmp) / "local")))
        on_ray = trio.ServiceClient(transport=LocalTransport(ServiceCore(Path(tmp) / "ray", engine="ray")))
        port = 8000 + random.Random().randrange(1000)
        proc = start_server(Path(tmp) / "http", port)
        try:
            remote = trio.ServiceClient(base_url=f"http://127.0.0.1:{port}")
            base = workload(local)
            compare("http", workload(remote), base, args.repeats)
            compare("ray", workload(on_ray), base, args.repeats)
            base_burst, _, _ = burst(local)
            report_burst("http", remote, base_burst)
            report_burst("ray", on_ray, base_burst)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
