"""A run's snapshot on disk: its step."""

from __future__ import annotations

from pathlib import Path

from trio_engine import snapshot
from trio_server.engine import snapshot_path


def snapshot_step(data_dir: Path, run_id: str) -> int | None:
    return snapshot.step_of(snapshot_path(Path(data_dir) / "snapshots", run_id))
