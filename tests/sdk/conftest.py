"""Client fixtures: every client test runs through both transports.

``local``: the service core in this process (the embedded default's path).
``http``:  the same core behind the FastAPI app on a loopback port, with API keys.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest


@pytest.fixture(scope="session")
def local_core(tmp_path_factory):
    from trio_server.core import ServiceCore

    core = ServiceCore(tmp_path_factory.mktemp("local-core"), dtype="float32")
    yield core
    core.close()


class ServerThread:
    """uvicorn in a daemon thread of this process, on a port the OS picks (bound first,
    so nothing else can take it between choosing and serving)."""

    def __init__(self, app):
        import uvicorn

        from trio_server.cli import listen

        sock = listen("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


class ServeProcess:
    """``trio serve`` in a subprocess. The first start binds port 0 and reads the port the
    process itself reports (with its pid), so the server answering is the one started;
    a restart binds that same port again."""

    def __init__(self, data_dir, *extra_args: str):
        self.data_dir, self.extra_args = data_dir, list(extra_args)
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120):
        cmd = [sys.executable, "-m", "trio_server.cli", "serve", "--port", str(self.port),
               "--data-dir", str(self.data_dir), *self.extra_args]
        log_path = self.data_dir / f"serve-{time.time()}.log"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        listening = re.compile(rf"TRIO listening on http://127\.0\.0\.1:(\d+) \(pid {self.proc.pid}\)")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trio serve exited with {self.proc.returncode}:\n{log_path.read_text()[-3000:]}")
            match = listening.search(log_path.read_text())
            if match:
                self.port = int(match[1])
                try:
                    if httpx.get(self.url + "/api/v1/healthz", timeout=1).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"trio serve did not come up:\n{log_path.read_text()[-3000:]}")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def create_key(self) -> str:
        out = subprocess.run([sys.executable, "-m", "trio_server.cli", "keys", "create", "--name", "t",
                              "--data-dir", str(self.data_dir)], capture_output=True, text=True, check=True)
        return out.stdout.strip()


@contextlib.contextmanager
def core_server(data_dir):
    """A fresh fp32 ServiceCore behind the app (API keys on) in a ServerThread; ``.core``."""
    from trio_server.app import create_app
    from trio_server.core import ServiceCore

    core = ServiceCore(data_dir, dtype="float32")
    server = ServerThread(create_app(core, auth=True))
    server.core = core
    try:
        yield server
    finally:
        server.stop()
        core.close()


@pytest.fixture(scope="session")
def http_server(tmp_path_factory):
    with core_server(tmp_path_factory.mktemp("http-core")) as server:
        yield server


@pytest.fixture(params=["local", "http"])
def service(request):
    """A ServiceClient over each transport."""
    import pytrio as trio
    from pytrio.transport.local import LocalTransport

    if request.param == "local":
        return trio.ServiceClient(transport=LocalTransport(request.getfixturevalue("local_core")))
    server = request.getfixturevalue("http_server")
    key = server.core.store.create_api_key("tests")
    return trio.ServiceClient(base_url=server.url, api_key=key)
