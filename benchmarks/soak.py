"""Soak: many concurrent clients doing a mix of operations against one ``trio serve`` for a
bounded time, counting errors, lost results and the server's memory growth.

A fresh ``trio serve`` (a subprocess: its RSS is measured alone, with psutil) runs on a
temporary data dir with API keys on; ``--clients`` threads, each with its own
``pytrio.ServiceClient`` over HTTP and one of ``--users`` keys, loop over a mix of
operations until ``--minutes`` have passed, then finish what they submitted:

- trainers (3 in 5 clients): create a run; forward_backward + optim_step back to back
  (the optimizer's step must count 1, 2, 3...); every 5th step save sampler weights
  (overwrite) and sample from them; every 7th save the training state (overwrite) and
  list the run's checkpoints (the name must be there); every 30th step a new run;
- samplers (1 in 5): sample from the base model and compute prompt logprobs;
- OpenAI clients (1 in 5): ``/openai/v1/completions`` on the base model, and ``/models``.

Every submitted operation is tracked until its result. Printed at the end:
errors by kind (target 0; a wrong result counts as one), lost results (an operation
accepted but with no result within ``--lost-after`` seconds; target 0), the server's
RSS after warm-up and at the end (growth target <= 10%), and the throughput.

Usage (not in CI: it runs for minutes):
    python benchmarks/soak.py                    # 50 clients, 10 minutes, trio/tiny-llama
    python benchmarks/soak.py --minutes 2 --clients 20
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))  # trio serve

MODEL = "trio/tiny-llama"
TOKENS = [1, 5, 9, 200, 31, 7, 7, 300, 12, 44]


class Tally:
    """Thread-safe counts of what was submitted and how it ended."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}
        self.lost: collections.Counter[str] = collections.Counter()

    def run(self, op: str, call: Callable[[], Any], lost_after: float, check: Callable[[Any], str | None] = lambda _: None) -> Any:
        """``call()`` returns a pytrio future (or a plain value); wait for it and count it."""
        import pytrio as trio

        try:
            out = call()
            if hasattr(out, "result"):
                out = out.result(timeout=lost_after)
        except trio.TimeoutError as exc:
            self._count(self.lost, op, f"{op}: {exc}")
            return None
        except Exception as exc:
            self._count(self.errors, f"{op}: {type(exc).__name__}", f"{exc}"[:300])
            return None
        wrong = check(out)
        if wrong:
            self._count(self.errors, f"{op}: wrong result", wrong)
            return None
        with self.lock:
            self.ok[op] += 1
        return out

    def _count(self, counter: collections.Counter[str], key: str, example: str) -> None:
        with self.lock:
            counter[key] += 1
            self.examples.setdefault(key, example)


class Client(threading.Thread):
    def __init__(self, index: int, url: str, key: str, tally: Tally, until: float, lost_after: float):
        super().__init__(name=f"soak-{index}", daemon=True)
        self.index, self.url, self.key, self.tally = index, url, key, tally
        self.until, self.lost_after = until, lost_after

    def run(self) -> None:
        import pytrio as trio

        self.service = trio.ServiceClient(base_url=self.url, api_key=self.key)
        role = (self._trainer, self._trainer, self._trainer, self._sampler, self._openai)[self.index % 5]
        try:
            role()
        except Exception as exc:  # a bug of this script, not of the server: still reported
            self.tally._count(self.tally.errors, f"client: {type(exc).__name__}", str(exc)[:300])

    def _op(self, op: str, call: Callable[[], Any], check: Callable[[Any], str | None] = lambda _: None) -> Any:
        return self.tally.run(op, call, self.lost_after, check)

    def _trainer(self) -> None:
        import pytrio as trio

        datum = trio.Datum(model_input=trio.ModelInput.from_ints(TOKENS[:-1]),
                           loss_fn_inputs={"target_tokens": TOKENS[1:]})
        params = trio.SamplingParams(max_tokens=8, temperature=1.0, seed=self.index)
        while time.monotonic() < self.until:
            tc = self._op("create_run", lambda: self.service.create_lora_training_client(base_model=MODEL, rank=2))
            if tc is None:
                return
            for step in range(1, 31):
                if time.monotonic() >= self.until:
                    return
                self._train_step(tc, datum, step, params)

    def _train_step(self, tc: Any, datum: Any, step: int, params: Any) -> None:
        import pytrio as trio

        fb = tc.forward_backward([datum], "cross_entropy")  # both submitted before either is awaited
        opt = tc.optim_step(trio.AdamParams(learning_rate=1e-3))
        self._op("forward_backward", lambda: fb,
                 lambda out: None if math.isfinite(out.metrics["loss:sum"]) else f"loss {out.metrics}")
        self._op("optim_step", lambda: opt, lambda out: None if int(out.metrics["step"]) == step
                 else f"step {out.metrics['step']}, expected {step}")
        if step % 5 == 0:
            self._save_and_sample(tc, params)
        if step % 7 == 0:
            name = f"c{self.index}-state"
            self._op("save_state", lambda: tc.save_state(name, overwrite=True))
            rest = self.service.create_rest_client()
            self._op("list_checkpoints", lambda: rest.list_checkpoints(tc.model_id),
                     lambda out: None if name in [c.name for c in out] else f"{name} not in {out}")

    def _save_and_sample(self, tc: Any, params: Any) -> None:
        import pytrio as trio

        saved = self._op("save_weights", lambda: tc.save_weights_for_sampler(f"c{self.index}", overwrite=True))
        if saved is None:
            return
        sampler = self._op("create_sampler", lambda: self.service.create_sampling_client(model_path=saved.path))
        if sampler is not None:
            self._op("sample", lambda: sampler.sample(trio.ModelInput.from_ints(TOKENS[:4]), 2, params),
                     lambda out: None if len(out.sequences) == 2 and all(len(s.tokens) <= 8 for s in out.sequences)
                     else f"{out}")

    def _sampler(self) -> None:
        import pytrio as trio

        sampler = self._op("create_sampler", lambda: self.service.create_sampling_client(base_model=MODEL))
        if sampler is None:
            return
        prompt = trio.ModelInput.from_ints(TOKENS)
        params = trio.SamplingParams(max_tokens=8, seed=self.index)
        while time.monotonic() < self.until:
            self._op("sample", lambda: sampler.sample(prompt, 3, params),
                     lambda out: None if len(out.sequences) == 3 else f"{len(out.sequences)} sequences")
            self._op("compute_logprobs", lambda: sampler.compute_logprobs(prompt),
                     lambda out: None if len(out) == len(TOKENS) else f"{len(out)} logprobs")

    def _openai(self) -> None:
        import httpx

        with httpx.Client(base_url=self.url + "/openai/v1", timeout=self.lost_after,
                          headers={"Authorization": f"Bearer {self.key}"}) as http:
            def post() -> dict:
                r = http.post("/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 8,
                                                   "seed": self.index})
                r.raise_for_status()
                return r.json()

            def models() -> dict:
                r = http.get("/models")
                r.raise_for_status()
                return r.json()

            while time.monotonic() < self.until:
                self._op("openai_completion", post,
                         lambda out: None if out.get("choices") else f"no choices: {str(out)[:200]}")
                self._op("openai_models", models,
                         lambda out: None if any(m["id"] == MODEL for m in out["data"]) else "model missing")


class RssMonitor(threading.Thread):
    """The server's RSS every ``every`` seconds: (seconds since start, bytes)."""

    def __init__(self, pid: int, every: float = 5.0):
        super().__init__(daemon=True)
        import psutil

        self.process, self.every = psutil.Process(pid), every
        self.samples: list[tuple[float, int]] = []
        self.stopped = threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append((time.monotonic() - self.start_time, self.process.memory_info().rss))
            self.stopped.wait(self.every)

    def median_between(self, start: float, end: float) -> float:
        values = [rss for t, rss in self.samples if start <= t <= end]
        return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long clients submit (bounded)")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--users", type=int, default=5, help="API keys the clients share")
    parser.add_argument("--warmup-fraction", type=float, default=0.2,
                        help="RSS growth is measured from the end of this fraction of the run")
    parser.add_argument("--lost-after", type=float, default=300.0,
                        help="an accepted operation with no result after this many seconds is lost")
    args = parser.parse_args()

    from tests.sdk.conftest import ServeProcess

    with tempfile.TemporaryDirectory() as tmp:
        server = ServeProcess(Path(tmp), "--dtype", "float32")
        server.start()
        try:
            keys = [server.create_key() for _ in range(args.users)]
            return soak(args, server.url, keys, server.proc.pid)
        finally:
            server.stop()


def soak(args: argparse.Namespace, url: str, keys: list[str], pid: int) -> int:
    duration = args.minutes * 60
    tally, rss = Tally(), RssMonitor(pid)
    rss.start()
    started = time.monotonic()
    clients = [Client(i, url, keys[i % len(keys)], tally, started + duration, args.lost_after)
               for i in range(args.clients)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(duration + 2 * args.lost_after + 60)
    elapsed = time.monotonic() - started
    hung = [c.name for c in clients if c.is_alive()]
    rss.stopped.set()
    rss.join()

    warm_end = duration * args.warmup_fraction
    window = max(30.0, duration * 0.05)
    warm = rss.median_between(warm_end, warm_end + window)
    end = rss.median_between(duration - window, duration)
    done, errors, lost = sum(tally.ok.values()), sum(tally.errors.values()), sum(tally.lost.values())
    print(f"soak: {args.clients} clients, {args.users} users, {args.minutes:g} min on {MODEL}; "
          f"{elapsed:.0f} s with draining")
    print("completed by operation:", dict(sorted(tally.ok.items())))
    for kind, counter in (("error", tally.errors), ("lost", tally.lost)):
        for key, n in sorted(counter.items()):
            print(f"  {kind} {key} x{n}: {tally.examples[key]}")
    if hung:
        print(f"  clients still waiting at the end: {hung}")
    print(f"server RSS: start {rss.samples[0][1] / 2**20:.0f} MiB, after warm-up ({warm_end:.0f} s) "
          f"{warm / 2**20:.0f} MiB, at the end {end / 2**20:.0f} MiB, peak {max(r for _, r in rss.samples) / 2**20:.0f} MiB")
    timeline = [f"{t / 60:.0f}m={r / 2**20:.0f}" for t, r in rss.samples[:: max(1, int(60 / rss.every))]]
    print("server RSS (MiB) each minute:", " ".join(timeline))
    growth = (end / warm - 1) * 100
    print(f"RESULT soak_errors ours={errors} target=0")
    print(f"RESULT soak_lost_results ours={lost + len(hung)} target=0")
    print(f"RESULT soak_rss_growth_pct ours={growth:.1f} target<=10")
    print(f"RESULT soak_rss_mib ours={end / 2**20:.1f} baseline={warm / 2**20:.1f} ratio={end / warm:.3f}")
    print(f"RESULT soak_throughput ops_per_s={done / duration:.1f} completed={done}")
    return 0 if errors == 0 and lost == 0 and not hung and growth <= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
