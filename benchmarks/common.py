"""Shared helpers for the benchmark scripts (not part of the product)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from trio_engine import DEFAULT_MODEL  # noqa: E402
from trio_engine.catalog import Catalog, converted_gguf_folder  # noqa: E402


def bundled_folder() -> Path:
    return converted_gguf_folder(Catalog().resolve(DEFAULT_MODEL))


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_pair(ours: Callable[[], object], baseline: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of each, measured alternately (ABAB...) so drift hits both alike."""
    ours()
    baseline()
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((ours, a), (baseline, b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def result(name: str, ours: float, baseline: float, unit: str = "") -> None:
    """One line per measurement; values are 'higher is better' so ratio > 1 means we win."""
    print(f"RESULT {name} ours={ours:.4g} baseline={baseline:.4g} ratio={ours / baseline:.3f}{unit}", flush=True)


def peak_matmul_flops(dtype: torch.dtype, n: int = 2048) -> float:
    """This machine's matmul FLOP/s in ``dtype``, measured now (best of a few)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = min(timed(lambda: a @ b, repeats=1, warmup=1) for _ in range(3))
    return 2 * n**3 / seconds
