"""Many tenants on one base model: resident adapters stepping in turn, and co-batching.

Bundled SmolLM2-135M, rank-32 adapters on every block linear, AdamW.

1. ``tenants_32_resident``: 32 adapters resident, each doing a training step
   (forward_backward + optim_step, 2 x 128 tokens) in turn, vs one adapter doing the
   same steps. What a base model shared by many users costs per token when their steps
   alternate (cold caches, one adapter's weights and moments after another's).
   Target: ratio >= 0.9.

2. ``tenants_4_cobatched``: 4 tenants' ``forward_backward`` calls (2 x 128 tokens each)
   as one host call, which the worker makes of calls queued together, vs the same four
   calls one at a time. Target: ratio >= 1.5.

    RESULT tenants_32_resident ours=<tokens/s, 32 adapters in turn> baseline=<tokens/s, one adapter> ratio=...
    RESULT tenants_4_cobatched ours=<tokens/s, one call> baseline=<tokens/s, four calls> ratio=...

Run: .venv/bin/python benchmarks/tenants.py [--repeats 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import random

import torch
from common import result, timed_interleaved

from trio_engine import DEFAULT_MODEL, AdamConfig, Example, ForwardJob, LoraConfig, ModelHost

RESIDENT = 32
COBATCHED = 4
ROWS, LENGTH = 2, 128


def batch(vocab: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    seqs = [[rng.randrange(vocab) for _ in range(LENGTH + 1)] for _ in range(ROWS)]
    return [Example(s[:-1], {"target_tokens": s[1:]}) for s in seqs]


def train_steps(host: ModelHost, adapters: list[str], data: dict[str, list[Example]]):
    """One training step of each adapter in ``adapters``, in order."""

    def run() -> None:
        for adapter in adapters:
            host.forward_backward([ForwardJob(adapter, data[adapter])])
            host.optim_step(adapter, AdamConfig(learning_rate=1e-4))

    return run


def forward_backward_calls(host: ModelHost, jobs: list[ForwardJob], together: bool):
    def run() -> None:
        if together:
            host.forward_backward(jobs)
        else:
            for job in jobs:
                host.forward_backward([job])
        for job in jobs:
            host.zero_grad(job.adapter_id)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.manual_seed(0)
    host = ModelHost(DEFAULT_MODEL, dtype=getattr(torch, args.dtype))
    names = [f"t{k}" for k in range(RESIDENT)]
    for k, name in enumerate(names):
        host.create_adapter(name, LoraConfig(rank=32, seed=k, train_unembed=False))
    data = {name: batch(host.vocab_size, k) for k, name in enumerate(names)}
    print(f"{RESIDENT} adapters resident; each step {ROWS}x{LENGTH} tokens", flush=True)

    # the same number of steps either way: 32 adapters once each, or t0 32 times
    medians = timed_interleaved({
        "in_turn": train_steps(host, names, data),
        "single": train_steps(host, [names[0]] * RESIDENT, data),
    }, args.repeats)
    tokens = RESIDENT * ROWS * LENGTH
    result("tenants_32_resident", tokens / medians["in_turn"], tokens / medians["single"], " (tokens/s)",
           medians.spread("in_turn", "single"))

    jobs = [ForwardJob(name, data[name]) for name in names[:COBATCHED]]
    medians = timed_interleaved({
        "together": forward_backward_calls(host, jobs, together=True),
        "apart": forward_backward_calls(host, jobs, together=False),
    }, args.repeats)
    tokens = COBATCHED * ROWS * LENGTH
    result("tenants_4_cobatched", tokens / medians["together"], tokens / medians["apart"], " (tokens/s)",
           medians.spread("together", "apart"))


if __name__ == "__main__":
    main()
