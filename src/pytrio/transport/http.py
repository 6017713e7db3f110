"""HTTP transport to ``trio serve``: httpx on the SDK's background loop.

All the protocol's decisions (what to retry, how errors map) live in ``Session`` and
``errors``; this class only moves bytes and turns HTTP failures into SDK errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from ..errors import ConnectionError as TrioConnectionError
from ..errors import TimeoutError as TrioTimeoutError
from ..errors import TrioError, error_from_category, error_from_status
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

API = "/api/v1"


class HttpTransport:
    def __init__(self, base_url: str, api_key: str | None, timeout: float = 60.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = headers
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        # created lazily, on the background loop that will use it
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=self.headers, timeout=self.timeout,
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
            )
        return self._client

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self.client.request(method, API + path, **kwargs)
        except httpx.TimeoutException as exc:
            raise TrioTimeoutError(f"{method} {path}: timed out ({exc})") from exc
        except httpx.TransportError as exc:
            raise TrioConnectionError(f"{method} {path}: cannot reach {self.base_url} ({exc})") from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    async def submit(self, op: str, body: dict[str, Any], idempotency_key: str) -> str:
        response = await self._request("POST", f"/{op}", json=body, headers={"Idempotency-Key": idempotency_key})
        return response.json()["request_id"]

    async def retrieve(self, request_id: str, timeout: float) -> FutureResponse:
        response = await self._request(
            "POST", "/retrieve_future", json={"request_id": request_id, "timeout": timeout},
            timeout=timeout + self.timeout,
        )
        return FutureResponse.model_validate_json(response.content)

    async def capabilities(self) -> ServerCapabilities:
        return ServerCapabilities.model_validate_json((await self._request("GET", "/capabilities")).content)

    async def tokenizer_files(self, base_model: str) -> TokenizerFiles:
        response = await self._request("GET", "/tokenizer", params={"base_model": base_model})
        return TokenizerFiles.model_validate_json(response.content)

    async def list_runs(self) -> list[TrainingRun]:
        return _RUNS.validate_json((await self._request("GET", "/runs")).content)

    async def get_run(self, run_id: str) -> TrainingRun:
        return TrainingRun.model_validate_json((await self._request("GET", f"/runs/{run_id}")).content)

    async def log_metrics(self, run_id: str, request: LogMetricsRequest) -> LogMetricsResponse:
        response = await self._request("POST", f"/runs/{quote(run_id, safe='')}/metrics", json=request.model_dump(mode="json"))
        return LogMetricsResponse.model_validate_json(response.content)

    async def run_metrics(self, run_id: str) -> list[StepMetrics]:
        return _STEPS.validate_json((await self._request("GET", f"/runs/{quote(run_id, safe='')}/metrics")).content)

    async def usage(self) -> Usage:
        return Usage.model_validate_json((await self._request("GET", "/usage")).content)

    async def run_usage(self, run_id: str) -> RunUsage:
        return RunUsage.model_validate_json((await self._request("GET", f"/runs/{quote(run_id, safe='')}/usage")).content)

    async def list_checkpoints(self, run_id: str | None) -> list[Checkpoint]:
        params = {"run_id": run_id} if run_id else {}
        return _CHECKPOINTS.validate_json((await self._request("GET", "/checkpoints", params=params)).content)

    async def delete_checkpoint(self, path: str) -> None:
        await self._request("DELETE", "/checkpoints", params={"path": path})

    async def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> Checkpoint:
        reply = await self._request("PUT", "/checkpoints/ttl", params={"path": path}, json={"ttl_seconds": ttl_seconds})
        return Checkpoint.model_validate_json(reply.content)

    async def download_checkpoint(self, path: str, dest: Path, progress: bool) -> Path:
        """Stream the archive to ``<dest>.part``, resuming from its size with a Range request.

        A resume names the archive it continues (``If-Range`` with the ETag saved beside
        the part): if the checkpoint was saved again since, the server sends the whole new
        archive instead of splicing two. A part that already holds every byte (416) is done.
        """
        from tqdm import tqdm

        name = path.removeprefix("trio://").replace("/", "-") + ".tar"
        target = dest / name if dest.is_dir() else dest
        partial = target.with_name(target.name + ".part")
        etag_file = target.with_name(target.name + ".part.etag")
        start = partial.stat().st_size if partial.exists() and etag_file.exists() else 0
        headers = {"Range": f"bytes={start}-", "If-Range": etag_file.read_text()} if start else {}
        try:
            async with self.client.stream("GET", API + "/checkpoints/archive", params={"path": path}, headers=headers) as r:
                if r.status_code == 416 and r.headers.get("content-range") == f"bytes */{start}":
                    pass  # the part is the whole archive: an earlier call stopped after the last byte
                elif r.status_code >= 400:
                    await r.aread()
                    raise _error(r)
                else:
                    if r.status_code != 206:  # the server sent the whole (maybe new) file
                        start = 0
                    etag_file.write_text(r.headers.get("etag", ""))
                    total = start + int(r.headers.get("content-length", 0))
                    with open(partial, "ab" if start else "wb") as f, tqdm(
                        total=total, initial=start, unit="B", unit_scale=True, desc=name, disable=not progress
                    ) as bar:
                        async for chunk in r.aiter_bytes():
                            f.write(chunk)
                            bar.update(len(chunk))
        except httpx.ConnectError as exc:  # nothing started
            raise TrioConnectionError(f"cannot reach the service to download {path} ({exc})") from exc
        except httpx.TransportError as exc:
            raise TrioConnectionError(f"download of {path} interrupted; call again to resume ({exc})") from exc
        partial.replace(target)
        etag_file.unlink(missing_ok=True)
        return target

    async def close(self) -> None:
        client, self._client = self._client, None  # a later call opens a new one
        if client is not None:
            await client.aclose()


_RUNS = TypeAdapter(list[TrainingRun])
_CHECKPOINTS = TypeAdapter(list[Checkpoint])
_STEPS = TypeAdapter(list[StepMetrics])


def _error(response: httpx.Response) -> TrioError:
    try:
        info = response.json()["error"]
        error = error_from_category(info["category"], info["message"], status=response.status_code)
        error.seq_unused = info.get("seq_unused") is True
    except Exception:  # not TRIO's error body: a proxy's page, or no TRIO server at that URL
        error = error_from_status(response.status_code, _foreign_reply(response))
    error.retry_after = _retry_after(response.headers.get("retry-after"))
    return error


def _foreign_reply(response: httpx.Response) -> str:
    """A line for an error reply that is not TRIO's: an HTML page is named, not dumped."""
    text = response.text.strip()
    if text[:15].lower().startswith(("<!doctype html", "<html")):
        return (f"{response.status_code} {response.reason_phrase} from {response.request.url}: an HTML page, not a "
                "TRIO reply (a proxy's, or no `trio serve` at this base URL)")
    return text[:500] or response.reason_phrase


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds; the HTTP-date form is ignored (clocks differ), as is garbage."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None
