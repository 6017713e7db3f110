"""ServiceClient: the entry point. Picks a transport and creates the other clients.

With no base URL configured (neither ``base_url=`` nor ``PYTRIO_BASE_URL``) it runs
the service in this process on the bundled model catalog: the embedded default.
"""

from __future__ import annotations

import os

from . import types as t
from .errors import validated
from .futures import on_background, sync_twin
from .rest import RestClient
from .sampling import SamplingClient, new_sampling_client
from .session import Session
from .training import TrainingClient
from .transport import Transport


class ServiceClient:
    """Connect to TRIO.

    Args:
        base_url: a ``trio serve`` address; default ``$PYTRIO_BASE_URL``, else in-process.
        api_key: the key from ``trio keys create``; default ``$PYTRIO_API_KEY``.
        timeout: seconds for one HTTP exchange (long polls wait at most 30 s each).
        transport: an explicit transport (e.g. ``LocalTransport(core)``), overriding the above.

    Example:
        >>> service = trio.ServiceClient()
        >>> trainer = service.create_lora_training_client(base_model=..., rank=32)
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 60.0,
        transport: Transport | None = None,
    ):
        base_url = base_url or os.environ.get("PYTRIO_BASE_URL")
        self._session = Session(transport or _default_transport(base_url, api_key, timeout))
        self.base_url = base_url

    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> TrainingClient:
        """A new LoRA training run on ``base_model`` (B starts at zero: no change yet).

        Raises:
            ValidationError: unknown model (the message lists the available ones), bad rank.
        """
        lora = validated(t.LoraConfig, rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn,
                         train_unembed=train_unembed)
        request = t.CreateModelRequest(base_model=base_model, lora_config=lora)
        created = await self._session.call("create_model", request, t.CreateModelResponse)
        return TrainingClient(self._session, created.model_id, created.base_model)

    async def create_sampling_client_async(
        self, base_model: str | None = None, model_path: str | None = None
    ) -> SamplingClient:
        """A sampler on a base model, or on saved weights (``trio://...`` path)."""
        return await new_sampling_client(self._session, base_model=base_model, model_path=model_path)

    async def create_training_client_from_state_async(self, path: str) -> TrainingClient:
        """A new run starting from a ``trio://<run>/weights/<name>`` checkpoint (fresh optimizer)."""
        return await self._from_state(path, with_optimizer=False)

    async def create_training_client_from_state_with_optimizer_async(self, path: str) -> TrainingClient:
        """A new run resuming weights and optimizer state from a checkpoint."""
        return await self._from_state(path, with_optimizer=True)

    async def _from_state(self, path: str, with_optimizer: bool) -> TrainingClient:
        request = t.CreateModelFromStateRequest(path=path, with_optimizer=with_optimizer)
        created = await self._session.call("create_model_from_state", request, t.CreateModelResponse)
        return TrainingClient(self._session, created.model_id, created.base_model)

    async def get_server_capabilities_async(self) -> t.ServerCapabilities:
        """Supported models and request limits."""
        return await on_background(self._session.transport.capabilities())

    create_lora_training_client = sync_twin(create_lora_training_client_async)
    create_sampling_client = sync_twin(create_sampling_client_async)
    create_training_client_from_state = sync_twin(create_training_client_from_state_async)
    create_training_client_from_state_with_optimizer = sync_twin(create_training_client_from_state_with_optimizer_async)
    get_server_capabilities = sync_twin(get_server_capabilities_async)

    def create_rest_client(self) -> RestClient:
        """Runs and checkpoints: list, inspect, delete, download."""
        return RestClient(self._session)

    async def close_async(self) -> None:
        """Close this client's connections now rather than when it is collected (each left
        open warned ``ResourceWarning: unclosed transport`` then). The clients made from it
        share them: a later call of any of them opens new ones. Runs and samplers on the
        service are not touched. Also ``with ServiceClient(...) as service:``."""
        await on_background(self._session.transport.close())

    close = sync_twin(close_async)

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ServiceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close_async()


def _default_transport(base_url: str | None, api_key: str | None, timeout: float) -> Transport:
    if base_url:
        from .transport.http import HttpTransport

        return HttpTransport(base_url, api_key or os.environ.get("PYTRIO_API_KEY"), timeout)
    from .transport.local import LocalTransport

    return LocalTransport()
