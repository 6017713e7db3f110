"""The embedded default: the service core in this process, reached without a network.

Requests still go through their JSON form and the core's validation, so behaviour and
errors match ``trio serve`` exactly. One core per data dir per process, created on
first use (this is where torch and the engine get imported).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import error_from_category
from ..types import (
    Checkpoint,
    FutureResponse,
    LogMetricsRequest,
    LogMetricsResponse,
    RunUsage,
    ServerCapabilities,
    StepMetrics,
    TokenizerFiles,
    TrainingRun,
    Usage,
)

LOCAL_USER = "local"
_cores: dict[str, Any] = {}
_cores_lock = threading.Lock()


def _forget_cores_after_fork() -> None:
    """A forked child has none of the parent's core's threads (its workers): its clients
    get a core of their own on the same data dir, shared as with any other process. The
    parent's cores are not closed at the child's exit: that wrote their snapshots from the
    child's stale copy and waited for a writer thread that is not there."""
    global _cores, _cores_lock
    for core in _cores.values():
        atexit.unregister(core.close)
    _cores, _cores_lock = {}, threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_cores_after_fork)


def default_data_dir() -> Path:
    home = os.environ.get("TRIO_HOME") or Path.home() / ".cache" / "trio"
    return Path(home) / "embedded"


def embedded_core(data_dir: Path | None = None) -> Any:
    from trio_server.core import ServiceCore

    folder = str(data_dir or default_data_dir())
    with _cores_lock:
        if folder not in _cores:
            # shared: a CLI command beside a training script reads the same data dir
            _cores[folder] = ServiceCore(folder, dtype=os.environ.get("TRIO_DTYPE"), share_data_dir=True)
        return _cores[folder]


class LocalTransport:
    def __init__(self, core: Any = None, user_id: str = LOCAL_USER):
        self.core = core or embedded_core()
        self.user_id = user_id

    async def submit(self, op: str, body: dict[str, Any], idempotency_key: str) -> str:
        return self._call(self.core.submit, self.user_id, op, body, idempotency_key)

    async def retrieve(self, request_id: str, timeout: float) -> FutureResponse:
        with _mapped_errors():
            outcome = await self.core.retrieve(self.user_id, request_id, timeout)
        return outcome.response(request_id)

    async def capabilities(self) -> ServerCapabilities:
        return self.core.capabilities()

    async def tokenizer_files(self, base_model: str) -> TokenizerFiles:
        return await asyncio.to_thread(self._call, self.core.tokenizer_files, base_model)

    async def list_runs(self) -> list[TrainingRun]:
        return self._call(self.core.list_runs, self.user_id)

    async def get_run(self, run_id: str) -> TrainingRun:
        return self._call(self.core.get_run, self.user_id, run_id)

    async def log_metrics(self, run_id: str, request: LogMetricsRequest) -> LogMetricsResponse:
        # its JSON form, as over HTTP: the core validates what the wire would carry
        return self._call(self.core.log_metrics, self.user_id, run_id, request.model_dump(mode="json"))

    async def run_metrics(self, run_id: str) -> list[StepMetrics]:
        return self._call(self.core.run_metrics, self.user_id, run_id)

    async def usage(self) -> Usage:
        return self._call(self.core.usage, self.user_id)

    async def run_usage(self, run_id: str) -> RunUsage:
        return self._call(self.core.run_usage, self.user_id, run_id)

    async def list_checkpoints(self, run_id: str | None) -> list[Checkpoint]:
        return self._call(self.core.list_checkpoints, self.user_id, run_id)

    async def delete_checkpoint(self, path: str) -> None:
        self._call(self.core.delete_checkpoint, self.user_id, path)

    async def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> Checkpoint:
        return self._call(self.core.set_checkpoint_ttl, self.user_id, path,
                          {"ttl_seconds": ttl_seconds})

    async def download_checkpoint(self, path: str, dest: Path, progress: bool) -> Path:
        link, name = self._call(self.core.checkpoint_archive, self.user_id, path)
        target = dest / name if dest.is_dir() else dest
        try:
            shutil.copyfile(link, target)
        finally:
            link.unlink(missing_ok=True)
        return target

    async def close(self) -> None:
        pass

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        with _mapped_errors():
            return fn(*args)


@contextlib.contextmanager
def _mapped_errors() -> Iterator[None]:
    """The core's ServiceError -> the SDK's exception tree, as the HTTP transport maps it."""
    from trio_server.core import ServiceError

    try:
        yield
    except ServiceError as exc:
        error = error_from_category(exc.category, exc.message, status=exc.status)
        error.retry_after = exc.retry_after
        raise error from None
