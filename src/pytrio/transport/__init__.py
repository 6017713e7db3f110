"""How the SDK reaches a service: ``LocalTransport`` (in-process core, the embedded
default) or ``HttpTransport`` (``trio serve``). Both speak the same operations with the
same pydantic types, so a client behaves the same over either."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

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


class Transport(Protocol):
    async def submit(self, op: str, body: dict[str, Any], idempotency_key: str) -> str: ...

    async def retrieve(self, request_id: str, timeout: float) -> FutureResponse: ...

    async def capabilities(self) -> ServerCapabilities: ...

    async def tokenizer_files(self, base_model: str) -> TokenizerFiles: ...

    async def list_runs(self) -> list[TrainingRun]: ...

    async def get_run(self, run_id: str) -> TrainingRun: ...

    async def log_metrics(self, run_id: str, request: LogMetricsRequest) -> LogMetricsResponse: ...

    async def run_metrics(self, run_id: str) -> list[StepMetrics]: ...

    async def usage(self) -> Usage: ...

    async def run_usage(self, run_id: str) -> RunUsage: ...

    async def list_checkpoints(self, run_id: str | None) -> list[Checkpoint]: ...

    async def delete_checkpoint(self, path: str) -> None: ...

    async def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> Checkpoint: ...

    async def download_checkpoint(self, path: str, dest: Path, progress: bool) -> Path: ...

    async def close(self) -> None: ...
