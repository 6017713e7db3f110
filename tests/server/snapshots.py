"""A run's snapshot on disk: its step."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from trio_server.engine import snapshot_path


def snapshot_step(data_dir: Path, run_id: str) -> int | None:
    path = snapshot_path(Path(data_dir) / "snapshots", run_id)
    try:
        with safe_open(str(path), framework="pt") as f:
            return int((f.metadata() or {})["step"])
    except (FileNotFoundError, KeyError):
        return None

