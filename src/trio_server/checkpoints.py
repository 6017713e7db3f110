"""Checkpoint paths and archives.

A checkpoint is named by ``trio://<run-id>/weights/<name>`` (training state: adapter +
optimizer) or ``trio://<run-id>/sampler_weights/<name>`` (a PEFT adapter folder); on
disk it lives at ``<data-dir>/checkpoints/<run-id>/<kind>/<name>/``.

``trio://<run-id>/ephemeral/<n>`` are sampler weights saved without a name: the
service names them (``n`` orders them), never lists them, and removes them at start-up
and when their run has more than ``Limits.ephemeral_samplers_per_run``.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

from .errors import ServiceError

PATH = re.compile(r"^trio://(?P<run>run-[0-9a-f]+)/(?P<kind>weights|sampler_weights|ephemeral)/(?P<name>[A-Za-z0-9._-]{1,128})$")


def make_path(run_id: str, kind: str, name: str) -> str:
    return f"trio://{run_id}/{kind}/{name}"


def folder(data_dir: Path, run_id: str, kind: str, name: str) -> Path:
    """Where a checkpoint lives on disk."""
    return data_dir / "checkpoints" / run_id / kind / name


def parse_path(path: str) -> tuple[str, str, str]:
    match = PATH.match(path or "")
    if not match:
        raise ServiceError(
            "validation",
            f"path: {path!r} is not a checkpoint path; expected trio://<run-id>/weights/<name> "
            "or trio://<run-id>/sampler_weights/<name>",
        )
    return match["run"], match["kind"], match["name"]


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def archive(folder: Path, out_dir: Path) -> Path:
    """``<run>-<kind>-<name>.tar`` of the folder, rebuilt only when the folder changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    kind, run = folder.parent.name, folder.parent.parent.name
    target = out_dir / f"{run}-{kind}-{folder.name}.tar"
    newest = max((p.stat().st_mtime for p in folder.rglob("*")), default=0)
    if not target.exists() or target.stat().st_mtime < newest:
        tmp = target.with_suffix(".tmp")
        with tarfile.open(tmp, "w") as tar:
            tar.add(folder, arcname=folder.name)
        tmp.replace(target)
    return target
