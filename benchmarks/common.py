"""Shared helpers for the benchmark scripts (not part of the product)."""

from __future__ import annotations

import contextlib
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


class Timings(dict[str, float]):
    """Median seconds of each measured function, by name, with every round's seconds kept
    (``rounds``) so a result can say how much its ratio moved from one round to the next."""

    def __init__(self, rounds: dict[str, list[float]]):
        super().__init__({name: statistics.median(t) for name, t in rounds.items()})
        self.rounds = rounds

    def spread(self, ours: str = "ours", baseline: str = "baseline") -> tuple[float, float]:
        """The lowest and highest of the rounds' ratios (baseline seconds / ours seconds:
        higher is better, as ``result`` prints them)."""
        ratios = [b / o for o, b in zip(self.rounds[ours], self.rounds[baseline], strict=True)]
        return min(ratios), max(ratios)


def timed_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> Timings:
    """Each function measured in turn after one untimed call of each, the order reversed
    every other round (ABC CBA ABC ...): drift in the machine's speed hits all of them
    alike, and none always runs right after the same neighbour (whose freed memory and
    evicted caches it would inherit)."""
    for fn in fns.values():
        fn()
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for k in range(repeats):
        for name, fn in order if k % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            rounds[name].append(time.perf_counter() - start)
    return Timings(rounds)


def timed_pair(ours: Callable[[], object], baseline: Callable[[], object], repeats: int) -> Timings:
    """``timed_interleaved`` of the two, named "ours" and "baseline"."""
    return timed_interleaved({"ours": ours, "baseline": baseline}, repeats)


def machine() -> str:
    """The CPU and what decides its matmul speed, so that figures from different days can be
    told apart: this project's machine has changed under it (bf16 peaks 5x apart)."""
    model, flags = "unknown CPU", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags] or ["no AVX2"]
    return f"{model} ({', '.join(features)}), torch {torch.__version__}, {torch.get_num_threads()} threads"


_machine_told = False


def result(name: str, ours: float, baseline: float, unit: str = "",
           spread: tuple[float, float] | None = None) -> None:
    """One line per measurement; values are 'higher is better' so ratio > 1 means we win.
    ``spread``: the lowest and highest ratio of the rounds behind the medians. The first
    line of a script is preceded by one naming the machine."""
    global _machine_told
    if not _machine_told:
        print(f"MACHINE {machine()}", flush=True)
        _machine_told = True
    rounds = f" spread={spread[0]:.3f}-{spread[1]:.3f}" if spread else ""
    print(f"RESULT {name} ours={ours:.4g} baseline={baseline:.4g} ratio={ours / baseline:.3f}{rounds}{unit}",
          flush=True)


def model_matmuls(model: torch.nn.Module, rows: int, dtype: torch.dtype) -> tuple[Callable[[], object], float]:
    """(a function doing every linear layer's matmul of ``model`` once on ``rows`` rows, its
    FLOPs): the peak a training step of that many tokens could reach on this machine, with
    the model's own weights (their shapes, layout and memory: one weight per shape reused
    by every layer would run from the cache), measured as a step is (interleaved with it)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}

    def run() -> None:
        with torch.no_grad():
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)

    return run, float(sum(2 * rows * w.numel() for w in weights))
