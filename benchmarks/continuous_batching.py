"""Continuous batching vs run-to-completion batching, requests arriving over time.

16 sampling requests arrive 50 ms apart (one prompt, 1 sample each, EOS suppressed so
each runs exactly its max_tokens). Both policies run on the same host, in this process:

    continuous:         each step first admits every request that has arrived into the
                        running decode batch (``ModelHost.admit``), then decodes one token
                        (``ModelHost.decode_step``); a finished request leaves at once.
                        This is what the service's worker does.
    run-to-completion:  (the baseline, the worker before continuous batching) when idle,
                        take every request that has arrived and run them together until
                        the last one finishes (``ModelHost.sample``); the rest wait.

Throughput is generated tokens / (last completion - first arrival); latency is a
request's completion - its arrival. The runs alternate (ABAB...), medians reported.

    RESULT cb_<lengths>_throughput     ours=<tokens/s> baseline=<tokens/s> ratio=...
    RESULT cb_<lengths>_first_latency  ours=<1/s> baseline=<1/s> ratio=...   (inverse latency: higher is better)
    RESULT cb_<lengths>_mean_latency   ours=<1/s> baseline=<1/s> ratio=...

``--lengths mixed`` (default) gives the requests max_tokens cycling 64, 16, 32, 48
(rollouts of different lengths); ``uniform`` gives each 32.

Run: .venv/bin/python benchmarks/continuous_batching.py [--model trio/tiny-llama] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import result

from trio_engine import DEFAULT_MODEL, ModelHost, SampleRequest, SamplingConfig

LENGTHS = {"mixed": [64, 16, 32, 48], "uniform": [32]}


def make_requests(host: ModelHost, n: int, lengths: list[int]) -> list[SampleRequest]:
    prompt = host.tokenizer.encode("Question: What is 15 + 27?\nReturn only the final numeric answer.\nAnswer:")
    return [SampleRequest(None, prompt, 1, SamplingConfig(max_tokens=lengths[k % len(lengths)], temperature=1.0,
                                                          seed=k, ignore_eos=True)) for k in range(n)]


def _wait_for(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def continuous(host: ModelHost, requests: list[SampleRequest], gap: float) -> tuple[float, list[float]]:
    """(seconds from first arrival to last completion, each request's latency)."""
    start = time.perf_counter()
    arrivals = [start + k * gap for k in range(len(requests))]
    done: dict[int, float] = {}
    batch = host.decode_batch()
    admitted = 0
    while len(done) < len(requests):
        now = time.perf_counter()
        arrived = [k for k in range(admitted, len(requests)) if arrivals[k] <= now]
        if arrived:
            host.admit(batch, [requests[k] for k in arrived], list(arrived))
            admitted = arrived[-1] + 1
        if not len(batch):
            _wait_for(arrivals[admitted])
            continue
        for ticket, _ in host.decode_step(batch):
            done[int(ticket)] = time.perf_counter()  # type: ignore[call-overload]
    return max(done.values()) - start, [done[k] - arrivals[k] for k in range(len(requests))]


def run_to_completion(host: ModelHost, requests: list[SampleRequest], gap: float) -> tuple[float, list[float]]:
    start = time.perf_counter()
    arrivals = [start + k * gap for k in range(len(requests))]
    done: dict[int, float] = {}
    taken = 0
    while taken < len(requests):
        _wait_for(arrivals[taken])
        now = time.perf_counter()
        arrived = [k for k in range(taken, len(requests)) if arrivals[k] <= now]
        host.sample([requests[k] for k in arrived])
        finished = time.perf_counter()
        done.update(dict.fromkeys(arrived, finished))
        taken = arrived[-1] + 1
    return max(done.values()) - start, [done[k] - arrivals[k] for k in range(len(requests))]


Policy = Callable[[ModelHost, list[SampleRequest], float], tuple[float, list[float]]]


def measure(host: ModelHost, requests: list[SampleRequest], gap: float, repeats: int) -> dict[str, list]:
    """Each policy ``repeats`` times, alternating, after one untimed warm-up of each on all
    the requests (so that the weights are packed, ``lora.PackedWeights``, or where they are
    not, the batch sizes it meets have had their product forms decided:
    ``lora.decide_few_row_forms``)."""
    policies: dict[str, Policy] = {"ours": continuous, "baseline": run_to_completion}
    for policy in policies.values():
        policy(host, requests, gap)
    runs: dict[str, list] = {name: [] for name in policies}
    for _ in range(repeats):
        for name, policy in policies.items():
            runs[name].append(policy(host, requests, gap))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--lengths", default="mixed", choices=sorted(LENGTHS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); on a "
                        "shared, loaded machine 1 thread gives steadier figures")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    host = ModelHost(args.model, dtype=args.dtype)
    requests = make_requests(host, args.requests, LENGTHS[args.lengths])
    tokens = sum(r.config.max_tokens for r in requests)
    runs = measure(host, requests, args.gap_ms / 1000, args.repeats)
    median = {name: {
        "throughput": statistics.median(tokens / total for total, _ in rs),
        "first": statistics.median(lat[0] for _, lat in rs),
        "mean": statistics.median(statistics.mean(lat) for _, lat in rs),
    } for name, rs in runs.items()}
    ours, base = median["ours"], median["baseline"]
    name = f"cb_{args.lengths}"
    print(f"# {args.model} {args.dtype}: {args.requests} requests {args.gap_ms:g} ms apart, {tokens} tokens; "
          f"first latency ours={ours['first']:.3f}s baseline={base['first']:.3f}s, "
          f"mean latency ours={ours['mean']:.3f}s baseline={base['mean']:.3f}s")
    result(f"{name}_throughput", ours["throughput"], base["throughput"], unit=" (tokens/s)")
    result(f"{name}_first_latency", 1 / ours["first"], 1 / base["first"], unit=" (1/s)")
    result(f"{name}_mean_latency", 1 / ours["mean"], 1 / base["mean"], unit=" (1/s)")


if __name__ == "__main__":
    main()
