"""Fairness: a light tenant's step latency alone, and beside a tenant flooding large batches.

One in-process ServiceCore on the tiny model (``trio/tiny-llama``); two users, each through
the SDK's local transport. The light user trains one run with small steps
(``forward_backward`` of one short datum, then ``optim_step``, waiting for the step). The
flooding user drives several runs, each keeping two large ``forward_backward`` calls in
flight at all times. Blocks alone and beside the flood alternate (ABAB...) so drift in the
machine's load hits both alike; latencies are pooled per condition.

    RESULT fairness_p99 ours=<p99 beside the flood, ms> baseline=<p99 alone, ms> ratio=<beside/alone>
    RESULT fairness_p50 ...

Lower ratios are better; the target is p99 ratio <= 3. The engine cannot stop a pass that
has started, so a light step beside the flood waits, at worst, for the pass running when it
arrives: at most ``--max-pass-tokens`` tokens, as larger requests run in parts of that size
(``trio_server/splitting.py``) and a batch holds no more. The ratio is bounded by about
(one such pass + a light step) / a light step.

Smaller passes cost the flood throughput (less work per pass); the flood alone, with and
without splitting (sliced as if shared: a user alone is not sliced by default),
alternately (``--flood-calls`` forward_backward calls each), reports what:

    RESULT flood_tokens_per_s ours=<split> baseline=<unsplit> ratio=<split/unsplit>

The machine's 1-minute load average is printed per block: the figures are only as quiet as it.

    python benchmarks/fairness.py [--steps 40] [--reps 2] [--flood-runs 3] [--flood-datums 8]
                                  [--flood-tokens 64] [--light-tokens 32] [--max-batch-tokens N]
                                  [--max-pass-tokens N] [--flood-calls 9]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (puts src/ on the path)

import pytrio as trio  # noqa: E402
from pytrio.transport.local import LocalTransport  # noqa: E402
from trio_engine import TINY_LLAMA  # noqa: E402
from trio_server.core import Limits, ServiceCore  # noqa: E402


def data(n_datums: int, n_tokens: int, offset: int = 0) -> list[trio.Datum]:
    toks = [(offset + 7 * k) % 500 + 1 for k in range(n_tokens + 1)]
    return [trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})
            for _ in range(n_datums)]


class Flood:
    """Runs that each keep two large forward_backward calls in flight until stopped."""

    def __init__(self, runs: list[trio.TrainingClient], batch: list[trio.Datum]):
        self.runs, self.batch = runs, batch
        self.stop = threading.Event()
        self.done = 0  # forward_backward calls finished (one writer per run; read for progress only)
        self.threads = [threading.Thread(target=self._drive, args=(tc,), daemon=True) for tc in runs]

    def _drive(self, tc: trio.TrainingClient) -> None:
        in_flight: deque = deque()
        while not self.stop.is_set():
            in_flight.append(tc.forward_backward(self.batch))
            if len(in_flight) >= 2:
                in_flight.popleft().result()
                self.done += 1
        for future in in_flight:  # accepted work is never dropped: wait for it
            future.result()

    def __enter__(self) -> Flood:
        for th in self.threads:
            th.start()
        while self.done == 0:  # the flood is running before the light steps are timed
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for th in self.threads:
            th.join()


def light_steps(tc: trio.TrainingClient, steps: int, batch: list[trio.Datum]) -> list[float]:
    """Milliseconds from submitting forward_backward to optim_step's result, per step."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tc.forward_backward(batch)
        tc.optim_step(trio.AdamParams(learning_rate=1e-4)).result()
        times.append((time.perf_counter() - start) * 1000)
    return times


def p99(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="light steps per block")
    ap.add_argument("--reps", type=int, default=2, help="blocks per condition (alternating)")
    ap.add_argument("--flood-runs", type=int, default=3)
    ap.add_argument("--flood-datums", type=int, default=8)
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--light-tokens", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=Limits().max_batch_tokens)
    ap.add_argument("--max-pass-tokens", type=int, default=Limits().max_pass_tokens, help="0: never split")
    ap.add_argument("--flood-calls", type=int, default=9, help="calls timed per flood-alone throughput block")
    args = ap.parse_args()

    pass_tokens = args.max_pass_tokens or None
    core = ServiceCore(tempfile.mkdtemp(prefix="trio-fairness-"), dtype="float32",
                       limits=Limits(max_batch_tokens=args.max_batch_tokens, max_pass_tokens=pass_tokens))
    light_svc = trio.ServiceClient(transport=LocalTransport(core, "light"))
    flood_svc = trio.ServiceClient(transport=LocalTransport(core, "flood"))
    light = light_svc.create_lora_training_client(base_model=TINY_LLAMA, rank=8)
    flood_runs = [flood_svc.create_lora_training_client(base_model=TINY_LLAMA, rank=8, seed=k)
                  for k in range(args.flood_runs)]
    small, large = data(1, args.light_tokens), data(args.flood_datums, args.flood_tokens, offset=3)
    print(f"light: 1 x {args.light_tokens} tokens + optim_step; flood: {args.flood_runs} runs x "
          f"{args.flood_datums} x {args.flood_tokens} tokens, 2 in flight each; "
          f"max_batch_tokens={args.max_batch_tokens} max_pass_tokens={pass_tokens}", flush=True)
    light_steps(light, 3, small)  # warm-up
    alone: list[float] = []
    beside: list[float] = []
    throughput: dict[int | None, list[float]] = {pass_tokens: [], None: []}
    worker = core.workers[TINY_LLAMA]
    for rep in range(args.reps):
        alone += light_steps(light, args.steps, small)
        started = time.perf_counter()
        with Flood(flood_runs, large) as flood:
            before = flood.done
            beside += light_steps(light, args.steps, small)
            flooded = flood.done - before
        seconds = time.perf_counter() - started
        print(f"block {rep}: alone p50={statistics.median(alone[-args.steps:]):.0f} ms, beside "
              f"p50={statistics.median(beside[-args.steps:]):.0f} ms; flood ran {flooded} forward_backward "
              f"calls ({flooded * args.flood_datums * args.flood_tokens / seconds:.0f} tokens/s) meanwhile; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        worker.slice_alone = True  # the flood alone, sliced as if shared: what slicing costs it
        for split in (pass_tokens, None):
            worker.max_pass_tokens = split
            with Flood(flood_runs, large) as flood:
                before, started = flood.done, time.perf_counter()
                while flood.done < before + args.flood_calls:
                    time.sleep(0.01)
                calls, seconds = flood.done - before, time.perf_counter() - started
                throughput[split].append(calls * args.flood_datums * args.flood_tokens / seconds)
            print(f"  flood alone, max_pass_tokens={split}: {throughput[split][-1]:.0f} tokens/s", flush=True)
        worker.max_pass_tokens, worker.slice_alone = pass_tokens, False
    core.close()
    for name, stat in (("p99", p99), ("p50", statistics.median)):
        ours, base = stat(beside), stat(alone)
        print(f"RESULT fairness_{name} ours={ours:.4g} baseline={base:.4g} ratio={ours / base:.3f}", flush=True)
    ours, base = statistics.median(throughput[pass_tokens]), statistics.median(throughput[None])
    print(f"RESULT flood_tokens_per_s ours={ours:.4g} baseline={base:.4g} ratio={ours / base:.3f}", flush=True)


if __name__ == "__main__":
    main()
