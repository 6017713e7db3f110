"""Waiting for a run's snapshot on disk: the condition itself, not a sleep."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from trio_server.engine import snapshot_path

from ..polling import wait_until


def snapshot_step(data_dir: Path, run_id: str) -> int | None:
    path = snapshot_path(Path(data_dir) / "snapshots", run_id)
    try:
        with safe_open(str(path), framework="pt") as f:
            return int((f.metadata() or {})["step"])
    except (FileNotFoundError, KeyError):
        return None


def wait_for_snapshot(data_dir: Path, run_id: str, step: int, timeout: float = 120) -> None:
    wait_until(lambda: snapshot_step(data_dir, run_id) == step, f"the snapshot of {run_id} at step {step}", timeout)
