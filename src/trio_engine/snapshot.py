"""Run snapshots: one adapter's complete training state in one file, replaced atomically.

A snapshot holds the LoRA weights, the AdamW moments and step, optionally the pending
gradients, and the LoRA config, as one safetensors file (tensors on the CPU, metadata
as JSON strings in its header). One file per run means one ``os.replace`` makes a new
snapshot visible: a reader sees the previous complete state or the new one, never half
of each, whenever the writer is killed.

``capture`` copies the state under the host's lock (milliseconds; a consistent cut
between two engine calls); ``write`` does the slow disk work outside it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .lora import LoraConfig
from .optim import AdamState

FORMAT = "trio-snapshot/1"
SECTIONS = ("adapter", "exp_avg", "exp_avg_sq", "grad")


@dataclass
class Snapshot:
    config: LoraConfig
    step: int
    base_model: str
    tensors: dict[str, torch.Tensor]  # "<section>.<param name>" -> CPU tensor


def capture(host: Any, adapter_id: str, with_grads: bool = False) -> Snapshot:
    """A CPU copy of an adapter's state, taken under the host's lock."""
    with host.lock:
        adapter = host.adapters[adapter_id]
        params = host.adapter_params(adapter_id)
        parts: dict[str, dict[str, torch.Tensor]] = {
            "adapter": params, "exp_avg": adapter.optim.exp_avg, "exp_avg_sq": adapter.optim.exp_avg_sq,
        }
        if with_grads:
            parts["grad"] = {k: p.grad for k, p in params.items() if p.grad is not None}
        tensors = {f"{section}.{k}": v.detach().to("cpu", copy=True).contiguous()
                   for section, values in parts.items() for k, v in values.items()}
        return Snapshot(adapter.config, adapter.optim.step, host.model_name, tensors)


def write(path: str | Path, snap: Snapshot) -> None:
    """Write atomically: a temporary file in the same folder, flushed, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    meta = {"format": FORMAT, "base_model": snap.base_model, "step": str(snap.step),
            "lora_config": json.dumps(asdict(snap.config))}
    try:
        save_file(snap.tensors, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_partial_writes(folder: str | Path) -> int:
    """Remove what writes a crash interrupted left in a snapshot folder: the hidden
    temporary files (``write``'s, and those safetensors makes beside them), each as large
    as a snapshot. Only while no write can be under way (at start-up). Returns how many."""
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
    return Snapshot(config, int(meta["step"]), meta["base_model"], load_file(str(path)))


def step_of(path: str | Path) -> int | None:
    """The step a snapshot holds, from its header alone; None if there is none or it
    cannot be read (a damaged file fails its run when restored, not whoever asks here)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return int((f.metadata() or {})["step"])
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
        host.adapters[adapter_id].optim = AdamState(snap.step, sections["exp_avg"], sections["exp_avg_sq"]).to(host.device)
