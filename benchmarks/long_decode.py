"""Decode steps late in long generations: the sampler's KV cache
(``trio_engine.kv_cache.GrowingCache``, which grows in place; a bf16 step on the CPU reads
its whole buffers, room hidden) vs transformers' ``DynamicCache``, which appends each step
by copying the whole cache.

For each cache length L, one request of 8 samples whose prompt is L tokens is admitted
(prefill not timed), then 16 decode steps are timed; both caches run in turn (ABAB...),
medians of the repeats. No adapter, EOS suppressed.

    RESULT long_decode_<dtype>_<L> ours=<steps/s> baseline=<steps/s> ratio=...

Run: .venv/bin/python benchmarks/long_decode.py [--dtypes float32,bfloat16] [--lengths 256,1024,2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import result
from transformers import DynamicCache

from trio_engine import DEFAULT_MODEL, DecodeBatch, ModelHost, SampleRequest, SamplingConfig

ROWS = 8
STEPS = 16


def decode_seconds(host: ModelHost, length: int, cache_class: type[DynamicCache] | None) -> float:
    """Seconds of STEPS decode steps of ROWS rows after a ``length``-token prompt."""
    prompt = torch.randint(100, host.tokenizer.vocab_size - 100, (length,), generator=torch.Generator().manual_seed(0))
    request = SampleRequest(None, prompt.tolist(), ROWS,
                            SamplingConfig(max_tokens=STEPS + 2, temperature=1.0, seed=0, ignore_eos=True))
    batch = DecodeBatch(host, None)
    if cache_class is not None:  # None: the sampler's own
        batch.cache_class = cache_class
    with torch.no_grad():
        host.admit(batch, [request], ["long"])
        host.decode_step(batch)  # the first draw: from here each step appends one position per row
        start = time.perf_counter()
        for _ in range(STEPS):
            host.decode_step(batch)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for dtype in args.dtypes.split(","):
        host = ModelHost(DEFAULT_MODEL, dtype=dtype)
        for length in (int(n) for n in args.lengths.split(",")):
            caches = {"ours": None, "baseline": DynamicCache}
            seconds: dict[str, list[float]] = {name: [] for name in caches}
            for repeat in range(args.repeats + 1):  # the first round warms up, untimed
                for name, cache_class in caches.items():
                    took = decode_seconds(host, length, cache_class)
                    if repeat:
                        seconds[name].append(took)
            ours, baseline = (statistics.median(seconds[name]) for name in caches)
            spread = " ".join(f"{name} {min(s):.3f}-{max(s):.3f} s" for name, s in seconds.items())
            print(f"# {dtype}, {ROWS} rows, {length} tokens cached: {spread}")
            result(f"long_decode_{dtype}_{length}", STEPS / ours, STEPS / baseline, unit=" (decode steps/s)")
        del host


if __name__ == "__main__":
    main()
