"""Resident memory of one base model with 1 and with 8 rank-32 adapters.

Each adapter after one training step holds its LoRA weights plus AdamW's two moments
(3x the weights, fp32). The target: each extra adapter costs at most 1.1x that.

    RESULT memory_extra_adapter ours=<budget MB> baseline=<measured MB per adapter> ratio=...

(ratio >= 1 means an extra adapter fits in its budget; the base model is loaded once.)
Run: .venv/bin/python benchmarks/memory.py
"""

from __future__ import annotations

import gc

import psutil
import torch
from common import result

from trio_engine import DEFAULT_MODEL, AdamConfig, Example, ForwardJob, LoraConfig, ModelHost


def rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def train_once(host: ModelHost, adapter_id: str) -> None:
    ex = Example(list(range(10, 74)), {"target_tokens": list(range(11, 75))})
    host.forward_backward([ForwardJob(adapter_id, [ex])])
    host.optim_step(adapter_id, AdamConfig())


def main() -> None:
    torch.manual_seed(0)
    host = ModelHost(DEFAULT_MODEL)
    base = rss_mb()
    print(f"base model loaded: {base:.0f} MB RSS")
    host.create_adapter("a0", LoraConfig(rank=32))
    train_once(host, "a0")  # also warms up allocator caches and activation buffers
    one = rss_mb()
    weights_mb = sum(p.numel() * p.element_size() for p in host.adapter_params("a0").values()) / 2**20
    for k in range(1, 8):
        host.create_adapter(f"a{k}", LoraConfig(rank=32, seed=k))
        train_once(host, f"a{k}")
    eight = rss_mb()
    per_adapter = (eight - one) / 7
    budget = 1.1 * 3 * weights_mb  # 1.1x (weights + exp_avg + exp_avg_sq)
    print(f"1 adapter: {one:.0f} MB, 8 adapters: {eight:.0f} MB; adapter weights {weights_mb:.1f} MB, "
          f"weights+Adam {3 * weights_mb:.1f} MB, measured per extra adapter {per_adapter:.1f} MB")
    result("memory_extra_adapter", budget, per_adapter, unit=" (MB budget / MB used)")


if __name__ == "__main__":
    main()
