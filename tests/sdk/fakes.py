"""Fakes shared by the SDK tests (fakes over mocks: real classes, no network)."""

from __future__ import annotations

from pathlib import Path

from pytrio import types as t


class OperationsOnly:
    """The Transport protocol's REST half, unused by tests of submit/retrieve: a fake
    transport inherits this and writes only ``submit`` and ``retrieve``."""

    async def capabilities(self) -> t.ServerCapabilities:
        raise NotImplementedError

    async def tokenizer_files(self, base_model: str) -> t.TokenizerFiles:
        raise NotImplementedError

    async def list_runs(self) -> list[t.TrainingRun]:
        raise NotImplementedError

    async def get_run(self, run_id: str) -> t.TrainingRun:
        raise NotImplementedError

    async def list_checkpoints(self, run_id: str | None) -> list[t.Checkpoint]:
        raise NotImplementedError

    async def delete_checkpoint(self, path: str) -> None:
        raise NotImplementedError

    async def download_checkpoint(self, path: str, dest: Path, progress: bool) -> Path:
        raise NotImplementedError

    async def close(self) -> None:
        pass
