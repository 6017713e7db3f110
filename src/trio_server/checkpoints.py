"""Checkpoint paths and archives.

A checkpoint is named by ``trio://<run-id>/weights/<name>`` (training state: adapter +
optimizer) or ``trio://<run-id>/sampler_weights/<name>`` (a PEFT adapter folder); on
disk it lives at ``<data-dir>/checkpoints/<run-id>/<kind>/<name>/``.

``trio://<run-id>/ephemeral/<n>`` are sampler weights saved without a name: the
service names them (``n`` orders them), never lists them, and removes them at start-up
and when their run has more than ``Limits.ephemeral_samplers_per_run``.

Every part that becomes a file name (run id, kind, name) passes ``check_part`` first, and
``folder`` checks that the result stays under ``<data-dir>/checkpoints``: a path from a
client never reaches outside the data dir, however it is spelled (``..``, ``/``, ``\\``,
NUL, absolute, empty, too long). Refusals are 400s naming the field and the value.
"""

from __future__ import annotations

import os
import re
import tarfile
import threading
import uuid
from pathlib import Path

from .errors import ServiceError

SCHEME = "trio://"
KINDS = ("weights", "sampler_weights", "ephemeral")
RUN_ID = re.compile(r"run-[0-9a-f]{1,32}")
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # with check_part's '..' rule: pytrio.types.CHECKPOINT_NAME
MAX_PART = 128
MAX_PATH = 512  # the checkpoints table's key


def check_part(field: str, value: str, max_len: int = MAX_PART) -> str:
    """``value`` if it is safe as one file name; else a 400 naming ``field`` and ``value``."""
    problem = unsafe_reason(value, max_len)
    if problem:
        raise ServiceError("validation", f"{field}: {value[:200]!r} {problem}", 400)
    return value


def unsafe_reason(value: str, max_len: int = MAX_PART) -> str | None:
    """Why ``value`` is not safe as one file name (e.g. "contains '..'"), or None."""
    if not isinstance(value, str) or not value:
        return "is empty"
    if len(value) > max_len:
        return f"is {len(value)} characters long, more than {max_len}"
    for bad, what in (("\0", "a NUL byte"), ("/", "'/'"), ("\\", "'\\'"), ("..", "'..'")):
        if bad in value:
            return f"contains {what}"
    if value == "." or any(ord(ch) < 32 for ch in value):
        return "is not a file name"
    return None


def make_path(run_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{run_id}/{kind}/{name}"


def folder(data_dir: Path, run_id: str, kind: str, name: str) -> Path:
    """Where a checkpoint lives on disk; never outside ``<data_dir>/checkpoints``."""
    root = data_dir / "checkpoints"
    target = root / check_part("run_id", run_id) / check_part("kind", kind) / check_part("name", name)
    if not target.resolve().is_relative_to(root.resolve()):  # e.g. a symlink planted in the data dir
        raise ServiceError("validation", f"path: {make_path(run_id, kind, name)!r} is outside the data dir", 400)
    return target


def parse_path(path: str) -> tuple[str, str, str]:
    """``trio://<run-id>/<kind>/<name>`` -> (run id, kind, name), each part checked."""
    if isinstance(path, str) and len(path) > MAX_PATH:
        raise ServiceError("validation", f"path: {path[:200]!r}... is {len(path)} characters long, "
                           f"more than {MAX_PATH}", 400)
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise ServiceError("validation", f"path: {str(path)[:200]!r} is not a checkpoint path; expected "
                           f"trio://<run-id>/weights/<name> or trio://<run-id>/sampler_weights/<name>", 400)
    parts = path[len(SCHEME):].split("/")
    if len(parts) != 3:
        raise ServiceError("validation", f"path: {path[:200]!r} has {len(parts)} parts after trio://, "
                           "expected 3: <run-id>/<kind>/<name>", 400)
    run, kind, name = (check_part(f"path {field}", part) for field, part in zip(("run id", "kind", "name"), parts))
    for field, value, ok in (("run id", run, RUN_ID.fullmatch(run)), ("kind", kind, kind in KINDS),
                             ("name", name, NAME.fullmatch(name))):
        if not ok:
            raise ServiceError("validation", f"path {field}: {value!r} in {path!r} is not valid", 400)
    return run, kind, name


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def archive_file(out_dir: Path, run_id: str, kind: str, name: str) -> Path:
    """Where ``archive`` keeps a checkpoint's archive."""
    return out_dir / f"{run_id}-{kind}-{name}.tar"


SERVED_PREFIX = ".serving-"  # a download's own link to an archive (``served_link``)


def served_link(archive: Path) -> Path:
    """A link of the download's own to ``archive`` (the same file, no copy), which the
    caller unlinks once it has sent it. A delete or TTL sweep of the checkpoint unlinks
    the archive's name while downloads of it may be under way; the file lives on for as
    long as a link to it does, so they still send it whole. Without it a sweep between a
    response's stat and its open sent a Content-Length and then no bytes. Links left by a
    crash go at the next start (``remove_served_links``)."""
    link = archive.with_name(f"{SERVED_PREFIX}{uuid.uuid4().hex}-{archive.name}")
    os.link(archive, link)
    return link


def remove_served_links(out_dir: Path) -> None:
    for link in out_dir.glob(f"{SERVED_PREFIX}*"):
        link.unlink(missing_ok=True)


_BUILDERS = [threading.Lock() for _ in range(64)]  # an archive's builder holds its path's (striped: bounded)


def archive(folder: Path, out_dir: Path) -> Path:
    """``<run>-<kind>-<name>.tar`` of the folder, rebuilt only when the folder changed.

    Downloads of one checkpoint at once (routes run in a thread pool) build it once: the
    others wait for that build. Each build writes its own temporary file (named by its
    process: embedded services share a data dir) and renames it into place, so a reader
    never sees a half-written archive (a shared temporary name let concurrent builds
    truncate and rename each other's: 500s, and a 200 with an empty body)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = archive_file(out_dir, folder.parent.parent.name, folder.parent.name, folder.name)
    with _BUILDERS[hash(target) % len(_BUILDERS)]:
        newest = max((p.stat().st_mtime for p in folder.rglob("*")), default=0)
        if not target.exists() or target.stat().st_mtime < newest:
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                with tarfile.open(tmp, "w") as tar:
                    tar.add(folder, arcname=folder.name)
                tmp.replace(target)
            finally:
                tmp.unlink(missing_ok=True)
    return target
