"""What the HTTP service costs over the in-process (embedded) service.

The same SDK calls run twice: through the local transport on a ServiceCore in this
process (the baseline), and through ``trio serve`` in a subprocess on loopback (ours).

    RESULT http_train_step_8x128  ours=<steps/s over HTTP> baseline=<steps/s in-process> ratio=...
    RESULT http_sample            ours=<calls/s>  baseline=<calls/s>  ratio=...
    RESULT http_trivial_call      ours=<calls/s>  baseline=<calls/s>  ratio=...
    RESULT http_burst_200         ours=<futures/s> baseline=<futures/s> ratio=...
    BURST  p50_ms=... p99_ms=... errors=...

Targets: train step ratio >= 0.9 (HTTP within 10%), burst errors = 0.
Run: .venv/bin/python benchmarks/overhead.py
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import result, timed

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


def measure(service: trio.ServiceClient) -> dict[str, float]:
    """Rates (per second) of each call type through one service client."""
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
        "train_step_8x128": 1 / timed(step, repeats=3),
        "sample": 1 / timed(lambda: sampler.sample(prompt, 4, params).result(), repeats=5),
        "trivial_call": 1 / timed(lambda: tc.get_info(), repeats=30, warmup=3),
    }


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


def main() -> None:
    os.environ.pop("PYTRIO_BASE_URL", None)
    with tempfile.TemporaryDirectory() as tmp:
        local = trio.ServiceClient(transport=LocalTransport(ServiceCore(Path(tmp) / "local")))
        port = 8000 + random.Random().randrange(1000)
        proc = start_server(Path(tmp) / "http", port)
        try:
            remote = trio.ServiceClient(base_url=f"http://127.0.0.1:{port}")
            # one process at a time on the 2 cores: measure local, then HTTP
            base_rates = measure(local)
            base_burst, _, _ = burst(local)
            http_rates = measure(remote)
            http_burst, latencies, errors = burst(remote)
        finally:
            proc.terminate()
            proc.wait(30)
    for name in base_rates:
        result(f"http_{name}", http_rates[name], base_rates[name], unit=" (per s)")
    result("http_burst_200", http_burst, base_burst, unit=" (futures/s)")
    qs = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0] * 99
    print(f"BURST futures={len(latencies) + errors} p50_ms={qs[49] * 1000:.0f} p99_ms={qs[98] * 1000:.0f} "
          f"errors={errors}", flush=True)


if __name__ == "__main__":
    main()
