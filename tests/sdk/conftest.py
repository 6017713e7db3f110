"""Client fixtures: every client test runs through both transports.

``local``: the service core in this process (the embedded default's path).
``http``:  the same core behind the FastAPI app on a loopback port, with API keys.
"""

from __future__ import annotations

import signal
import socket
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn in a daemon thread of this process, on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
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
    def __init__(self, data_dir, port):
        self.data_dir, self.port = data_dir, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self):
        cmd = [sys.executable, "-m", "pytrio.cli", "serve", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        self.log = open(self.data_dir / f"serve-{time.time()}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/api/v1/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("trio serve did not come up")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def create_key(self) -> str:
        out = subprocess.run([sys.executable, "-m", "pytrio.cli", "keys", "create", "--name", "t",
                              "--data-dir", str(self.data_dir)], capture_output=True, text=True, check=True)
        return out.stdout.strip()


@pytest.fixture(scope="session")
def http_server(tmp_path_factory):
    from trio_server.app import create_app
    from trio_server.core import ServiceCore

    core = ServiceCore(tmp_path_factory.mktemp("http-core"), dtype="float32")
    server = ServerThread(create_app(core, auth=True))
    server.core = core
    yield server
    server.stop()
    core.close()


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
