"""Where a host computes (``auto | cpu | cuda | cuda:N``) and in which dtype.

A host lives on one device: base weights, LoRA A/B, AdamW moments, KV cache and every
index tensor. What leaves the host (results, checkpoints) is device-free, so a run
saved on a GPU resumes on a CPU and vice versa.

Precedence for both choices: the explicit argument, then ``$TRIO_DEVICE`` /
``$TRIO_DTYPE``, then the default (``auto``: CUDA when present, else the CPU; dtype:
bfloat16 on CUDA, float32 on the CPU).

An adapter's long-lived tensors (its LoRA weights, each AdamW moment) are views of one
buffer each (``packed``), not hundreds of small allocations. On the CPU the base weights
are copied into one buffer of huge pages (``gather_on_huge_pages``), and the C allocator
keeps freed memory for the next step (``keep_freed_memory``).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import mmap
import os
import re
import sys
import threading
from collections.abc import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_CUDA = re.compile(r"cuda(?::(\d+))?")


def resolve_device(spec: str | torch.device | None = None) -> torch.device:
    """The torch device a spec names.

    Args:
        spec: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (or a torch.device);
            None reads ``$TRIO_DEVICE``, then defaults to ``"auto"``.

    Returns:
        ``auto`` -> ``cuda:<current>`` when CUDA is available, else ``cpu``. ``cuda``
        gets its index filled in, so it compares equal to its tensors' ``.device``.

    Raises:
        ValueError: an unknown spec, CUDA requested where there is none, or an index
            beyond the visible GPUs; the message names the value.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    where = "device"
    if spec is None:
        spec = os.environ.get("TRIO_DEVICE") or "auto"
        where = "device ($TRIO_DEVICE)" if os.environ.get("TRIO_DEVICE") else where
    text = str(spec).strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return torch.device("cpu")
    match = _CUDA.fullmatch(text)
    if match is None:
        raise ValueError(f"{where}: unknown device {spec!r}; expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{where}: {spec!r} requested but CUDA is not available on this machine "
            f"(torch {torch.__version__}); use 'cpu' or 'auto'"
        )
    index = int(match.group(1)) if match.group(1) is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"{where}: {spec!r} requested but only {torch.cuda.device_count()} CUDA device(s) "
            "are visible"
        )
    return torch.device("cuda", index)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """The base weights' compute dtype: ``dtype``, else ``$TRIO_DTYPE``, else the device's default.

    The default is float32 on the CPU (exact numerics: sampler and trainer agree) and bfloat16 on CUDA
    (float32 on a GPU without native bf16, where it would be emulated).

    Raises:
        ValueError: a dtype name outside ``DTYPES``.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    where = "dtype"
    if not dtype:
        dtype = os.environ.get("TRIO_DTYPE") or None
        where = "dtype ($TRIO_DTYPE)"
    if dtype is None:
        return default_dtype(device)
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"{where}: unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}") from None


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype a device computes in when nothing asks otherwise."""
    if device.type == "cuda":  # native bf16 from compute capability 8.0, asked of this device, not the current one
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float32
    return torch.float32


def fetched(tensors: dict[str, torch.Tensor], copy_cpu: bool = False) -> dict[str, torch.Tensor]:
    """CPU tensors equal to ``tensors``: those on another device copied one storage at a
    time, so an adapter's weights or one of its moments (``packed``: one storage) cross in
    one transfer instead of one per layer (hundreds, each a sync, on a GPU host). CPU
    tensors are returned as they are unless ``copy_cpu`` (then copied the same way). The
    results of one storage are views of one CPU buffer: clone them to own them apart."""
    buffers: dict[tuple[torch.device, int], torch.Tensor] = {}
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        if tensor.device.type == "cpu" and not copy_cpu:
            out[name] = tensor
            continue
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key not in buffers:
            whole = torch.tensor([], dtype=torch.uint8, device=tensor.device).set_(storage)
            buffers[key] = whole.to("cpu", copy=True)
        out[name] = buffers[key].view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    return out


def packed(shapes: Sequence[torch.Size], device: torch.device | str,
           dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Zeroed tensors of ``shapes``, as views of one new buffer on ``device``.

    One allocation per adapter and per moment instead of one per layer: a buffer this size
    is mapped straight from the OS and given back whole, while hundreds of small ones land
    among the activations' and fragment the heap (benchmarks/memory.py: 145 MB per extra
    rank-32 SmolLM2 adapter for 130 MB of weights and moments, before packing).
    """
    if not shapes:
        return []
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]


HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line


def gather_on_huge_pages(params: Sequence[torch.nn.Parameter]) -> None:
    """Move CPU parameters into one anonymous buffer that the kernel backs with transparent
    huge pages, each parameter a view of it (tied parameters stay one; matrices side by
    side in model order, then the rest).

    transformers leaves safetensors weights mapped from the file (the page cache), and
    reading them from there is slower: the bundled model sampled 8 x 64 tokens at 112
    tokens/s from the file's pages, 134-136 from anonymous memory, and one sequence at 25.1
    vs 26.7-28.6 (three hosts in one process, interleaved, quiet). A decode step reads
    every weight once, so this is the sampler's speed; huge pages on top were worth 0-5%.
    Costs the weights' size in private memory (the file's pages become reclaimable cache).
    Where the kernel offers no huge pages the buffer has ordinary ones.
    """
    unique = list({id(p): p for p in params}.values())
    # matrices first, in model order, so that a module's projections lie side by side (a
    # bias between them would stop ``lora.fuse`` from stacking them in place)
    unique.sort(key=lambda p: p.dim() < 2)
    if not unique:
        return
    sizes = [p.numel() * p.element_size() for p in unique]
    starts = [0, *itertools.accumulate(-(-size // _ALIGN) * _ALIGN for size in sizes)]
    buffer = _huge_page_buffer(starts[-1])
    with torch.no_grad():
        for p, start, size in zip(unique, starts[:-1], sizes, strict=True):  # starts[-1]: the end
            view = buffer[start:start + size].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view


def _huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh anonymous memory from a 2 MiB boundary, advised for huge pages
    before the first touch (uint8; keeps its mapping alive)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere ordinary pages
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
KEEP_FREED_BYTES = (1 << 31) - 1  # the largest mallopt takes (an int)
KEEP_FREED_ENV = "TRIO_KEEP_FREED_MEMORY"
# How often a bounded host looks at what it holds. A look over the bound gives back every
# free page (``trim_freed_memory``), and an 8 x 128 fp32 step of the bundled model frees
# ~3 GB: looking every second, each step over HTTP faulted ~800,000 pages in again (4.0-4.2
# against 3.4-3.6 s a step keeping all). Every 30 s, one step in several pays it.
TRIM_CHECK_SECONDS = 30.0
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG])(?:i?B)?", re.IGNORECASE)
_trimmer: FreedMemoryTrimmer | None = None


def keep_freed_memory() -> bool:
    """Have the C allocator keep freed memory for reuse instead of returning it to the
    kernel (glibc: no mmap for large blocks, trim only beyond ``KEEP_FREED_BYTES``); True
    when applied. Process-wide, set by ``$TRIO_KEEP_FREED_MEMORY`` (``kept_freed_bytes``):
    ``1`` (the default) keeps it all, ``0`` none, a size such as ``2G`` up to that much.

    A CPU training step allocates and frees the same large activations every time. glibc
    hands blocks over 32 MiB (and, as its heap shrinks, smaller ones) back to the kernel on
    free, so the next step takes a page fault per 4 KiB to get them again: 220,000 faults
    (880 MB) per step of 8 x 128 tokens of the bundled model, fp32; with this, none, and the
    step was 15% faster (one process, interleaved). The cost: the process keeps its peak,
    and a long-running server's heap fragments, so what it holds creeps up; with a bound a
    thread (``FreedMemoryTrimmer``) gives the free pages back when, at one of its looks
    (every ``TRIM_CHECK_SECONDS``), they exceed it.
    PyTorch's CPU guides suggest preloading jemalloc or tcmalloc for the same reason; this
    needs nothing preloaded. A no-op off glibc.
    """
    bound = kept_freed_bytes(os.environ.get(KEEP_FREED_ENV))
    if bound == 0 or not sys.platform.startswith("linux"):
        return False
    if bound is not None and malloc_info() is None:  # glibc < 2.33: a bound it cannot watch
        return False  # would keep it all: keep none instead
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES))
    if applied and bound is not None:
        _start_trimmer(bound)
    return applied


def kept_freed_bytes(setting: str | None) -> int | None:
    """How much freed memory a host keeps, from ``$TRIO_KEEP_FREED_MEMORY``'s value:
    None for all (unset or ``1``), else bytes (``0``: none; a size with its unit:
    ``512M``, ``2G``, ``1.5GiB``, ``64 KB``). Anything else is a ValueError naming the
    variable and the value."""
    if setting is None or setting.strip() == "1":
        return None
    if setting.strip() == "0":
        return 0
    match = _SIZE.fullmatch(setting.strip())
    if match is None:
        raise ValueError(f"{KEEP_FREED_ENV}: expected 1 (keep all), 0 (none) or a size such as 512M or 2G, "
                         f"got {setting!r}")
    number, unit = match.groups()
    return int(float(number) * 1024 ** " KMG".index(unit.upper()))


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_info() -> _MallInfo2 | None:
    """glibc's allocation figures for the whole process (all arenas); None without
    ``mallinfo2`` (not glibc, or glibc < 2.33). ``fordblks``: bytes freed and held."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2()


def trim_freed_memory(bound: int) -> int:
    """Give the free pages back to the kernel if more than ``bound`` bytes are freed and
    held; the bytes held before (0: nothing done). ``malloc_trim`` returns every whole
    free page, in the middle of the heap too, not just the excess: the allocator cannot
    choose which to keep, and a host over its bound is not in a steady state anyway."""
    info = malloc_info()
    if info is None or info.fordblks <= bound:
        return 0
    ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    return info.fordblks


class FreedMemoryTrimmer(threading.Thread):
    """Every ``every`` seconds, ``trim_freed_memory(bound)``: the process keeps freed
    memory for its next step up to ``bound`` bytes. A thread, not a call after each
    operation, so it works the same wherever the engine runs (a worker, a Ray actor)."""

    def __init__(self, bound: int, every: float = TRIM_CHECK_SECONDS):
        super().__init__(name="trio-trim-freed-memory", daemon=True)
        self.bound, self.every = bound, every
        self.trims = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            self.check()

    def check(self) -> int:
        """One look: the bytes held when it trimmed, else 0."""
        held = trim_freed_memory(self.bound)
        self.trims += bool(held)
        return held


def _start_trimmer(bound: int) -> None:
    """One trimmer per process, with the latest bound asked for."""
    global _trimmer
    if _trimmer is not None and _trimmer.is_alive():
        _trimmer.bound = bound
        return
    _trimmer = FreedMemoryTrimmer(bound)
    _trimmer.start()
