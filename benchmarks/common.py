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


def timed_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, measured in turn (ABCABC...) after one untimed call
    of each, so drift in the machine's speed hits all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def timed_pair(ours: Callable[[], object], baseline: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of each, measured alternately (ABAB...) so drift hits both alike."""
    medians = timed_interleaved({"ours": ours, "baseline": baseline}, repeats)
    return medians["ours"], medians["baseline"]


def result(name: str, ours: float, baseline: float, unit: str = "") -> None:
    """One line per measurement; values are 'higher is better' so ratio > 1 means we win."""
    print(f"RESULT {name} ours={ours:.4g} baseline={baseline:.4g} ratio={ours / baseline:.3f}{unit}", flush=True)


def model_matmuls(model: torch.nn.Module, rows: int, dtype: torch.dtype) -> tuple[Callable[[], object], float]:
    """(a function doing every linear layer's matmul of ``model`` once on ``rows`` rows, its
    FLOPs): the peak a training step of that many tokens could reach on this machine, with
    the model's own shapes, measured as a step is (interleaved with it)."""
    shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k, _ in shapes}
    weights = {shape: torch.randn(shape, dtype=dtype) for shape in set(shapes)}

    def run() -> None:
        for k, n in shapes:
            inputs[k] @ weights[(k, n)]

    return run, float(sum(2 * rows * k * n for k, n in shapes))
