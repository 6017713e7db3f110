"""RestClient: the user's training runs, checkpoints and token usage."""

from __future__ import annotations

import os
from pathlib import Path

from . import types as t
from .errors import validated
from .futures import on_background, sync_twin
from .session import Session


class RestClient:
    """Inspect and manage runs and checkpoints. Every method has an ``_async`` twin."""

    def __init__(self, session: Session):
        self._session = session
        self._transport = session.transport

    async def list_training_runs_async(self) -> list[t.TrainingRun]:
        return await on_background(self._transport.list_runs())

    async def get_training_run_async(self, run_id: str) -> t.TrainingRun:
        return await on_background(self._transport.get_run(run_id))

    async def get_run_metrics_async(self, run_id: str) -> list[t.StepMetrics]:
        """The run's steps in order, each ``StepMetrics(step, metrics)``: what the service
        recorded (``loss``, ``tokens``, the loss's ``<name>:mean``, ``grad_norm``,
        ``learning_rate``) merged with what ``TrainingClient.log_metrics`` added.

        Raises:
            NotFoundError: no such run of yours.
        """
        return await on_background(self._transport.run_metrics(run_id))

    async def get_usage_async(self) -> t.Usage:
        """This API key's token usage: totals, one row per run, and its budget (None:
        unlimited). ``trained``: forward_backward datum tokens; ``prefilled``: forward datum
        tokens and sample/compute_logprobs prompt tokens (once per request); ``sampled``:
        generated tokens. Only successful requests count.

        Example:
            >>> u = rest.get_usage(); print(u.total, u.budget_tokens)
        """
        return await on_background(self._transport.usage())

    async def get_run_usage_async(self, run_id: str) -> t.RunUsage:
        """One run's token usage, sampling from its saved weights included.

        Raises:
            NotFoundError: no such run of yours.
        """
        return await on_background(self._transport.run_usage(run_id))

    async def list_checkpoints_async(self, run_id: str) -> list[t.Checkpoint]:
        """Checkpoints of one run."""
        return await on_background(self._transport.list_checkpoints(run_id))

    async def list_user_checkpoints_async(self) -> list[t.Checkpoint]:
        """All of this user's checkpoints."""
        return await on_background(self._transport.list_checkpoints(None))

    async def delete_checkpoint_async(self, path: str) -> None:
        await on_background(self._transport.delete_checkpoint(path))

    async def set_checkpoint_ttl_async(self, path: str, ttl_seconds: int | None) -> t.Checkpoint:
        """The service removes the checkpoint ``ttl_seconds`` from now (at most ten years);
        None keeps it until deleted. Returns it with its new ``expires_at``.

        Raises:
            ValidationError: a TTL that is not a whole number of seconds from 1 to ten
                years, at the call (nothing is sent), as ``save_state``'s.
            NotFoundError: no such checkpoint of yours (or it has expired already).
        """
        ttl_seconds = validated(t.CheckpointTTL, ttl_seconds=ttl_seconds).ttl_seconds
        return await on_background(self._transport.set_checkpoint_ttl(path, ttl_seconds))

    async def download_checkpoint_archive_async(self, path: str, dest: str | Path = ".", progress: bool = True) -> Path:
        """Download a checkpoint as a .tar into ``dest``: a folder (an existing one, or any
        path ending in ``/``, made if need be) or a file name. Returns the file's path.

        Over HTTP an interrupted download resumes where it stopped (range requests).
        """
        folder = Path(dest)
        if str(dest).endswith(("/", os.sep)):  # a folder by its trailing slash (Path drops it)
            folder.mkdir(parents=True, exist_ok=True)
        return await on_background(self._transport.download_checkpoint(path, folder, progress))

    list_training_runs = sync_twin(list_training_runs_async)
    get_training_run = sync_twin(get_training_run_async)
    get_run_metrics = sync_twin(get_run_metrics_async)
    get_usage = sync_twin(get_usage_async)
    get_run_usage = sync_twin(get_run_usage_async)
    list_checkpoints = sync_twin(list_checkpoints_async)
    list_user_checkpoints = sync_twin(list_user_checkpoints_async)
    delete_checkpoint = sync_twin(delete_checkpoint_async)
    set_checkpoint_ttl = sync_twin(set_checkpoint_ttl_async)
    download_checkpoint_archive = sync_twin(download_checkpoint_archive_async)
