"""Run snapshots: one adapter's complete training state in one file, replaced atomically.

A snapshot holds the LoRA weights, the AdamW moments and step, optionally the pending
gradients, and the LoRA config, as one safetensors file (tensors on the CPU, metadata
as JSON strings in its header). One file per run means one ``os.replace`` makes a new
snapshot visible: a reader sees the previous complete state or the new one, never half
of each, whenever the writer is killed.

``capture`` copies the state under the host's lock (milliseconds; a consistent cut
between two engine calls) straight into the file's bytes, laid out in one page-aligned
buffer; ``write`` does the slow disk work outside it, from that buffer to the disk
(``O_DIRECT``) where the file system allows: no second copy into the page cache, whose
writing and flushing cost a core for longer than the write itself. A snapshot of the
bundled model at rank 32 (136 MB): 168-200 ms to capture and write against 228-262 ms
through ``safetensors.save_file`` and the page cache (``benchmarks/snapshot.py``'s
``write_ms``, four runs and five), and the written state does not push other files' pages
(a model's weights, say) out of the cache. A file system that takes no direct I/O
(tmpfs) gets the same bytes through the page cache.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .checkpoint import fsync_path
from .device import fetched
from .lora import LoraConfig
from .optim import AdamState

FORMAT = "trio-snapshot/1"
SECTIONS = ("adapter", "exp_avg", "exp_avg_sq", "grad")
# Direct I/O wants the buffer's address, the file offsets and the lengths in whole device
# blocks; 4 KiB is a multiple of the usual 512-byte and 4 KiB ones.
DIRECT_IO_BLOCK = 4096
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@dataclass(frozen=True)
class FileImage:
    """A snapshot file's bytes in memory: ``buffer`` starts on a page and is a whole number
    of ``DIRECT_IO_BLOCK``s long; the file is its first ``size`` bytes."""

    buffer: torch.Tensor  # uint8
    size: int


@dataclass
class Snapshot:
    config: LoraConfig
    step: int
    base_model: str
    tensors: dict[str, torch.Tensor]  # "<section>.<param name>" -> CPU tensor
    image: FileImage | None = field(default=None, repr=False)  # ``tensors`` are views of it (``capture``)
    step_metrics: dict[str, float] = field(default_factory=dict)  # ``AdamState.step_metrics``


def capture(host: Any, adapter_id: str, with_grads: bool = False) -> Snapshot:
    """A CPU copy of an adapter's state, taken under the host's lock, laid out as its file.
    On a GPU host the lock is held for the transfer (one per packed storage) alone; the
    copy into the file's layout is made after it."""
    with host.lock:
        adapter = host.adapters[adapter_id]
        params = host.adapter_params(adapter_id)
        parts: dict[str, dict[str, torch.Tensor]] = {
            "adapter": params, "exp_avg": adapter.optim.exp_avg, "exp_avg_sq": adapter.optim.exp_avg_sq,
        }
        if with_grads:
            parts["grad"] = {k: p.grad for k, p in params.items() if p.grad is not None}
        state = fetched({f"{section}.{k}": v for section, values in parts.items() for k, v in values.items()})
        snap = Snapshot(adapter.config, adapter.optim.step, host.model_name, state,
                        step_metrics=dict(adapter.optim.step_metrics))
        if host.device.type == "cpu":  # ``state`` is the live tensors: copied before the lock goes
            return laid_out(snap)
    return laid_out(snap)


def laid_out(snap: Snapshot) -> Snapshot:
    """A copy of ``snap`` whose tensors are views of its file's bytes (``Snapshot.image``),
    in safetensors' format: an 8-byte header length, the JSON header (tensors' dtypes,
    shapes and offsets, and the metadata), then the tensors' data, wider dtypes first so
    each tensor starts at a multiple of its element size (as safetensors orders them)."""
    names = sorted(snap.tensors, key=lambda k: -snap.tensors[k].element_size())
    header: dict[str, Any] = {}
    end = 0
    for name in names:
        tensor = snap.tensors[name]
        start, end = end, end + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [start, end]}
    header["__metadata__"] = {"format": FORMAT, "base_model": snap.base_model, "step": str(snap.step),
                              "lora_config": json.dumps(asdict(snap.config)), "step_metrics": json.dumps(snap.step_metrics)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    prefix = struct.pack("<Q", len(text)) + text
    image = _page_aligned(len(prefix) + end)
    data = image.buffer[len(prefix) : image.size]
    image.buffer[: len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
    tensors = {}
    for name in names:
        tensor = snap.tensors[name]
        start, stop = header[name]["data_offsets"]
        view = data[start:stop].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        tensors[name] = view
    return Snapshot(snap.config, snap.step, snap.base_model, tensors, image, snap.step_metrics)


def _page_aligned(size: int) -> FileImage:
    blocks = -(-size // DIRECT_IO_BLOCK) * DIRECT_IO_BLOCK
    whole = torch.empty(blocks + DIRECT_IO_BLOCK, dtype=torch.uint8)
    skip = -whole.data_ptr() % DIRECT_IO_BLOCK
    buffer = whole[skip : skip + blocks]
    buffer[size:].zero_()  # the last block's padding reaches the disk until trimmed: no stale heap bytes in it
    return FileImage(buffer, size)


def write(path: str | Path, snap: Snapshot) -> None:
    """Write atomically: a temporary file in the same folder, flushed, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    image = snap.image if snap.image is not None else laid_out(snap).image
    assert image is not None
    try:
        write_file(tmp, image)
        os.replace(tmp, path)
        fsync_path(path.parent)  # the rename too is on the disk before the step is answered
    finally:
        tmp.unlink(missing_ok=True)


def write_file(path: Path, image: FileImage) -> None:
    """``image`` as a new file at ``path``, flushed to the disk: by direct I/O where the
    file system takes it, else (``EINVAL``: tmpfs, or a block size over ours) through the
    page cache."""
    direct = getattr(os, "O_DIRECT", 0)  # Linux; macOS and Windows have none
    if direct:
        try:
            return _written(path, image, direct)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    _written(path, image, 0)


def _written(path: Path, image: FileImage, direct: int) -> None:
    length = image.buffer.numel() if direct else image.size  # direct I/O writes whole blocks
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
    try:
        write_all(fd, image.buffer.numpy().data[:length])
        if direct:
            os.ftruncate(fd, image.size)  # the padding of the last block goes
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):  # a write may take less than asked (2 GiB at most on Linux)
        done += os.write(fd, data[done:])


def remove_partial_writes(folder: str | Path) -> int:
    """Remove what writes a crash interrupted left in a snapshot folder: the hidden
    temporary files (``write``'s, and those ``safetensors.save_file`` made beside them
    when it wrote snapshots), each as large as a snapshot. Only while no write can be
    under way (at start-up). Returns how many."""
    partial = [p for p in Path(folder).glob(".*") if p.is_file()] if Path(folder).is_dir() else []
    for path in partial:
        path.unlink(missing_ok=True)
    return len(partial)


def read(path: str | Path) -> Snapshot:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a TRIO snapshot (format {meta.get('format')!r})")
    config = LoraConfig(**json.loads(meta["lora_config"]))
    return Snapshot(config, int(meta["step"]), meta["base_model"], load_file(str(path)),
                    step_metrics=_step_metrics(meta))


def _step_metrics(meta: dict[str, str]) -> dict[str, float]:
    return json.loads(meta.get("step_metrics", "{}"))  # absent from snapshots written before it was kept


def step_of(path: str | Path) -> int | None:
    """The step a snapshot holds, from its header alone; None if there is none or it
    cannot be read (a damaged file fails its run when restored, not whoever asks here)."""
    landed = last_step(path)
    return None if landed is None else landed[0]


def last_step(path: str | Path) -> tuple[int, dict[str, float]] | None:
    """The step a snapshot holds and what the step that made it answered (``{}`` if not
    kept), from its header alone; None as for ``step_of``."""
    header = _header(path)
    try:
        return None if header is None else (int(header[0]["step"]), _step_metrics(header[0]))
    except (KeyError, ValueError):
        return None


def holds_grads(path: str | Path) -> bool:
    """Whether a snapshot holds pending gradients, from its header alone (False if there is
    none or it cannot be read)."""
    header = _header(path)
    return header is not None and any(name.startswith("grad.") for name in header[1])


def _header(path: str | Path) -> tuple[dict[str, str], list[str]] | None:
    """A snapshot's metadata and tensor names, read from its header; None if there is no
    file or it cannot be read (a damaged file fails its run when restored, not whoever
    asks here)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, list(f.keys())
    except Exception:
        return None


def restore(host: Any, adapter_id: str, snap: Snapshot) -> None:
    """Create (or replace) ``adapter_id`` on the host exactly as captured."""
    if snap.base_model != host.model_name:
        raise ValueError(f"snapshot is for base model {snap.base_model!r}, this host serves {host.model_name!r}")
    sections: dict[str, dict[str, torch.Tensor]] = {s: {} for s in SECTIONS}
    for key, tensor in snap.tensors.items():
        section, name = key.split(".", 1)
        sections[section][name] = tensor
    with host.lock:
        host.delete_adapter(adapter_id)
        host.create_adapter(adapter_id, snap.config)
        params = host.adapter_params(adapter_id)
        with torch.no_grad():
            for name, tensor in sections["adapter"].items():
                params[name].copy_(tensor)
        for name, grad in sections["grad"].items():
            params[name].grad = grad.to(params[name].device, params[name].dtype)
        host.adapters[adapter_id].optim = AdamState(snap.step, sections["exp_avg"], sections["exp_avg_sq"],
                                                    snap.step_metrics).to(host.device)
