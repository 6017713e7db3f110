"""Recovery paths of the service, each inside the real worker and engine:

- a run's missing sequence number is skipped after the configured gap;
- a run with no step yet comes back after a restart or an offload, numerically unchanged;
- evicted sampler adapters reload and give identical samples;
- an interrupted HTTP checkpoint download resumes with a Range request, byte for byte.

Nothing here waits a fixed time: each test waits for its condition (long polls,
``wait_until``) and only timeouts it configures small make that quick.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import httpx
import pytest

import pytrio as trio
from pytrio import types as t
from pytrio.futures import run_sync
from pytrio.transport.local import LocalTransport
from trio_server.app import create_app
from trio_server.core import Limits, ServiceCore
from trio_server.engine import snapshot_path

from ..polling import wait_until
from ..sdk.conftest import ServerThread

MODEL = "trio/tiny-llama"


def datum(n: int = 6) -> trio.Datum:
    toks = list(range(1, n + 2))
    return trio.Datum(model_input=trio.ModelInput.from_ints(toks[:-1]),
                      loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * n})



def wait_done(transport: LocalTransport, request_id: str, timeout: float = 60) -> t.FutureResponse:
    """Long-poll a request until it is no longer pending."""
    deadline = time.monotonic() + timeout
    while True:
        state = run_sync(transport.retrieve(request_id, 5.0))
        if state.status != "pending":
            return state
        assert time.monotonic() < deadline, f"{request_id} still pending: {state.queue_state}"


def logprobs(out: trio.ForwardBackwardOutput) -> list[float]:
    return out.loss_fn_outputs[0]["logprobs"].tolist()


# -- a. a sequence number that never arrives ------------------------------------------


def test_missing_seq_is_skipped_after_the_gap_and_later_seqs_run_in_order(tmp_path, caplog):
    gap = 0.5
    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(seq_gap_seconds=gap))
    transport = LocalTransport(core)
    svc = trio.ServiceClient(transport=transport)
    adam = {"learning_rate": 0.05}
    d = datum().model_dump(mode="json")

    ref = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=3)  # the same steps, no gap
    ref.forward_backward([datum()])
    ref.optim_step(trio.AdamParams(**adam))
    expected = logprobs(ref.forward([datum()]).result())

    run = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=3).model_id
    caplog.set_level(logging.WARNING, logger="trio.server")
    started = time.monotonic()
    ids = [  # seq 0 is never sent (say, its submit failed for good); the rest go at once
        run_sync(transport.submit("forward_backward", {"model_id": run, "seq": 1, "data": [d]}, "k1")),
        run_sync(transport.submit("optim_step", {"model_id": run, "seq": 2, "adam_params": adam}, "k2")),
        run_sync(transport.submit("forward", {"model_id": run, "seq": 3, "data": [d]}, "k3")),
    ]
    first = wait_done(transport, ids[0])
    waited = time.monotonic() - started
    assert first.status == "done", first.error
    assert waited >= gap  # it waited the configured gap for seq 0 before going on
    assert any("never arrived" in r.getMessage() and run in r.getMessage() for r in caplog.records)

    step, fwd = (wait_done(transport, i) for i in ids[1:])
    assert step.status == "done" and step.result["metrics"]["step"] == 1.0
    assert fwd.status == "done"
    # fb(1) -> optim(2) -> forward(3) in that order: exactly the weights of the gapless run
    assert trio.ForwardBackwardOutput.model_validate(fwd.result).loss_fn_outputs[0]["logprobs"].tolist() == expected
    assert core.next_seq[run] == 4

    with pytest.raises(trio.ValidationError, match="seq: 0 was already used"):  # too late: never out of order
        run_sync(transport.submit("forward", {"model_id": run, "seq": 0, "data": [d]}, "k0"))
    core.close()


# -- b. a run with no step yet, after a restart or an offload ------------------------------


def _train_one_step(tc: trio.TrainingClient) -> tuple[float, list[float]]:
    tc.forward_backward([datum()])
    step = tc.optim_step(trio.AdamParams(learning_rate=0.05)).result().metrics["step"]
    return step, logprobs(tc.forward([datum()]).result())


@pytest.mark.parametrize("how", ["restart", "offload"])
def test_a_run_without_steps_survives_restart_and_offload(tmp_path, how):
    seed = 11
    if how == "restart":
        before = ServiceCore(tmp_path, dtype="float32")
        run_id = trio.ServiceClient(transport=LocalTransport(before)).create_lora_training_client(
            base_model=MODEL, rank=2, seed=seed).model_id
        before.close()  # the process ends; a new one starts on the same data dir
        core = ServiceCore(tmp_path, dtype="float32")
        svc = trio.ServiceClient(transport=LocalTransport(core))
        assert svc.create_rest_client().get_training_run(run_id).step == 0
    else:
        core = ServiceCore(tmp_path, dtype="float32", idle_offload_seconds=0)
        svc = trio.ServiceClient(transport=LocalTransport(core))
        run_id = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=seed).model_id
        worker = core.workers[MODEL]
        wait_until(lambda: not worker.engine.host.has_adapter(run_id), "the idle run to be offloaded")
        assert snapshot_path(core.engine_settings.snapshot_dir, run_id).exists()
        worker.idle_offload_seconds = 600  # the reference below stays resident
    resumed = trio.TrainingClient(svc._session, run_id, MODEL)  # a client that knows the run's id
    reference = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=seed)  # never left memory

    step, got = _train_one_step(resumed)
    ref_step, expected = _train_one_step(reference)
    assert step == ref_step == 1.0
    assert got == expected
    assert svc.create_rest_client().get_training_run(run_id).step == 1
    core.close()


# -- c. sampler adapters evicted and reloaded --------------------------------------------


def test_evicted_sampler_adapters_reload_with_identical_output(tmp_path, monkeypatch):
    core = ServiceCore(tmp_path, dtype="float32", limits=Limits(max_sampler_adapters=1))
    svc = trio.ServiceClient(transport=LocalTransport(core))
    tc = svc.create_lora_training_client(base_model=MODEL, rank=2, seed=5)
    paths = []
    for k in range(3):  # three different sets of weights
        tc.forward_backward([datum()])
        tc.optim_step(trio.AdamParams(learning_rate=0.1))
        paths.append(tc.save_weights_for_sampler(f"s{k}").result().path)

    engine = core.workers[MODEL].engine
    host = engine.host
    loads: list[str] = []
    real_load = host.load_sampler_weights

    def counting_load(adapter_id: str, folder: str) -> None:
        loads.append(Path(folder).name)
        real_load(adapter_id, folder)

    monkeypatch.setattr(host, "load_sampler_weights", counting_load)
    prompt = trio.ModelInput.from_ints([1, 2, 3, 4, 5])
    params = trio.SamplingParams(max_tokens=8, temperature=0.0)

    def sample(sampler: trio.SamplingClient) -> tuple[list[int], list[float]]:
        seq = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
        loaded = [a for a in host.adapters if a.startswith("sampler-")]
        assert len(loaded) <= 1 and len(engine.sampler_adapters) <= 1, loaded  # the limit holds
        return seq.tokens, seq.logprobs

    samplers, fresh = [], []
    for path in paths:  # sample each right after it is created: loaded, never evicted yet
        samplers.append(svc.create_sampling_client(model_path=path))
        fresh.append(sample(samplers[-1]))
    assert len({tuple(lp) for _, lp in fresh}) == 3  # the three really differ
    assert loads == ["s0", "s1", "s2"]

    passes = [[sample(s) for s in samplers] for _ in range(2)]
    assert loads[3:] == ["s0", "s1", "s2"] * 2  # every sample after the first reloads evicted weights
    assert passes[0] == fresh and passes[1] == fresh
    core.close()


# -- d. an interrupted checkpoint download, resumed over HTTP ---------------------------


class _CutStream(httpx.AsyncByteStream):
    """The body of a response that breaks off after ``limit`` bytes."""

    def __init__(self, inner: httpx.AsyncByteStream, limit: int):
        self.inner, self.limit = inner, limit

    async def __aiter__(self):
        sent = 0
        async for chunk in self.inner:
            if sent + len(chunk) >= self.limit:
                yield chunk[: self.limit - sent]
                raise httpx.ReadError("connection lost (test)")
            sent += len(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class _CuttingTransport(httpx.AsyncBaseTransport):
    """Real HTTP, except that the first archive download breaks off after ``limit`` bytes."""

    def __init__(self, limit: int):
        self.inner, self.limit, self.cuts = httpx.AsyncHTTPTransport(), limit, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/checkpoints/archive") and self.cuts == 0:
            self.cuts += 1
            assert isinstance(response.stream, httpx.AsyncByteStream)
            return httpx.Response(response.status_code, headers=response.headers,
                                  stream=_CutStream(response.stream, self.limit), extensions=response.extensions)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(scope="module")
def archive_server(tmp_path_factory):
    core = ServiceCore(tmp_path_factory.mktemp("download"), dtype="float32")
    app = create_app(core, auth=True)
    seen: list[tuple[str | None, int, int]] = []  # (Range header, status, body length) per archive GET

    @app.middleware("http")
    async def record(request, call_next):
        response = await call_next(request)
        if request.url.path.endswith("/checkpoints/archive"):
            seen.append((request.headers.get("range"), response.status_code,
                         int(response.headers.get("content-length", -1))))
        return response

    srv = ServerThread(app)
    srv.core, srv.seen = core, seen
    key = core.store.create_api_key("dl")
    tc = trio.ServiceClient(base_url=srv.url, api_key=key).create_lora_training_client(
        base_model=MODEL, rank=8, seed=2)
    tc.forward_backward([datum()])
    tc.optim_step(trio.AdamParams(learning_rate=0.05))
    srv.key, srv.path = key, tc.save_state("ckpt").result().path  # adapter + optimizer: several chunks
    r = httpx.get(srv.url + "/api/v1/checkpoints/archive", params={"path": srv.path},
                  headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    srv.archive, srv.etag = r.content, r.headers["etag"]
    yield srv
    srv.stop()
    core.close()


@pytest.mark.parametrize("interruption", ["connection-cut", "partial-file-left"])
def test_interrupted_download_resumes_with_a_range_request(archive_server, tmp_path, interruption):
    srv = archive_server
    full = srv.archive
    cut = len(full) // 3
    assert 0 < cut < len(full) - cut, len(full)
    svc = trio.ServiceClient(base_url=srv.url, api_key=srv.key)
    rest = svc.create_rest_client()
    dest = tmp_path / "downloads"
    dest.mkdir()

    if interruption == "connection-cut":
        http = svc._session.transport
        http._client = httpx.AsyncClient(base_url=http.base_url, headers=http.headers, timeout=http.timeout,
                                         transport=_CuttingTransport(cut))
        with pytest.raises(trio.ConnectionError, match="resume"):
            rest.download_checkpoint_archive(srv.path, dest=dest, progress=False)
        partial = [p for p in dest.iterdir() if p.name.endswith(".part")]
        assert len(partial) == 1, list(dest.iterdir())
        assert partial[0].read_bytes() == full[:cut]  # what the client kept of the broken transfer
    else:
        name = rest.download_checkpoint_archive(srv.path, dest=tmp_path, progress=False).name
        (dest / (name + ".part")).write_bytes(full[:cut])  # as an earlier, interrupted process left it
        (dest / (name + ".part.etag")).write_text(srv.etag)  # with the archive it was part of

    srv.seen.clear()
    target = rest.download_checkpoint_archive(srv.path, dest=dest, progress=False)
    assert target.read_bytes() == full
    assert [p.name for p in dest.iterdir()] == [target.name]  # the partial file became the target
    assert srv.seen == [(f"bytes={cut}-", 206, len(full) - cut)]  # only the rest was sent
    # each response's own link to the archive went with it, the one cut short too
    wait_until(lambda: not list((srv.core.data_dir / "archives").glob(".serving-*")), "no download's link left")


def test_download_cut_after_the_last_byte_completes_on_the_next_call(archive_server, tmp_path):
    """The stream broke after every byte had arrived: the next call must finish, not fail forever."""
    srv = archive_server
    svc = trio.ServiceClient(base_url=srv.url, api_key=srv.key)
    http = svc._session.transport
    http._client = httpx.AsyncClient(base_url=http.base_url, headers=http.headers, timeout=http.timeout,
                                     transport=_CuttingTransport(len(srv.archive)))
    rest = svc.create_rest_client()
    with pytest.raises(trio.ConnectionError, match="resume"):
        rest.download_checkpoint_archive(srv.path, dest=tmp_path, progress=False)
    parts = [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
    assert [p.read_bytes() for p in parts] == [srv.archive]  # all there, still ".part"
    target = rest.download_checkpoint_archive(srv.path, dest=tmp_path, progress=False)
    assert target.read_bytes() == srv.archive


def test_resume_after_the_checkpoint_was_replaced_gives_the_new_archive(archive_server, tmp_path):
    """Saving under a used name with overwrite=True replaces a checkpoint; a resumed download must not splice the old
    archive's first bytes onto the new one's rest."""
    srv = archive_server
    svc = trio.ServiceClient(base_url=srv.url, api_key=srv.key)
    rest = svc.create_rest_client()
    tc = svc.create_lora_training_client(base_model=MODEL, rank=8, seed=9)
    tc.forward_backward([datum()])
    tc.optim_step(trio.AdamParams(learning_rate=0.05))
    path = tc.save_state("replaced").result().path
    old = rest.download_checkpoint_archive(path, dest=tmp_path, progress=False)
    old_bytes = old.read_bytes()
    old_etag = httpx.get(srv.url + "/api/v1/checkpoints/archive", params={"path": path},
                         headers={"Authorization": f"Bearer {srv.key}"}).headers["etag"]
    dest = tmp_path / "downloads"
    dest.mkdir()
    (dest / (old.name + ".part")).write_bytes(old_bytes[: len(old_bytes) // 2])  # interrupted earlier
    (dest / (old.name + ".part.etag")).write_text(old_etag)

    tc.forward_backward([datum()])
    tc.optim_step(trio.AdamParams(learning_rate=0.05))
    assert tc.save_state("replaced", overwrite=True).result().path == path  # the checkpoint is replaced
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    new_bytes = rest.download_checkpoint_archive(path, dest=fresh, progress=False).read_bytes()
    assert new_bytes != old_bytes

    resumed = rest.download_checkpoint_archive(path, dest=dest, progress=False)
    assert resumed.read_bytes() == new_bytes


def test_a_download_whose_checkpoint_is_deleted_as_it_starts_sends_it_whole(archive_server, tmp_path,
                                                                             monkeypatch):
    """A delete (or TTL sweep) unlinked the archive between the route finding it and the
    response opening it: a Content-Length, then no bytes. The download's own link keeps
    the file, and goes with the response; the checkpoint is gone for the next one."""
    import tarfile

    srv = archive_server
    svc = trio.ServiceClient(base_url=srv.url, api_key=srv.key)
    path = svc.create_lora_training_client(base_model=MODEL, rank=8, seed=3).save_state("doomed").result().path
    real = srv.core.checkpoint_archive

    def deleted_as_it_starts(user_id: str, archived: str):
        served = real(user_id, archived)
        srv.core.delete_checkpoint(user_id, archived)
        return served

    monkeypatch.setattr(srv.core, "checkpoint_archive", deleted_as_it_starts)
    rest = svc.create_rest_client()
    target = rest.download_checkpoint_archive(path, dest=tmp_path, progress=False)
    with tarfile.open(target) as tar:
        assert any(name.endswith(".safetensors") for name in tar.getnames())
    archives = srv.core.data_dir / "archives"
    wait_until(lambda: not list(archives.glob(".serving-*")), "the download's link removed after it")
    monkeypatch.undo()
    with pytest.raises(trio.NotFoundError):
        rest.download_checkpoint_archive(path, dest=tmp_path / "again", progress=False)


def test_links_of_downloads_a_crash_cut_short_go_at_the_next_start(tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    (archives / ".serving-0123-run-a-weights-w.tar").write_bytes(b"left by a crash")
    (archives / "run-a-weights-w.tar").write_bytes(b"an archive")
    ServiceCore(tmp_path, dtype="float32").close()
    assert [p.name for p in archives.iterdir()] == ["run-a-weights-w.tar"]


def test_concurrent_downloads_of_one_archive_each_get_the_whole_archive(tmp_path):
    """Routes run in a thread pool: downloads of one checkpoint at once all build its
    archive. They shared one temporary file, truncating and renaming each other's (500s,
    and a 200 with an empty body); each must get the complete archive."""
    import tarfile
    import threading

    from trio_server import checkpoints as ckpt

    folder = tmp_path / "checkpoints" / "run-abc" / "weights" / "w1"
    folder.mkdir(parents=True)
    contents = {f"part{i}.bin": os.urandom(2 << 20) for i in range(3)}
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    start, results = threading.Barrier(6), []

    def download() -> None:
        start.wait()
        try:
            with tarfile.open(ckpt.archive(folder, tmp_path / "archives")) as tar:
                results.append({m.name.split("/")[-1]: tar.extractfile(m).read() for m in tar if m.isfile()})
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=download) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [contents] * 6
    assert [p.name for p in (tmp_path / "archives").iterdir()] == ["run-abc-weights-w1.tar"]  # no debris
